"""Replicas: the groups of ranks that hold one copy of the replicated state (the model, a plain
optimizer's state) between them. Usually all ranks hold the same copy; under post-local SGD
across nodes each node holds its own between two averagings, and a checkpoint keeps them all."""
from __future__ import annotations

from typing import List, Optional, Tuple

from tensorplay_hpc.comm.mpi import MPI

from tensorplay_hpc.comm.private import private_comm
from tensorplay_hpc.comm.small_collectives import all_gather_object

from .format import replica_prefix

__all__ = ["Replicas"]


class Replicas:
    """The replica layout of ``comm``. Collective over ``comm`` (and ``replica_group``).

    Args:
        comm: the checkpoint's communicator.
        replica_group: the ranks of ``comm`` holding the same copy as this rank (its own
            communicator on each group); ``None``: every rank holds the same copy.

    Attributes:
        groups: the ranks (of ``comm``) of each replica, replicas ordered by their lowest rank.
        index: the replica of this rank.
    """

    def __init__(self, comm: MPI.Intracomm, replica_group: Optional[MPI.Intracomm] = None) -> None:
        rank, size = comm.Get_rank(), comm.Get_size()
        if replica_group is None:
            mine: Tuple[int, ...] = tuple(range(size))
        else:
            mine = tuple(sorted(all_gather_object(rank, private_comm(replica_group))))
        every = all_gather_object(mine, comm)
        self.groups: List[Tuple[int, ...]] = sorted(set(every))
        self.index = self.groups.index(mine)
        covered = sorted(r for group in self.groups for r in group)
        if covered != list(range(size)):
            raise ValueError(f"the replica groups {[list(g) for g in self.groups]} do not split "
                             f"the {size} ranks into disjoint groups (rank {rank})")

    @property
    def count(self) -> int:
        return len(self.groups)

    @property
    def members(self) -> Tuple[int, ...]:
        """The ranks of this rank's replica."""
        return self.groups[self.index]

    def prefix(self, replica: Optional[int] = None) -> str:
        """The folder in the file of ``replica``'s copy (default: this rank's)."""
        return replica_prefix(self.index if replica is None else replica, self.count)

    def describe(self) -> List[List[int]]:
        return [list(group) for group in self.groups]
