"""A private duplicate cached on a user's communicator, for functions that take a process group
on every call (``average_parameters``, communication hooks) and must not ``Dup`` each time.

The duplicate is stored as an MPI attribute of the user's communicator (the standard MPI idiom
for library state): it is made on first use and released when the user frees the communicator.
"""
from __future__ import annotations

import functools
from typing import Optional

from .group import ProcessGroup, resolve
from .mpi import MPI

__all__ = ["private_comm"]


def _release(comm: MPI.Comm, keyval: int, group: ProcessGroup) -> None:
    # The user's communicator is being freed: drop our duplicate with it.
    group.close()


@functools.lru_cache(maxsize=None)
def _keyval() -> int:
    return MPI.Comm.Create_keyval(delete_fn=_release)


def private_comm(process_group: Optional[MPI.Comm] = None) -> MPI.Comm:
    """The library's private duplicate of ``process_group`` (``None`` is ``MPI.COMM_WORLD``).

    Collective on the first call for a communicator (it calls ``Dup``), local afterwards.
    ``MPI.COMM_NULL`` is returned as is, for ranks outside a ``Split``.
    """
    parent = resolve(process_group)
    if parent == MPI.COMM_NULL:
        return MPI.COMM_NULL
    group = parent.Get_attr(_keyval())
    if group is None:
        group = ProcessGroup(parent, owner="the library's cache on a user's communicator")
        parent.Set_attr(_keyval(), group)
    return group.comm
