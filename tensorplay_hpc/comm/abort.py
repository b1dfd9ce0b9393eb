"""Ending the whole job when one rank fails, instead of leaving the others in a collective."""
from __future__ import annotations

import sys
import threading
import traceback

from .mpi import MPI


def abort_on_exception(exit_code: int = 1) -> None:
    """Make an uncaught exception on this rank (main thread or another) print its traceback,
    prefixed with the rank, and abort every rank of ``MPI.COMM_WORLD`` at once."""
    rank = MPI.COMM_WORLD.Get_rank()

    def abort(kind, value, tb) -> None:
        text = "".join(traceback.format_exception(kind, value, tb))
        sys.stderr.write(f"[rank {rank}] uncaught exception, aborting the job:\n{text}")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(exit_code)

    sys.excepthook = abort
    threading.excepthook = lambda args: abort(args.exc_type, args.exc_value, args.exc_traceback)
