"""Ending the whole job when one rank fails, instead of leaving the others in a collective.

A rank that dies of an uncaught exception would otherwise run its exit handlers, among them
mpi4py's ``MPI_Finalize``, which waits for the other ranks while they wait for it in their next
collective: the job never ends. So the first process group made on more than one rank installs
the abort for the main thread (:func:`abort_on_uncaught`); :func:`abort_on_exception` also covers
every other thread.
"""
from __future__ import annotations

import sys
import threading
import traceback
from types import TracebackType
from typing import Callable, Optional, Type

from .mpi import MPI

__all__ = ["ExceptHook", "abort_on_exception", "abort_on_uncaught"]

ExceptHook = Callable[[Type[BaseException], BaseException, Optional[TracebackType]], None]

_installed = False


def _aborting(exit_code: int, report: Optional[ExceptHook] = None) -> ExceptHook:
    """A ``sys.excepthook`` that names this rank, reports the exception (with ``report``, the
    hook it replaces, when given: a user's or IPython's; else the traceback), then aborts every
    rank of ``MPI.COMM_WORLD``."""
    rank = MPI.COMM_WORLD.Get_rank()

    def abort(kind: Type[BaseException], value: BaseException,
              tb: Optional[TracebackType]) -> None:
        sys.stderr.write(f"[rank {rank}] uncaught exception, aborting the job:\n")
        if report is None:
            sys.stderr.write("".join(traceback.format_exception(kind, value, tb)))
        else:
            report(kind, value, tb)
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(exit_code)

    return abort


def abort_on_exception(exit_code: int = 1) -> None:
    """Make an uncaught exception on this rank (main thread or another) print its traceback,
    prefixed with the rank, and abort every rank of ``MPI.COMM_WORLD`` at once. Local."""
    global _installed
    abort = _aborting(exit_code)
    sys.excepthook = abort
    threading.excepthook = lambda args: abort(args.exc_type, args.exc_value, args.exc_traceback)
    _installed = True


def abort_on_uncaught() -> None:
    """Once per process, on more than one rank, outside an interactive interpreter: make an
    uncaught exception in the main thread report it as before, name this rank and abort every
    rank of ``MPI.COMM_WORLD``. Local; called when a process group is made."""
    global _installed
    if _installed or MPI.COMM_WORLD.Get_size() == 1 or hasattr(sys, "ps1") or sys.flags.interactive:
        return
    previous = sys.excepthook
    sys.excepthook = _aborting(1, None if previous is sys.__excepthook__ else previous)
    _installed = True
