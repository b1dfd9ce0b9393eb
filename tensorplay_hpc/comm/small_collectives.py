"""Collectives on small values: Python objects (pickled by mpi4py) and small numpy arrays
(flags, counts, digests), for agreements, checks and bookkeeping rather than training data.

Each runs under the :mod:`.watchdog` and is recorded by the :mod:`.trace` like the tensor
collectives of :mod:`.collectives`, but counts as control traffic: its trace entry holds 0
bytes, so :func:`.trace.bytes_communicated` stays the bytes of data. Every function is
collective over ``comm``. The library calls no mpi4py collective outside :mod:`tensorplay_hpc.comm`;
these are what the layers above use instead of ``comm.allgather``, ``comm.Barrier`` and so on.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, TypeVar

import numpy as np

from . import library, trace, watchdog
from .mpi import MPI
from .polling import LONGEST_PAUSE_S, poll_until

__all__ = ["agree_flag", "all_gather_array", "all_gather_object", "all_reduce_array",
           "all_reduce_object", "barrier", "broadcast_array", "broadcast_object", "gather_array", "gather_object",
           "quiet_barrier", "BACKGROUND_PAUSE_S"]

T = TypeVar("T")

BACKGROUND_PAUSE_S = 2e-4
"""The longest sleep of :func:`quiet_barrier` on a communication thread beside the backward pass
(DDP's reductions, ZeRO's overlapped step): short, so that a bucket's collective starts soon
after the last rank arrives."""


def _watched(name: str, comm: MPI.Intracomm):
    """The watchdog's and the trace's context for the control collective ``name``."""
    return watchdog.watched(name, comm, trace.collective(name, comm, 0))


def all_gather_object(value: T, comm: MPI.Intracomm) -> List[T]:
    """Every rank's ``value``, in rank order."""
    with _watched("all_gather_object", comm):
        return comm.allgather(value)


def broadcast_object(value: Optional[T], comm: MPI.Intracomm, root: int = 0) -> T:
    """Rank ``root``'s ``value`` on every rank (the others' ``value`` is ignored)."""
    with _watched("broadcast_object", comm):
        return comm.bcast(value, root=root)


def all_reduce_object(value: T, comm: MPI.Intracomm, op: Any = None) -> T:
    """``value`` reduced across ranks by the MPI operation ``op`` (default ``MPI.SUM``;
    ``MPI.MAX``, ``MPI.LAND``...), on every rank."""
    with _watched("all_reduce_object", comm):
        return comm.allreduce(value, op=MPI.SUM if op is None else op)


def gather_object(value: T, comm: MPI.Intracomm, root: int = 0) -> Optional[List[T]]:
    """Every rank's ``value`` in rank order on rank ``root``; ``None`` elsewhere."""
    with _watched("gather_object", comm):
        return comm.gather(value, root=root)


def all_gather_array(mine: np.ndarray, comm: MPI.Intracomm) -> np.ndarray:
    """Every rank's equally shaped ``mine``, stacked in rank order (a new array of shape
    ``(size, *mine.shape)``)."""
    every = np.empty((comm.Get_size(), *mine.shape), dtype=mine.dtype)
    with _watched("all_gather_array", comm):
        comm.Allgather(np.ascontiguousarray(mine), every)
    return every


def all_reduce_array(array: np.ndarray, comm: MPI.Intracomm, op: Any = None) -> np.ndarray:
    """Reduce the contiguous ``array`` across ranks in place (``op`` default ``MPI.SUM``), and
    return it."""
    with _watched("all_reduce_array", comm):
        comm.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM if op is None else op)
    return array


def broadcast_array(array: np.ndarray, comm: MPI.Intracomm, root: int = 0) -> np.ndarray:
    """Copy rank ``root``'s contiguous ``array`` into ``array`` on every rank, and return it."""
    with _watched("broadcast_array", comm):
        comm.Bcast(array, root=root)
    return array


def gather_array(mine: np.ndarray, counts: Sequence[int], comm: MPI.Intracomm,
                 root: int = 0) -> Optional[np.ndarray]:
    """Every rank's contiguous 1-D ``mine`` (``counts[r]`` elements on rank ``r``),
    concatenated in rank order on rank ``root``; ``None`` elsewhere."""
    counts = [int(c) for c in counts]
    every = np.empty(sum(counts), dtype=mine.dtype) if comm.Get_rank() == root else None
    receive = None if every is None else [every, counts]
    with _watched("gather_array", comm):
        comm.Gatherv(np.ascontiguousarray(mine), receive, root=root)
    return every


def agree_flag(flag: int, comm: MPI.Intracomm) -> int:
    """The bitwise AND of every live rank's ``flag`` (``MPIX_Comm_agree``, ULFM): completes
    even when ranks have died, with the same answer on every survivor."""
    with _watched("agree_flag", comm):
        return comm.Agree(flag)


def barrier(comm: MPI.Intracomm) -> None:
    """Wait until every rank of ``comm`` has arrived (in a nonblocking barrier: under ULFM a
    blocking ``MPI_Barrier`` reported a lost rank as ``MPI_ERR_OTHER``, not as a process
    failure)."""
    with _watched("barrier", comm):
        comm.Ibarrier().Wait()


def quiet_barrier(comm: MPI.Intracomm, longest_pause: float = LONGEST_PAUSE_S) -> None:
    """Wait until every rank of ``comm`` has arrived, testing a nonblocking barrier between
    sleeps (:func:`~.polling.poll_until`, up to ``longest_pause`` seconds) instead of waiting
    inside MPI. For a background thread, or one beside a busy one: its waits then leave the
    core, and MPI's progress, to the other thread. Where such a test may stall
    (:func:`~.library.tested_collectives_stall_beside_blocking_ones`), the barrier is waited
    for inside MPI instead (still the nonblocking one, as in :func:`barrier`)."""
    with _watched("quiet_barrier", comm):
        if library.tested_collectives_stall_beside_blocking_ones():
            comm.Ibarrier().Wait()
        else:
            poll_until(comm.Ibarrier().Test, longest_pause)
