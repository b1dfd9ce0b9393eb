"""What the MPI library can do between the ranks of a communicator.

The one place that knows: the thread level each rank runs at (:mod:`.library` says what
raises it), whether a lost rank can be survived (ULFM), whether the ranks share a node, and
whether passive-target one-sided windows (``MPI.Win.Allocate``) work across them (Debian's Open
MPI 4.1 over TCP has no one-sided component between nodes: ``Win.Allocate`` raises
``MPI_ERR_WIN``). Every answer is agreed: the same on every rank of the communicator.

``TENSORPLAY_HPC_RMA_TRANSPORT`` (``auto``, ``shared``, ``mpi`` or ``served``) overrides the
transport remote tensors choose (see :mod:`tensorplay_hpc.distributed.rma.transport`).
"""
from __future__ import annotations

import os
from typing import List, Optional

from .communicators import allocate_window, duplicate, free, free_window, split_by_node
from . import library
from .library import thread_level, thread_level_name
from .mpi import MPI
from .small_collectives import all_gather_object, all_reduce_object

TRANSPORT_ENV = "TENSORPLAY_HPC_RMA_TRANSPORT"
TRANSPORTS = ("auto", "shared", "mpi", "served")

__all__ = ["TRANSPORTS", "TRANSPORT_ENV", "one_sided_works", "ranks_below_multiple",
           "recovery_unavailable", "requested_transport", "thread_level_name", "thread_levels",
           "within_one_node"]


def thread_levels(communicator: MPI.Intracomm) -> List[int]:
    """The thread level (``MPI.Query_thread``) of every rank, in rank order. Collective."""
    return all_gather_object(thread_level(), communicator)


def ranks_below_multiple(communicator: MPI.Intracomm) -> List[int]:
    """The ranks that run below ``MPI_THREAD_MULTIPLE`` (none: threads may call MPI
    concurrently everywhere). Collective."""
    return [rank for rank, level in enumerate(thread_levels(communicator))
            if level < MPI.THREAD_MULTIPLE]


def within_one_node(communicator: MPI.Intracomm) -> bool:
    """Whether all ranks share one node's memory (``Split_type(COMM_TYPE_SHARED)``).
    Collective."""
    node = split_by_node(communicator)
    try:
        return all_reduce_object(node.Get_size() == communicator.Get_size(), communicator,
                                 MPI.LAND)
    finally:
        free(node)


def one_sided_works(communicator: MPI.Intracomm) -> bool:
    """Whether passive-target windows from ``MPI.Win.Allocate`` can be made over
    ``communicator``: a tiny one is tried (and freed) on a duplicate. Collective."""
    probe = duplicate(communicator)
    try:
        try:
            window = allocate_window(probe, 8, shared=False)
        except MPI.Exception:
            made = False
        else:
            free_window(window, probe)
            made = True
        return all_reduce_object(made, probe, MPI.LAND)
    finally:
        free(probe)


def requested_transport() -> str:
    """The transport ``TENSORPLAY_HPC_RMA_TRANSPORT`` asks for (``auto`` when unset). Local.

    Raises:
        ValueError: the variable names no transport.
    """
    value = os.environ.get(TRANSPORT_ENV, "").strip().lower() or "auto"
    if value not in TRANSPORTS:
        raise ValueError(f"{TRANSPORT_ENV}={value!r} on world rank {MPI.COMM_WORLD.Get_rank()}: "
                         f"choose one of {', '.join(TRANSPORTS)}")
    return value


def recovery_unavailable() -> Optional[str]:
    """Why the survivors of a lost rank cannot go on in this job (``None``: they can, with
    :mod:`.fault_tolerance`): mpi4py lacks ULFM's calls, the MPI library lacks ULFM, or the job
    was not launched with fault tolerance on. Local: the same on every rank of one launch."""
    if not all(hasattr(MPI.Comm, name) for name in ("Revoke", "Shrink", "Agree", "Get_failed")):
        return "this mpi4py has no Comm.Revoke, Shrink, Agree and Get_failed (mpi4py 4 has them)"
    if not library.has_ulfm():
        return (f"the MPI library ({library.family()} {library.version()}) has no ULFM "
                "(Open MPI 5 has it: ompi_info says 'FT MPI support: yes')")
    if library.family() != "open-mpi":
        return (f"recovery is supported with Open MPI 5 only; this is {library.family()} "
                f"{library.version()}")
    if not library.launched_with_fault_tolerance():
        return ("the job was not launched with fault tolerance on (Open MPI 5: mpiexec "
                f"--with-ft ulfm, which sets {library.FT_ENABLED_ENV}=1)")
    return None
