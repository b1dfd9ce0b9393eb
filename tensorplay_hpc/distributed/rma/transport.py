"""Choosing how remote tensors travel between the ranks of a group, once per :func:`rma.share`.

- ``shared``: every rank on one node: ``Win.Allocate_shared`` windows (``osc/sm``); other ranks'
  operations are memory copies, and steps may run on the owner's memory in place.
- ``mpi``: MPI passive-target one-sided windows (``Win.Allocate``) where the library supports
  them across the ranks (RDMA or UCX networks, ``--mca osc pt2pt``).
- ``served``: otherwise, a :class:`~.served.ServedWindow`: a service thread per rank answers the
  others over point-to-point messages; it needs ``MPI_THREAD_MULTIPLE`` on every rank.

``auto`` (the default) takes the first that works; while recovery from a lost rank is on
(:func:`tensorplay_hpc.comm.fault_tolerance.enable`) it takes ``served``, the one that survives a
lost rank: MPI's windows are not fault tolerant (a lock that the lost rank held in shared memory
is never released, and the survivors would wait for it for ever).
``TENSORPLAY_HPC_RMA_TRANSPORT`` forces one.
When the choice cannot work, every rank raises the same :class:`TransportError` before any
window exists.
"""
from __future__ import annotations

from typing import List, Union

from tensorplay_hpc.comm.mpi import MPI

from tensorplay_hpc.comm import capabilities, check_consistent, fault_tolerance
from tensorplay_hpc.comm.agreement import fail_together
from tensorplay_hpc.comm.small_collectives import all_gather_object
from tensorplay_hpc.comm.capabilities import TRANSPORT_ENV, thread_level_name

from .served import ServedWindow
from .window import Window

__all__ = ["AnyWindow", "TransportError", "choose", "make_window"]

AnyWindow = Union[Window, ServedWindow]
_TO_MULTIPLE = ("run MPI at MPI_THREAD_MULTIPLE (mpi4py's default; MPI4PY_RC_THREAD_LEVEL=multiple "
                "or mpi4py.rc.thread_level = 'multiple' before importing MPI)")
_TO_ONE_SIDED = ("enable an MPI one-sided component that works between nodes (Open MPI: "
                 "`--mca osc ucx` on UCX networks, or `--mca osc pt2pt` below "
                 "MPI_THREAD_MULTIPLE)")


class TransportError(RuntimeError):
    """No transport for remote tensors works between the ranks of a group (raised on all)."""


def _levels(levels: List[int], ranks: List[int]) -> str:
    return ", ".join(f"rank {rank} runs at {thread_level_name(levels[rank])}" for rank in ranks)


def choose(communicator: MPI.Intracomm, progress_thread: bool = False) -> str:
    """The transport for windows over ``communicator``: ``shared``, ``mpi`` or ``served``.
    Collective; creates no window that outlives it (it may probe ``Win.Allocate``).

    Args:
        progress_thread: this rank wants a progress thread, which needs MPI_THREAD_MULTIPLE.

    Raises:
        TransportError: on every rank, naming the transport, the ranks and what to enable.
        ValueError: on every rank, if ``TENSORPLAY_HPC_RMA_TRANSPORT`` is invalid on any, or
            if it or whether recovery is enabled (:func:`.fault_tolerance.enable`) differs
            between ranks.
    """
    requested = None
    with fail_together(communicator, f"rma.share: reading {TRANSPORT_ENV}", ValueError,
                       catch=ValueError):
        requested = capabilities.requested_transport()
    check_consistent(communicator, f"rma.share: {TRANSPORT_ENV} and fault_tolerance.enable()",
                     [("transport", requested), ("recovery", fault_tolerance.enabled())])
    levels = capabilities.thread_levels(communicator)
    below = [rank for rank, level in enumerate(levels) if level < MPI.THREAD_MULTIPLE]
    threads = [rank for rank, wanted in enumerate(all_gather_object(progress_thread, communicator))
               if wanted and rank in below]
    if threads:
        raise TransportError(f"rma.share(progress_thread=True) needs MPI_THREAD_MULTIPLE, but "
                             f"{_levels(levels, threads)}: {_TO_MULTIPLE}")
    recovering = requested == "auto" and fault_tolerance.enabled()
    one_node = capabilities.within_one_node(communicator)
    if (requested == "shared" or requested == "auto" and not recovering) and one_node:
        return "shared"
    if requested == "shared":
        raise TransportError(f"rma.share: {TRANSPORT_ENV}=shared needs every rank on one node, "
                             "but the group spans nodes; use auto, mpi or served")
    if (requested == "mpi" or requested == "auto" and not recovering) and \
            capabilities.one_sided_works(communicator):
        return "mpi"
    if requested == "mpi":
        raise TransportError(f"rma.share: {TRANSPORT_ENV}=mpi, but MPI.Win.Allocate fails between "
                             f"these ranks (no one-sided support): {_TO_ONE_SIDED}, or use auto "
                             "or served")
    if not below:
        return "served"
    reasons = ("" if requested == "served" else
               "recovery from a lost rank is on (MPI windows do not survive one); "
               if recovering else
               "the ranks span nodes (no shared memory) and MPI.Win.Allocate fails between them "
               f"(no one-sided support); ")
    raise TransportError(f"rma.share: no transport works: {reasons}the served transport needs "
                         f"MPI_THREAD_MULTIPLE, but {_levels(levels, below)}: "
                         f"{_TO_MULTIPLE}" + ("" if requested == "served" else
                                              f"; or {_TO_ONE_SIDED}"))


def make_window(communicator: MPI.Intracomm, nbytes: int, transport: str) -> AnyWindow:
    """``nbytes`` of this rank's memory in a window of ``transport`` (from :func:`choose`).
    Collective."""
    if transport == "served":
        return ServedWindow(communicator, nbytes)
    return Window(communicator, nbytes, shared=transport == "shared")

