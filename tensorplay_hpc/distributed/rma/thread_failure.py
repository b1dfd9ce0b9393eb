"""Ending the job when a thread that serves one-sided operations fails.

Other ranks' operations on this rank's windows (a lock, a get, a flush) complete only while
such a thread runs; and one-sided windows are not fault tolerant, so after a lost rank the
operations in flight never complete. A failed thread therefore aborts every rank rather than
leave any waiting.
"""
from __future__ import annotations

import sys
import traceback

from tensorplay_hpc.comm import fault_tolerance
from tensorplay_hpc.comm.mpi import MPI

__all__ = ["end_job"]


def end_job(thread: str) -> None:
    """Report the exception being handled (call it in an ``except`` block), naming ``thread``
    and this rank, and abort every rank: with status
    :data:`~tensorplay_hpc.comm.fault_tolerance.EXIT_UNRECOVERABLE` where a rank was lost (the
    job scripts requeue the job), else 1. Local."""
    error = sys.exc_info()[1]
    rank = MPI.COMM_WORLD.Get_rank()
    if fault_tolerance.is_process_failure(error):
        sys.stderr.write(
            f"[rank {rank}] {thread}: a rank of the job was lost ({error.Get_error_string()}); "
            f"one-sided windows do not survive it, so the job is aborted with status "
            f"{fault_tolerance.EXIT_UNRECOVERABLE} rather than left waiting in a one-sided "
            f"operation\n")
        status = fault_tolerance.EXIT_UNRECOVERABLE
    else:
        sys.stderr.write(f"[rank {rank}] {thread} failed, aborting the job:\n"
                         f"{traceback.format_exc()}")
        status = 1
    sys.stderr.flush()
    MPI.COMM_WORLD.Abort(status)
