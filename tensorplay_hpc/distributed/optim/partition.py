"""The sorted-greedy partition of parameters over ranks, as ZeroRedundancyOptimizer uses it.

Parameters are numbered globally in param-group order (the numbering of an optimizer's
``state_dict``). Within each group they are taken largest first (by ``numel``; equal sizes keep
their order) and each goes to the rank with the smallest load so far (ties to the lowest rank).
Loads carry over from one group to the next, so adding a group never moves earlier parameters.
This is the assignment PyTorch's ``ZeroRedundancyOptimizer`` makes, so shards line up with it.
"""
from __future__ import annotations

import heapq
from typing import List, Sequence

__all__ = ["Partition"]


class Partition:
    """Which rank owns which parameter.

    Args:
        group_numels: the ``numel`` of each parameter, one list per param group.
        world_size: the number of ranks sharing the parameters.

    Attributes:
        rank_of: the owning rank of each parameter, by global index.
        loads: the number of elements each rank owns.
        groups: ``groups[g][r]``, the global indices rank ``r`` owns in group ``g``, in the order
            the rank's local optimizer holds them (largest first).
    """

    def __init__(self, group_numels: Sequence[Sequence[int]], world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be positive, got {world_size}")
        self.world_size = world_size
        self.rank_of: List[int] = []
        self.loads: List[int] = [0] * world_size
        self.groups: List[List[List[int]]] = []
        for numels in group_numels:
            self.add_group(numels)

    @classmethod
    def assigned(cls, rank_of: Sequence[int], world_size: int,
                 numels: Sequence[int]) -> "Partition":
        """A one-group partition with the given owners (kept in index order on each rank)."""
        partition = cls([], world_size)
        partition.rank_of = list(rank_of)
        per_rank: List[List[int]] = [[] for _ in range(world_size)]
        for index, rank in enumerate(rank_of):
            per_rank[rank].append(index)
            partition.loads[rank] += int(numels[index])
        partition.groups.append(per_rank)
        return partition

    def add_group(self, numels: Sequence[int]) -> List[List[int]]:
        """Assign a new group's parameters (numbered after all earlier ones); returns its
        ``[rank] -> global indices`` lists."""
        first = len(self.rank_of)
        self.rank_of.extend([-1] * len(numels))
        per_rank: List[List[int]] = [[] for _ in range(self.world_size)]
        least_loaded = [(load, rank) for rank, load in enumerate(self.loads)]  # a heap
        heapq.heapify(least_loaded)
        largest_first = sorted(range(len(numels)), key=numels.__getitem__, reverse=True)
        for position in largest_first:
            rank = least_loaded[0][1]
            per_rank[rank].append(first + position)
            self.rank_of[first + position] = rank
            self.loads[rank] += int(numels[position])
            heapq.heapreplace(least_loaded, (self.loads[rank], rank))
        self.groups.append(per_rank)
        return per_rank

    def owned(self, rank: int) -> List[List[int]]:
        """The global indices ``rank`` owns, one list per group."""
        return [group[rank] for group in self.groups]

    def __len__(self) -> int:
        return len(self.rank_of)
