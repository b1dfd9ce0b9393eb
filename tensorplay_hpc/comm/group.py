"""Process groups: mpi4py intracommunicators, and the private duplicate the library talks on."""
from __future__ import annotations

import warnings
import weakref
from typing import Optional

from .mpi import MPI

from . import fault_tolerance, lifetime, watchdog, worker
from .abort import abort_on_uncaught
from .communicators import duplicate, free

__all__ = ["ProcessGroup", "is_member", "resolve"]


def _kind(process_group: object) -> str:
    """How an error names what was passed: ``an MPI.Intercomm``, ``str``..."""
    if isinstance(process_group, MPI.Comm):
        return f"an MPI.{type(process_group).__name__}"
    return type(process_group).__qualname__


def resolve(process_group: Optional[MPI.Comm]) -> MPI.Comm:
    """Return the communicator a user meant: ``None`` is ``MPI.COMM_WORLD``.

    ``MPI.COMM_NULL`` is returned as is: it is what a rank outside a ``Split`` receives, and the
    callers treat it as "not a member". Anything else must be an intracommunicator; otherwise
    ``TypeError``, with the same message on every rank (the check is local, so every rank that
    passes an intercommunicator raises it before any collective).
    """
    if process_group is None:
        return MPI.COMM_WORLD
    if process_group == MPI.COMM_NULL:
        return MPI.COMM_NULL
    if not isinstance(process_group, MPI.Intracomm):
        hint = (" (an intercommunicator joins two groups; Intercomm.Merge() makes one "
                "intracommunicator of them)" if isinstance(process_group, MPI.Intercomm) else "")
        raise TypeError("process_group must be an mpi4py intracommunicator (MPI.Intracomm) or "
                        f"None, got {_kind(process_group)}{hint}")
    return process_group


def is_member(process_group: Optional[MPI.Comm]) -> bool:
    """Whether this process belongs to the group (``False`` for ``MPI.COMM_NULL``)."""
    return resolve(process_group) != MPI.COMM_NULL


def _free(comm: MPI.Comm, token: int) -> None:
    """Stop watching ``comm`` and free it. Collective."""
    if not MPI.Is_finalized() and comm != MPI.COMM_NULL:
        watchdog.unregister(comm)
        free(comm)
    lifetime.untrack(token)


def _collected_unclosed(comm: MPI.Comm, token: int) -> None:
    """Stop watching ``comm`` without freeing it, and warn: ``MPI_Finalize`` frees it (see
    :mod:`.lifetime`: a free is collective, and ranks collect objects at different moments).
    Local. Its worker thread ends. A group left behind by the survivors of a lost rank (its
    communicator revoked) goes without a warning."""
    worker.retire(comm)
    watchdog.forget(comm)
    fault_tolerance.forget(comm)
    description = lifetime.leave_to_finalize(token)
    if fault_tolerance.is_revoked(comm):
        return
    warnings.warn(f"{description} was collected without close() (world rank "
                  f"{MPI.COMM_WORLD.Get_rank()}): it stays allocated until MPI_Finalize; call "
                  "its owner's close() on every rank, or use the owner as a context manager",
                  ResourceWarning, stacklevel=2)


class ProcessGroup(lifetime.Closeable):
    """A private duplicate (``Dup``) of a user's communicator, so library traffic never matches
    the user's own messages. Collective: construct it on every rank of the group. When the
    :mod:`.watchdog` is on, its collectives are watched.

    The duplicate is freed by :meth:`close` (collective; ``with group:`` closes on a normal
    exit). A group collected without it warns and keeps its duplicate until ``MPI_Finalize``
    (the rule of :mod:`.lifetime`). :attr:`comm` raises ``RuntimeError`` after :meth:`close`.

    Args:
        process_group: the user's communicator; ``None`` is ``MPI.COMM_WORLD``.
        owner: what owns the group, as errors and warnings name it (``"ZeroRedundancyOptimizer"``).
    """

    def __init__(self, process_group: Optional[MPI.Comm] = None,
                 owner: str = "ProcessGroup") -> None:
        self.parent = resolve(process_group)
        if self.parent == MPI.COMM_NULL:
            raise ValueError(
                f"world rank {MPI.COMM_WORLD.Get_rank()} is not a member of the process group "
                "(it holds MPI.COMM_NULL)")
        self.owner = owner
        abort_on_uncaught()
        self._comm: MPI.Intracomm = duplicate(self.parent)
        self.rank: int = self._comm.Get_rank()
        self.size: int = self._comm.Get_size()
        # As traces name it; a duplicate of a duplicate keeps the name.
        name = self.parent.Get_name() or "unnamed"
        suffix = f" (private duplicate) of {self.size} ranks"
        self._comm.Set_name(name if name.endswith(suffix) else name + suffix)
        watchdog.register(self._comm, self._describe())
        self._token = lifetime.track(f"{owner}: communicator {self._comm.Get_name()}")
        self._finalizer = weakref.finalize(self, _collected_unclosed, self._comm, self._token)
        self._finalizer.atexit = False   # at exit MPI_Finalize frees it, without a warning

    @property
    def comm(self) -> MPI.Intracomm:
        """The private duplicate. Raises ``RuntimeError`` once the group is closed."""
        if not self._finalizer.alive:   # as check_open(), at the cost of one test
            self.check_open()
        return self._comm

    def check_open(self) -> None:
        """Raise ``RuntimeError``, naming the owner and the rank, once the group is closed."""
        if self.closed:
            raise RuntimeError(
                f"{self.owner} is closed: close() freed its private communicator "
                f"(world rank {MPI.COMM_WORLD.Get_rank()})")

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has freed the private duplicate."""
        return not self._finalizer.alive

    def _describe(self) -> str:
        name = self.parent.Get_name() or "unnamed"
        return f"{name} (private duplicate, world rank {MPI.COMM_WORLD.Get_rank()} is rank {self.rank})"

    def close(self) -> None:
        """Free the private communicator. Collective; closing again does nothing."""
        if self._finalizer.detach() is not None:
            _free(self._comm, self._token)

    def __repr__(self) -> str:
        state = ", closed" if self.closed else ""
        return f"ProcessGroup(rank={self.rank}, size={self.size}{state})"
