"""Collective writes to an MPI-IO file (``File.Write_at_all``): every rank of the communicator
the file was opened over calls them the same number of times, each with its own part (possibly
empty), so they run under the :mod:`.watchdog` and are recorded by the :mod:`.trace`."""
from __future__ import annotations

from typing import Any

from . import trace, watchdog
from .mpi import MPI

__all__ = ["write_at_all"]


def write_at_all(handle: MPI.File, comm: MPI.Intracomm, offset: int, message: Any,
                 status: MPI.Status) -> None:
    """Write ``message`` (an mpi4py buffer specification) at byte ``offset`` of ``handle``, a
    file opened over ``comm``, collectively (``Write_at_all``); ``status`` tells how many bytes
    were written. Collective over ``comm``."""
    name = "File.Write_at_all"
    with watchdog.watched(name, comm, trace.collective(name, comm, 0)):
        handle.Write_at_all(offset, message, status)
