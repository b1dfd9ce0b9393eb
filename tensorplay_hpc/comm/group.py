"""Process groups: mpi4py intracommunicators, and the private duplicate the library talks on."""
from __future__ import annotations

import weakref
from typing import Optional

from mpi4py import MPI

from . import watchdog


def resolve(process_group: Optional[MPI.Comm]) -> MPI.Comm:
    """Return the communicator a user meant: ``None`` is ``MPI.COMM_WORLD``.

    ``MPI.COMM_NULL`` is returned as is: it is what a rank outside a ``Split`` receives, and the
    callers treat it as "not a member". Anything else must be an intracommunicator.
    """
    if process_group is None:
        return MPI.COMM_WORLD
    if process_group == MPI.COMM_NULL:
        return MPI.COMM_NULL
    if not isinstance(process_group, MPI.Intracomm):
        raise TypeError(
            "process_group must be an mpi4py intracommunicator (MPI.Intracomm) or None, "
            f"got {type(process_group).__name__} on world rank {MPI.COMM_WORLD.Get_rank()}")
    return process_group


def is_member(process_group: Optional[MPI.Comm]) -> bool:
    """Whether this process belongs to the group (``False`` for ``MPI.COMM_NULL``)."""
    return resolve(process_group) != MPI.COMM_NULL


_live: "weakref.WeakSet[ProcessGroup]" = weakref.WeakSet()


def live_groups() -> list:
    """The process groups whose private communicator has not been freed yet."""
    return [group for group in _live if group.comm != MPI.COMM_NULL]


def _free(comm: MPI.Comm) -> None:
    if not MPI.Is_finalized() and comm != MPI.COMM_NULL:
        watchdog.unregister(comm)
        comm.Free()


class ProcessGroup:
    """A private duplicate (``Dup``) of a user's communicator, so library traffic never matches
    the user's own messages. Collective: construct it on every rank of the group. When the
    :mod:`.watchdog` is on, its collectives are watched.

    The duplicate is freed by :meth:`close`, or when the object is collected.
    """

    def __init__(self, process_group: Optional[MPI.Comm] = None) -> None:
        self.parent = resolve(process_group)
        if self.parent == MPI.COMM_NULL:
            raise ValueError(
                f"world rank {MPI.COMM_WORLD.Get_rank()} is not a member of the process group "
                "(it holds MPI.COMM_NULL)")
        self.comm: MPI.Intracomm = self.parent.Dup()
        self.rank: int = self.comm.Get_rank()
        self.size: int = self.comm.Get_size()
        watchdog.register(self.comm, self._describe())
        _live.add(self)
        self._finalizer = weakref.finalize(self, _free, self.comm)

    def _describe(self) -> str:
        name = self.parent.Get_name() or "unnamed"
        return f"{name} (private duplicate, world rank {MPI.COMM_WORLD.Get_rank()} is rank {self.rank})"

    def close(self) -> None:
        """Free the private communicator. Collective."""
        self._finalizer()

    def __repr__(self) -> str:
        return f"ProcessGroup(rank={self.rank}, size={self.size})"
