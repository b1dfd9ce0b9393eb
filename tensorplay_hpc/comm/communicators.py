"""Making communicators (``Dup``, ``Split``, ``Split_type``): collective calls that hang when a
rank skips them, so the library makes them here, under the :mod:`.watchdog` and recorded by the
:mod:`.trace`. Each function is collective over ``comm``; the caller frees what it returns."""
from __future__ import annotations

from . import trace, watchdog
from .mpi import MPI

__all__ = ["create_group", "duplicate", "split", "split_by_node"]


def _watched(name: str, comm: MPI.Intracomm, counted: bool = True):
    return watchdog.watched(name, comm, trace.collective(name, comm, 0), counted)


def duplicate(comm: MPI.Intracomm) -> MPI.Intracomm:
    """A duplicate of ``comm`` (``Dup``): the same ranks, a separate message space."""
    with _watched("Dup", comm):
        return comm.Dup()


def create_group(comm: MPI.Intracomm, group: MPI.Group) -> MPI.Intracomm:
    """A communicator of the ranks of ``group`` (``Create_group``); ``MPI.COMM_NULL`` on the
    ranks of ``comm`` outside it. Collective over ``group``'s ranks only."""
    with _watched("Create_group", comm, counted=False):
        return comm.Create_group(group)


def split(comm: MPI.Intracomm, color: int, key: int = 0) -> MPI.Intracomm:
    """The ranks of ``comm`` with the same ``color``, ordered by ``key`` then rank (``Split``);
    ``MPI.COMM_NULL`` for a rank whose color is ``MPI.UNDEFINED``."""
    with _watched("Split", comm):
        return comm.Split(color, key)


def split_by_node(comm: MPI.Intracomm) -> MPI.Intracomm:
    """The ranks of ``comm`` that share this rank's node (``Split_type(COMM_TYPE_SHARED)``)."""
    with _watched("Split_type", comm):
        return comm.Split_type(MPI.COMM_TYPE_SHARED)
