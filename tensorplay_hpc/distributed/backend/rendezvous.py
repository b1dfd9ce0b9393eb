"""Rendezvous over MPI: torch.distributed learns its ranks from MPI and gets an
:class:`~.store.MPIStore`, with no address, port or TCP server.

``init_method="mpi4py://"`` asks for it explicitly. The default ``env://`` asks for it too when
``MASTER_ADDR`` is not set (where PyTorch would fail): under ``mpiexec`` or ``srun`` a plain
``dist.init_process_group("mpi4py")`` then works, and so does ``"gloo"``.
"""
from __future__ import annotations

import importlib
import os
import urllib.parse
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch.distributed as dist

from tensorplay_hpc.comm.mpi import MPI

from .store import MPIStore

__all__ = ["SCHEME", "chosen_world", "install", "world"]

SCHEME = "mpi4py"
"""``init_method="mpi4py://"``."""

_chosen: List[MPI.Intracomm] = []
"""The communicator the group being started spans, while :func:`world` is given one."""


@contextmanager
def world(comm: Optional[MPI.Intracomm] = None) -> Iterator[MPI.Intracomm]:
    """The communicator whose ranks torch.distributed starts with: within the block, ``comm``
    (default ``MPI.COMM_WORLD``, which it is outside any block). Local."""
    _chosen.append(MPI.COMM_WORLD if comm is None else comm)
    try:
        yield _chosen[-1]
    finally:
        _chosen.pop()


def chosen_world() -> MPI.Intracomm:
    """The communicator of the innermost :func:`world` block, else ``MPI.COMM_WORLD``."""
    return _chosen[-1] if _chosen else MPI.COMM_WORLD


_stores: List[MPIStore] = []
"""Every store handed to torch.distributed. c10d keeps only the C++ part of a store written in
Python; without a Python reference the rest would be collected and its methods lost."""


def _over_mpi(url: str, timeout: Optional[timedelta] = None,
              **kwargs: Any) -> Iterator[Tuple[dist.Store, int, int]]:
    """Yield an MPI store over the :func:`chosen_world`, this process's rank and the world
    size; a ``rank`` or ``world_size`` the caller gave (torch.distributed puts them in the URL's
    query) must agree with MPI's."""
    query = urllib.parse.parse_qs(urllib.parse.urlparse(url).query)
    world = chosen_world()
    mpi_rank, mpi_size = world.Get_rank(), world.Get_size()
    for name, actual in (("rank", mpi_rank), ("world_size", mpi_size)):
        given = int(query.get(name, ["-1"])[0])
        if given != -1 and given != actual:
            raise ValueError(f"init_process_group: {name}={given} but MPI says {actual} "
                             f"(MPI world rank {mpi_rank} of {mpi_size}): under MPI leave "
                             f"rank and world_size out")
    store = MPIStore(world, timeout) if timeout is not None else MPIStore(world)
    _stores.append(store)
    yield store, mpi_rank, mpi_size
    raise RuntimeError("the MPI rendezvous happens once per process group")


def _env_or_mpi(original: Callable[..., Iterator]) -> Callable[..., Iterator]:
    def handler(url: str, **kwargs: Any) -> Iterator:
        if "MASTER_ADDR" in os.environ:
            return original(url, **kwargs)
        return _over_mpi(url, **kwargs)
    handler.over_mpi = True   # type: ignore[attr-defined]
    return handler


def install() -> None:
    """Register ``mpi4py://`` and let ``env://`` fall back on MPI. Local; idempotent; does not
    start MPI."""
    # The module, not the function torch.distributed exports under the same name.
    torch_rendezvous = importlib.import_module("torch.distributed.rendezvous")
    handlers = torch_rendezvous._rendezvous_handlers
    if SCHEME not in handlers:
        torch_rendezvous.register_rendezvous_handler(SCHEME, _over_mpi)
    env = handlers.get("env")
    if env is not None and not getattr(env, "over_mpi", False):
        handlers["env"] = _env_or_mpi(env)
