"""Agreeing on failure: a rank that fails raises, and so does every other rank of the group,
with the same message, instead of waiting in the next collective for a rank that left."""
from __future__ import annotations

from typing import Optional, Type

import numpy as np
from mpi4py import MPI


def agree(comm: MPI.Intracomm, error: Optional[BaseException], what: str,
          exc_type: Type[Exception] = RuntimeError) -> None:
    """Raise ``exc_type`` on every rank if ``error`` is set on any. Collective: one allreduce
    of a flag; only after a failure, an allgather of the messages. The message names each
    failing rank and its error."""
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
