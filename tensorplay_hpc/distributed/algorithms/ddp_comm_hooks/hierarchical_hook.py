"""A hierarchical allreduce hook: gradients cross the network once per node, not once per rank.

Each bucket is averaged in three phases, run one after another as blocking collectives on the
node communicator's worker thread (:func:`tensorplay_hpc.comm.in_background`), so that they
overlap the backward pass:

1. reduce-scatter within the node (shared memory): node rank ``k`` gets the node's sum of part
   ``k`` of the bucket (the bucket split into as many near-equal parts as a node has ranks);
2. allreduce of part ``k`` among the ranks of node rank ``k`` of every node (the network): each
   rank sends about ``1/ranks_per_node`` of the bucket across nodes, so a node sends each
   element once, the least an allreduce between nodes can move;
3. allgather of the parts within the node (shared memory).

The result equals a flat allreduce up to the order of summation. The nodes must hold the same
number of ranks; otherwise the hook warns once and averages with a flat allreduce.

The buckets queue in the order DDP starts them, the same on every rank, so each communicator
sees their phases in the same order everywhere. One job per bucket runs all three phases: on
more ranks than cores, handing each phase to the next thread cost a scheduling delay each.
"""
from __future__ import annotations

import warnings
from typing import List, Optional

import torch

from tensorplay_hpc import comm
from tensorplay_hpc.comm.communicators import free, split
from tensorplay_hpc.comm.mpi import MPI

from .default_hooks import BucketWork, allreduce_fut

__all__ = ["HierarchicalState", "hierarchical_all_reduce", "hierarchical_allreduce_hook"]


class HierarchicalState(comm.Closeable):
    """The communicators of :func:`hierarchical_allreduce_hook`: this rank's node, and the
    ranks with the same position on every node. Collective: construct it, and :meth:`close` it,
    on every rank of ``process_group``.

    Args:
        process_group: the data-parallel group (``None`` is ``MPI.COMM_WORLD``).

    Attributes:
        layout: where the group's ranks sit (:class:`~tensorplay_hpc.comm.NodeLayout`).
        node, across: the communicators of the phases (this rank's node; the ranks at its node
            rank on every node).
    """

    def __init__(self, process_group: Optional[MPI.Comm] = None) -> None:
        self._group = comm.ProcessGroup(process_group, owner="HierarchicalState")
        self.layout = comm.NodeLayout(self._group.comm)
        self._levels: List[comm.ProcessGroup] = []
        self.uneven = self.layout.node_size is None
        if self.uneven:
            warnings.warn(f"hierarchical_allreduce_hook: the nodes hold different numbers of "
                          f"ranks ({[len(ranks) for ranks in self.layout.nodes]}); averaging "
                          "with a flat allreduce instead", stacklevel=2)
            return
        for color, key in ((self.layout.node, self.layout.node_rank),
                           (self.layout.node_rank, self.layout.node)):
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

    def close(self) -> None:
        """Free the communicators. Collective; closing again does nothing."""
        for level in self._levels:
            level.close()
        self._group.close()


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
    node, across = state.node, state.across
    counts = _parts(tensor.numel(), node.Get_size())
    part = tensor.new_empty(counts[node.Get_rank()])
    tensor.div_(group.Get_size())

    def phases() -> None:
        comm.reduce_scatter(part, tensor, node, counts)
        comm.all_reduce(part, across)
        comm.all_gather_v(tensor, counts, node, input=part)
    return BucketWork(tensor, comm.in_background(node, phases))


def hierarchical_allreduce_hook(state: HierarchicalState, bucket) -> object:
    """Average the bucket's gradients with :func:`hierarchical_all_reduce`. Collective.

    Example::

        state = HierarchicalState(process_group=None)
        ddp.register_comm_hook(state, hierarchical_allreduce_hook)
        ...
        state.close()
    """
    return hierarchical_all_reduce(state, bucket.buffer())
