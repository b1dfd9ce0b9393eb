"""The library's one handle on ``mpi4py.MPI``, imported (and MPI initialized) at first use.

``from mpi4py import MPI`` calls ``MPI_Init``, which fails outside a launcher on some machines
(a Cray login node, a Spack or EasyBuild import check). Modules of the package say
``from tensorplay_hpc.comm.mpi import MPI`` instead: the first attribute read (``MPI.COMM_WORLD``,
``MPI.SUM``...) imports ``mpi4py.MPI``. Just before that import, ``MPICH_MAX_THREAD_SAFETY`` is
set to ``multiple`` unless the user set it (Cray MPICH grants only ``MPI_THREAD_SERIALIZED``
without it, and background work then runs in the foreground).
"""
from __future__ import annotations

import os
import sys
import threading
from types import ModuleType
from typing import TYPE_CHECKING, Any, List

__all__ = ["MPI", "THREAD_SAFETY_ENV", "is_loaded", "load"]

THREAD_SAFETY_ENV = "MPICH_MAX_THREAD_SAFETY"
"""Cray MPICH's (and MPICH's) cap on the thread level; the library asks for ``multiple``."""

_lock = threading.Lock()


def is_loaded() -> bool:
    """Whether ``mpi4py.MPI`` has been imported (by the library or anyone else). Local."""
    return "mpi4py.MPI" in sys.modules


def load() -> ModuleType:
    """``mpi4py.MPI``, imported now if it was not (this initializes MPI). Local."""
    module = sys.modules.get("mpi4py.MPI")
    if module is not None:
        return module
    with _lock:
        if "mpi4py.MPI" not in sys.modules:
            os.environ.setdefault(THREAD_SAFETY_ENV, "multiple")
        from mpi4py import MPI as module
    return module


class _LazyMPI:
    """Stands for ``mpi4py.MPI``: the first attribute read imports it, and then copies its
    names here, so later reads cost what a module attribute does."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)   # copy, pickle and friends probe these: no MPI_Init
        module = load()
        names = self.__dict__
        if not names:
            names.update((k, v) for k, v in vars(module).items() if not k.startswith("__"))
        return getattr(module, name)

    def __dir__(self) -> List[str]:
        return dir(load())

    def __repr__(self) -> str:
        return "<mpi4py.MPI, imported at first use>" if not is_loaded() else repr(load())


if TYPE_CHECKING:
    from mpi4py import MPI
else:
    MPI = _LazyMPI()
    """``mpi4py.MPI``, imported at the first attribute read."""
