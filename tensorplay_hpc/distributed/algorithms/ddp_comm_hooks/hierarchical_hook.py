"""A hierarchical allreduce hook: gradients cross the network once per node, not once per rank.

Each bucket is averaged in three nonblocking phases, each started when the previous one has
completed (DDP tests the handle during the backward pass, so the phases overlap with it):

1. reduce-scatter within the node (shared memory): node rank ``k`` gets the node's sum of part
   ``k`` of the bucket (the bucket split into as many near-equal parts as a node has ranks);
2. allreduce of part ``k`` among the ranks of node rank ``k`` of every node (the network): each
   rank sends about ``1/ranks_per_node`` of the bucket across nodes, so a node sends each
   element once, the least an allreduce between nodes can move;
3. allgather of the parts within the node (shared memory).

The result equals a flat allreduce up to the order of summation. The nodes must hold the same
number of ranks; otherwise the hook warns once and averages with a flat allreduce.

Nonblocking collectives on one communicator must start in the same order on every rank, but a
phase starts when a test finds the previous one done, which differs between ranks. So each phase
has a communicator of its own, and a bucket starts a phase only after every earlier bucket has
started it: on each communicator the buckets then come in the same order everywhere.
"""
from __future__ import annotations

import warnings
from typing import Callable, List, Optional

import torch

from tensorplay_hpc import comm
from tensorplay_hpc.comm.communicators import free, split
from tensorplay_hpc.comm.mpi import MPI

from .default_hooks import allreduce_fut

__all__ = ["HierarchicalState", "hierarchical_all_reduce", "hierarchical_allreduce_hook"]

Phase = Callable[[], Optional[comm.Work]]


class HierarchicalState(comm.Closeable):
    """The communicators of :func:`hierarchical_allreduce_hook`: this rank's node, and the
    ranks with the same position on every node. Collective: construct it, and :meth:`close` it,
    on every rank of ``process_group``.

    Args:
        process_group: the data-parallel group (``None`` is ``MPI.COMM_WORLD``).

    Attributes:
        layout: where the group's ranks sit (:class:`~tensorplay_hpc.comm.NodeLayout`).
        node, across, gather: the communicators of the three phases (this rank's node; the ranks
            at its node rank on every node; this rank's node again).
    """

    def __init__(self, process_group: Optional[MPI.Comm] = None) -> None:
        self._group = comm.ProcessGroup(process_group, owner="HierarchicalState")
        self.layout = comm.NodeLayout(self._group.comm)
        self._levels: List[comm.ProcessGroup] = []
        self._last: Optional[_Phases] = None   # the bucket started most recently
        self.uneven = self.layout.node_size is None
        if self.uneven:
            warnings.warn(f"hierarchical_allreduce_hook: the nodes hold different numbers of "
                          f"ranks ({[len(ranks) for ranks in self.layout.nodes]}); averaging "
                          "with a flat allreduce instead", stacklevel=2)
            return
        for color, key in ((self.layout.node, self.layout.node_rank),
                           (self.layout.node_rank, self.layout.node),
                           (self.layout.node, self.layout.node_rank)):
            level = split(self._group.comm, color, key)
            self._levels.append(comm.ProcessGroup(level, owner="HierarchicalState"))
            free(level)

    @property
    def node(self) -> MPI.Intracomm:
        """The ranks of this rank's node, by node rank."""
        return self._levels[0].comm

    @property
    def across(self) -> MPI.Intracomm:
        """The ranks at this rank's node rank on every node, by node."""
        return self._levels[1].comm

    @property
    def gather(self) -> MPI.Intracomm:
        """The ranks of this rank's node, by node rank (for the last phase)."""
        return self._levels[2].comm

    def close(self) -> None:
        """Free the communicators. Collective; closing again does nothing."""
        for level in self._levels:
            level.close()
        self._group.close()


class _Phases:
    """Nonblocking phases run one after another; the result is ``tensor`` once all are done.
    Phase ``i > 0`` starts only once ``ahead`` (the bucket started before, if still running)
    has started phase ``i``."""

    def __init__(self, tensor: torch.Tensor, phases: List[Phase],
                 ahead: Optional[_Phases]) -> None:
        self.tensor = tensor
        self._phases = phases
        self._ahead = ahead
        self._work = phases[0]()
        self._started = 1

    def _advance(self, block: bool) -> bool:
        while True:
            if self._work is not None:
                if block:
                    self._work.wait()
                elif not self._work.is_completed():
                    return False
                self._work = None
            if self._started == len(self._phases):
                self._ahead = None
                return True
            ahead = self._ahead
            if ahead is not None and ahead._started <= self._started:
                ahead._advance(block)
                if ahead._started <= self._started:
                    return False
            self._work = self._phases[self._started]()
            self._started += 1

    def is_completed(self) -> bool:
        """Whether every phase has completed (starting the next one when the last is done)."""
        return self._advance(block=False)

    def wait(self) -> torch.Tensor:
        """Run the remaining phases to the end; return the averaged tensor."""
        self._advance(block=True)
        return self.tensor


def _parts(numel: int, count: int) -> List[int]:
    """``numel`` split into ``count`` near-equal parts, the longer ones first."""
    base, extra = divmod(numel, count)
    return [base + (k < extra) for k in range(count)]


def hierarchical_all_reduce(state: HierarchicalState, tensor: torch.Tensor) -> object:
    """Start averaging the flat ``tensor`` in place over the state's group in three phases:
    within the node, across nodes on ``1/ranks_per_node`` of it, within the node again. Returns
    a handle whose ``wait()`` gives ``tensor`` averaged. Collective."""
    group = state._group.comm
    if state.uneven:
        return allreduce_fut(group, tensor)
    node, across, gather = state.node, state.across, state.gather
    counts = _parts(tensor.numel(), node.Get_size())
    part = tensor.new_empty(counts[node.Get_rank()])
    tensor.div_(group.Get_size())
    state._last = _Phases(tensor, [
        lambda: comm.reduce_scatter(part, tensor, node, counts, async_op=True),
        lambda: comm.all_reduce(part, across, async_op=True),
        lambda: comm.all_gather_v(tensor, counts, gather, input=part, async_op=True)],
        ahead=state._last)
    return state._last


def hierarchical_allreduce_hook(state: HierarchicalState, bucket) -> object:
    """Average the bucket's gradients with :func:`hierarchical_all_reduce`. Collective.

    Example::

        state = HierarchicalState(process_group=None)
        ddp.register_comm_hook(state, hierarchical_allreduce_hook)
        ...
        state.close()
    """
    return hierarchical_all_reduce(state, bucket.buffer())
