"""Making and freeing what belongs to the ranks of a communicator together: communicators
(``Dup``, ``Split``, ``Split_type``, ``Create_group``, ``Free``), one-sided windows
(``Win.Allocate``, ``Win.Allocate_shared``, ``Win.Free``) and MPI-IO files (``File.Open``,
``File.Close``). These are collective calls that hang when a rank skips them, so the library makes
them here, under the :mod:`.watchdog` and recorded by the :mod:`.trace`. Each function is
collective over the communicator it takes; the caller frees what it returns, with the matching
function here."""
from __future__ import annotations

from typing import Optional

from . import fault_tolerance, trace, watchdog, worker
from .mpi import MPI

__all__ = ["allocate_window", "close_file", "create_group", "duplicate", "free", "free_window",
           "open_file", "shrink", "split", "split_by_node"]


def _watched(name: str, comm: MPI.Intracomm, counted: bool = True):
    return watchdog.watched(name, comm, trace.collective(name, comm, 0), counted)


def _registered(comm: MPI.Comm) -> MPI.Comm:
    """``comm``, counted among those revoked when a rank is lost (with recovery on)."""
    if comm != MPI.COMM_NULL:
        fault_tolerance.register(comm)
    return comm


def duplicate(comm: MPI.Intracomm) -> MPI.Intracomm:
    """A duplicate of ``comm`` (``Dup``): the same ranks, a separate message space."""
    with _watched("Dup", comm):
        return _registered(comm.Dup())


def create_group(comm: MPI.Intracomm, group: MPI.Group) -> MPI.Intracomm:
    """A communicator of the ranks of ``group`` (``Create_group``); ``MPI.COMM_NULL`` on the
    ranks of ``comm`` outside it. Collective over ``group``'s ranks only."""
    with _watched("Create_group", comm, counted=False):
        return _registered(comm.Create_group(group))


def split(comm: MPI.Intracomm, color: int, key: int = 0) -> MPI.Intracomm:
    """The ranks of ``comm`` with the same ``color``, ordered by ``key`` then rank (``Split``);
    ``MPI.COMM_NULL`` for a rank whose color is ``MPI.UNDEFINED``."""
    with _watched("Split", comm):
        return _registered(comm.Split(color, key))


def split_by_node(comm: MPI.Intracomm) -> MPI.Intracomm:
    """The ranks of ``comm`` that share this rank's node (``Split_type(COMM_TYPE_SHARED)``)."""
    with _watched("Split_type", comm):
        return _registered(comm.Split_type(MPI.COMM_TYPE_SHARED))


def shrink(comm: MPI.Intracomm) -> MPI.Intracomm:
    """The ranks of ``comm`` still alive (``MPIX_Comm_shrink``, ULFM): collective over them
    only, and it completes even on a revoked ``comm``."""
    with _watched("Shrink", comm):
        return _registered(comm.Shrink())


def free(comm: MPI.Comm) -> None:
    """Free a communicator made by a function here (``Free``), after the calls queued to
    its worker have run."""
    worker.stop(comm)
    fault_tolerance.forget(comm)
    with _watched("Free", comm):
        comm.Free()


def allocate_window(comm: MPI.Intracomm, nbytes: int, shared: bool,
                    info: Optional[MPI.Info] = None) -> MPI.Win:
    """A window of ``nbytes`` (each rank its own count, 0 allowed) of memory that MPI allocates
    on this rank, addressed in bytes: in memory the node's ranks share (``Win.Allocate_shared``,
    every rank on one node) or not (``Win.Allocate``). Free it with :func:`free_window`."""
    info = MPI.INFO_NULL if info is None else info
    if shared:
        with _watched("Win.Allocate_shared", comm):
            return MPI.Win.Allocate_shared(nbytes, disp_unit=1, info=info, comm=comm)
    with _watched("Win.Allocate", comm):
        return MPI.Win.Allocate(nbytes, disp_unit=1, info=info, comm=comm)


def free_window(window: MPI.Win, comm: MPI.Intracomm) -> None:
    """Free ``window``, made over ``comm`` by :func:`allocate_window` (``Win.Free``). A window
    may outlive ``comm`` (its owner freed it first): the free is then aborted on time but not
    counted, since a freed communicator no longer names its ranks."""
    with _watched("Win.Free", comm, counted=comm != MPI.COMM_NULL):
        window.Free()


def open_file(comm: MPI.Intracomm, path: str, mode: int,
              info: Optional[MPI.Info] = None) -> MPI.File:
    """``path`` opened through MPI-IO by the ranks of ``comm`` (``File.Open``), with the
    ``MPI.MODE_*`` flags ``mode`` and the hints ``info``. Close it with :func:`close_file`."""
    with _watched("File.Open", comm):
        return MPI.File.Open(comm, path, mode, MPI.INFO_NULL if info is None else info)


def close_file(handle: MPI.File, comm: MPI.Intracomm) -> None:
    """Close ``handle``, opened over ``comm`` by :func:`open_file` (``File.Close``)."""
    with _watched("File.Close", comm):
        handle.Close()
