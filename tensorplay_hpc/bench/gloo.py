"""torch.distributed over gloo on the MPI ranks, the side-by-side baseline, and a group of the
``mpi4py`` backend beside it."""
from __future__ import annotations

import os
import socket
from typing import Optional, Tuple

import torch.distributed as dist

from tensorplay_hpc.comm.mpi import MPI

__all__ = ["backend_group", "init_gloo", "rendezvous", "set_rendezvous"]


def _reachable_address() -> str:
    """An address of this host that other nodes can dial: ``MASTER_ADDR`` when set, else the
    first non-loopback address the host name resolves to (the name itself as a last resort)."""
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"]
    name = socket.gethostname()
    try:
        addresses = [info[4][0] for info in socket.getaddrinfo(name, None, socket.AF_INET)]
    except socket.gaierror:
        return name
    outside = [a for a in addresses if not a.startswith("127.")]
    return (outside or addresses or [name])[0]


def rendezvous(comm: Optional[MPI.Intracomm] = None) -> Tuple[str, int]:
    """An address of rank 0's host and a free TCP port there, broadcast to every rank of
    ``comm`` (default ``MPI.COMM_WORLD``): where torch.distributed's store listens. Collective."""
    comm = MPI.COMM_WORLD if comm is None else comm
    chosen = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            chosen = (_reachable_address(), s.getsockname()[1])
    return comm.bcast(chosen, root=0)


def set_rendezvous(comm: Optional[MPI.Intracomm] = None) -> None:
    """Set ``MASTER_ADDR`` and ``MASTER_PORT`` on every rank from :func:`rendezvous`. Collective."""
    address, port = rendezvous(comm)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = address, str(port)


def init_gloo(comm: Optional[MPI.Intracomm] = None) -> None:
    """Start torch.distributed (gloo) on the ranks of ``comm`` (default ``MPI.COMM_WORLD``) if
    not already started. Collective."""
    if dist.is_initialized():
        return
    comm = MPI.COMM_WORLD if comm is None else comm
    set_rendezvous(comm)
    dist.init_process_group("gloo", rank=comm.Get_rank(), world_size=comm.Get_size())


def backend_group(comm: Optional[MPI.Intracomm] = None) -> dist.ProcessGroup:
    """A torch.distributed group of the ``mpi4py`` backend over every rank, beside gloo's
    default group (started if it was not), so that one program can run on either. Collective."""
    import tensorplay_hpc.distributed.backend as backend   # registers the backend
    init_gloo(comm)
    return dist.new_group(backend=backend.BACKEND_NAME)
