"""Where the ranks of a communicator sit: the nodes, and groups of ranks that follow them."""
from __future__ import annotations

from typing import Optional, Tuple

from .communicators import free, split_by_node
from .mpi import MPI
from .small_collectives import all_gather_object, all_reduce_object

__all__ = ["NodeLayout"]


class NodeLayout:
    """The nodes of a communicator (the ranks that share memory, ``Split_type(COMM_TYPE_SHARED)``),
    the same on every rank. Collective: construct it on every rank of ``communicator``.

    Args:
        communicator: the ranks to place.

    Attributes:
        rank: this process's rank in ``communicator``.
        nodes: the ranks of each node, in rank order; nodes ordered by their lowest rank.
        node: the index of this rank's node in :attr:`nodes`.
        node_rank: this rank's position in its node.
    """

    def __init__(self, communicator: MPI.Intracomm) -> None:
        self.rank = communicator.Get_rank()
        shared = split_by_node(communicator)
        try:
            lowest = all_reduce_object(self.rank, shared, MPI.MIN)
        finally:
            free(shared)
        lowest_of = all_gather_object(lowest, communicator)
        self.nodes: Tuple[Tuple[int, ...], ...] = tuple(
            tuple(r for r, first in enumerate(lowest_of) if first == node_first)
            for node_first in sorted(set(lowest_of)))
        self.node = sorted(set(lowest_of)).index(lowest)
        self.node_rank = self.nodes[self.node].index(self.rank)

    @property
    def size(self) -> int:
        """The number of ranks."""
        return sum(len(ranks) for ranks in self.nodes)

    @property
    def contiguous(self) -> bool:
        """Whether every node holds a range of consecutive ranks (one node, or ranks placed by
        slot, as ``srun`` and ``mpiexec`` do by default)."""
        return all(ranks[-1] - ranks[0] + 1 == len(ranks) for ranks in self.nodes)

    @property
    def node_size(self) -> Optional[int]:
        """The number of ranks on each node, or ``None`` when nodes differ in size."""
        sizes = {len(ranks) for ranks in self.nodes}
        return sizes.pop() if len(sizes) == 1 else None

    def block(self, size: int) -> int:
        """The index of this rank's group when the ranks form groups of ``size`` that follow
        the nodes. Local: every rank decides alike, and raises alike.

        Nodes of consecutive ranks (and sizes 1 and :attr:`size`): blocks of ``size``
        consecutive ranks. Otherwise the nodes must be of one size ``m``: a ``size`` dividing
        ``m`` splits each node into blocks of consecutive node ranks, a multiple of ``m`` joins
        ``size // m`` nodes in the order of their lowest ranks, so a ``size`` equal to ``m`` is
        the nodes themselves.

        Raises:
            ValueError: ``size`` does not divide :attr:`size`, or the nodes are not
                consecutive and either differ in size or hold a number of ranks that is
                neither a multiple nor a divisor of ``size``.
        """
        world_rank = MPI.COMM_WORLD.Get_rank()
        if size < 1 or self.size % size:
            raise ValueError(f"Group size {size} must be positive and divide the {self.size} "
                             f"ranks of the process group (world rank {world_rank}).")
        if self.contiguous or size in (1, self.size):
            return self.rank // size
        per_node = self.node_size
        layout = f"nodes {[list(ranks) for ranks in self.nodes]}"
        if per_node is None:
            raise ValueError(f"Groups of {size} ranks cannot follow nodes of different sizes "
                             f"whose ranks are not consecutive ({layout}) (world rank "
                             f"{world_rank}).")
        if per_node % size == 0:
            return self.node * (per_node // size) + self.node_rank // size
        if size % per_node == 0:
            return self.node // (size // per_node)
        raise ValueError(f"Groups of {size} ranks cannot follow nodes of {per_node} ranks whose "
                         f"ranks are not consecutive ({layout}): use a size that divides "
                         f"{per_node} or is a multiple of it (world rank {world_rank}).")
