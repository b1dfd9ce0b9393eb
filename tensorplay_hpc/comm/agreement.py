"""Agreeing on failure: a rank that fails raises, and so does every other rank of the group,
with the same message, instead of waiting in the next collective for a rank that left."""
from __future__ import annotations

import time
from typing import Optional, Type

import numpy as np

from .mpi import MPI

LONGEST_PAUSE_S = 1e-3
"""The longest sleep between two tests of :func:`quiet_barrier`."""


def quiet_barrier(comm: MPI.Intracomm) -> None:
    """Wait until every rank of ``comm`` has arrived, testing a nonblocking barrier between
    sleeps (10 us, doubling up to :data:`LONGEST_PAUSE_S`) instead of waiting inside MPI. For a
    background thread: its waits then leave the core, and MPI's progress, to the main thread.
    Collective."""
    request = comm.Ibarrier()
    pause = 1e-5
    while not request.Test():
        time.sleep(pause)
        pause = min(2 * pause, LONGEST_PAUSE_S)


def agree(comm: MPI.Intracomm, error: Optional[BaseException], what: str,
          exc_type: Type[Exception] = RuntimeError, quiet: bool = False) -> None:
    """Raise ``exc_type`` on every rank if ``error`` is set on any. Collective: one allreduce
    of a flag; only after a failure, an allgather of the messages. The message names each
    failing rank and its error. ``quiet``: first wait for every rank with
    :func:`quiet_barrier`."""
    if quiet:
        quiet_barrier(comm)
    failures = np.array([error is not None], dtype=np.int32)
    comm.Allreduce(MPI.IN_PLACE, failures, op=MPI.SUM)
    if not failures[0]:
        return
    message = None if error is None else f"{type(error).__name__}: {error}"
    messages = comm.allgather(message)
    failed = [(rank, m) for rank, m in enumerate(messages) if m is not None]
    if not failed:
        return
    detail = "; ".join(f"rank {rank}: {m}" for rank, m in failed)
    raised = exc_type(f"{what} failed on {len(failed)} of {comm.Get_size()} ranks: {detail}")
    if error is not None:
        raise raised from error
    raise raised
