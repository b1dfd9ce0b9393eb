"""Surviving a lost rank with ULFM (User Level Failure Mitigation, MPI's fault-tolerance
extension: ``MPIX_Comm_revoke``, ``MPIX_Comm_agree``, ``MPIX_Comm_shrink``).

Off by default: then a lost rank ends the job as it always did. With :func:`enable` (where
:func:`~.capabilities.recovery_unavailable` finds nothing missing), a collective of the library that
fails because a rank died raises :class:`RankLost` on every survivor instead: the rank that sees
the failure first revokes every communicator of the library, so that no survivor stays blocked
in a collective with a rank that will never come, and every survivor's next (or current)
collective fails the same way. The survivors then agree on who is gone and continue on a
smaller communicator (:func:`shrink`), rebuilding their groups on it.

What ULFM cannot make safe: one-sided windows and MPI-IO files are not fault tolerant in Open
MPI 5, so a rank lost during a checkpoint write or a DistributedOptimizer step is reported like
any other, but what was being written is not to be trusted (see docs/reliability.md).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager, nullcontext
from typing import ContextManager, Dict, Iterator, List, Sequence, Set, Tuple

from .mpi import MPI

__all__ = ["EXIT_UNRECOVERABLE", "RankLost", "Unrecoverable", "agree", "disable", "enable",
           "enabled", "finalize_would_stall", "forget", "is_process_failure", "is_revoked",
           "lost_ranks", "register", "revoke", "revoke_all", "shrink", "surfacing"]

EXIT_UNRECOVERABLE = 86
"""Exit status of a job that a lost rank ended without recovery (every survivor of a training
run that could not go on, or the abort when one-sided operations can no longer complete):
requeue the job, which resumes from its last checkpoint."""

_enabled = False
_communicators: Dict[int, MPI.Comm] = {}     # the library's communicators, by handle
_shrunk_away: Set[int] = set()               # MPI.COMM_WORLD ranks that shrink() left out
_revoking = threading.Lock()


class RankLost(RuntimeError):
    """A rank of the job died during (or before) a collective of the library: raised on every
    survivor when recovery is enabled.

    Attributes:
        ranks: the ``MPI.COMM_WORLD`` ranks this rank knows to be lost (the survivors agree on
            the full set in :func:`shrink`).
        operation: the collective that failed here.
    """

    def __init__(self, ranks: Sequence[int], operation: str, detail: str) -> None:
        self.ranks: Tuple[int, ...] = tuple(ranks)
        self.operation = operation
        named = (f"world ranks {list(self.ranks)} lost" if self.ranks else
                 "a rank was lost (another survivor revoked the communicator)")
        super().__init__(f"{named}, seen by world rank {MPI.COMM_WORLD.Get_rank()} in "
                         f"{operation}: {detail}")


class Unrecoverable(RuntimeError):
    """The survivors of a lost rank cannot go on in this job (the message says why): they exit
    with :data:`EXIT_UNRECOVERABLE`."""


def enable() -> None:
    """Turn failures of the library's collectives into :class:`RankLost`. Local: call it on
    every rank, before the process groups are made."""
    global _enabled
    _enabled = True


def disable() -> None:
    """Back to the default: a lost rank ends the job. Local."""
    global _enabled
    _enabled = False


def enabled() -> bool:
    """Whether :func:`enable` was called. Local."""
    return _enabled


def is_process_failure(error: BaseException) -> bool:
    """Whether ``error`` is MPI's report of a lost rank (``MPI_ERR_PROC_FAILED``,
    ``MPI_ERR_PROC_FAILED_PENDING``) or of a communicator revoked after one
    (``MPI_ERR_REVOKED``). Local."""
    if not isinstance(error, MPI.Exception):
        return False
    classes = {getattr(MPI, name, None) for name in
               ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")}
    classes.discard(None)   # libraries without ULFM may not know these classes: the code says it
    return error.Get_error_code() in classes or error.Get_error_class() in classes


def register(comm: MPI.Comm) -> None:
    """Count ``comm`` among the communicators to revoke when a rank is lost. Local."""
    if _enabled:
        _communicators[comm.handle] = comm


def forget(comm: MPI.Comm) -> None:
    """Stop counting ``comm`` (it is being freed). Local."""
    _communicators.pop(comm.handle, None)


def is_revoked(comm: MPI.Comm) -> bool:
    """Whether ``comm`` was revoked after a lost rank (always ``False`` while recovery is off,
    where libraries without ULFM cannot be asked). Local."""
    return _enabled and comm != MPI.COMM_NULL and comm.Is_revoked()


def revoke(comms: Sequence[MPI.Comm]) -> None:
    """Revoke ``comms``: every rank still in, or next entering, an operation on one of them
    gets ``MPI_ERR_REVOKED``. Local (the revocation reaches the other ranks by itself);
    revoking twice does nothing. Threads revoke one at a time (Open MPI 5.0 crashed in
    ``MPIX_Comm_revoke`` when two threads revoked a communicator together)."""
    with _revoking:
        for comm in comms:
            if comm != MPI.COMM_NULL and not comm.Is_revoked():
                comm.Revoke()


def revoke_all(also: Sequence[MPI.Comm] = ()) -> None:
    """:func:`revoke` every registered communicator and ``also``. Local. Call it from the
    thread that recovers, before :func:`shrink`, whose survivors' communicators it would
    revoke too."""
    revoke([*_communicators.values(), *also])


def lost_ranks(comm: MPI.Comm) -> List[int]:
    """The ``MPI.COMM_WORLD`` ranks of ``comm`` this rank knows to have failed. Local: other
    ranks may know more or fewer until they agree (:func:`shrink`)."""
    comm.Ack_failed()
    failed = comm.Get_failed()
    world = MPI.COMM_WORLD.Get_group()
    try:
        return sorted(MPI.Group.Translate_ranks(failed, list(range(failed.Get_size())), world))
    finally:
        failed.Free()
        world.Free()


@contextmanager
def surfacing(operation: str, comm: MPI.Comm,
              within: ContextManager = nullcontext()) -> Iterator[None]:
    """Run a collective on ``comm`` inside ``within``; if it fails for a lost rank, revoke every
    library communicator and raise :class:`RankLost`. Local until a failure."""
    try:
        with within:
            yield
    except MPI.Exception as error:
        if not is_process_failure(error):
            raise
        revoke_all(also=[comm])
        raise RankLost(lost_ranks(comm), operation, error.Get_error_string()) from error


def shrink(comm: MPI.Intracomm) -> Tuple[MPI.Intracomm, List[int]]:
    """The survivors of ``comm`` as a new communicator, and the ``MPI.COMM_WORLD`` ranks lost,
    the same on every survivor (``MPIX_Comm_shrink`` agrees on them, with no coordinator).
    Revokes ``comm`` first. Collective over the survivors of ``comm``; the caller frees the
    result with :func:`~.communicators.free` (``comm`` is left to ``MPI_Finalize``)."""
    from .communicators import shrink as shrunk    # here: communicators registers with us
    if not comm.Is_revoked():
        comm.Revoke()
    survivors = shrunk(comm)
    before, after = comm.Get_group(), survivors.Get_group()
    world = MPI.COMM_WORLD.Get_group()
    try:
        gone = MPI.Group.Difference(before, after)
        try:
            lost = sorted(MPI.Group.Translate_ranks(gone, list(range(gone.Get_size())), world))
        finally:
            gone.Free()
    finally:
        before.Free()
        after.Free()
        world.Free()
    _shrunk_away.update(lost)
    return survivors, lost


def finalize_would_stall() -> bool:
    """Whether this process has gone on without lost ranks (:func:`shrink`): then
    ``MPI_Finalize`` can wait for them forever (Open MPI 5 does when they were on another
    node, and now and then on the same node: in 1 of 12 runs of a 3-rank job here), so the
    survivors end without it (``os._exit``) once their work is done. Local."""
    return bool(_shrunk_away)


def agree(comm: MPI.Intracomm, ok: bool) -> bool:
    """Whether ``ok`` holds on every live rank of ``comm`` (``MPIX_Comm_agree``: completes even
    when ranks die meanwhile, and every survivor gets the same answer). Collective."""
    from .small_collectives import agree_flag      # here: its watchdog imports this module
    return bool(agree_flag(int(bool(ok)), comm) & 1)

