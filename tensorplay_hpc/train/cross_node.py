"""Bytes that crossed between the nodes of a run, as the nodes' network interfaces count them."""
from __future__ import annotations

from tensorplay_hpc.bench.network import bytes_sent
from tensorplay_hpc.comm.mpi import MPI
from tensorplay_hpc.comm.node_layout import NodeLayout
from tensorplay_hpc.comm.small_collectives import all_reduce_object

__all__ = ["CrossNodeBytes"]


class CrossNodeBytes:
    """The bytes every node has sent on its network since this object was made: the sum over
    the nodes of the kernel's counters of their interfaces (loopback excluded), read by the
    lowest rank of each node. On one node it stays 0 (ranks of one node talk through shared
    memory, and the host's other traffic is none of the run's). On a real cluster the counters
    include whatever else the nodes send (file system traffic over Ethernet, for one); inside
    simulated nodes they hold the job's traffic only. Collective: construct it on every rank of
    ``comm``.
    """

    def __init__(self, comm: MPI.Intracomm) -> None:
        self._comm = comm
        layout = NodeLayout(comm)
        self._reads = len(layout.nodes) > 1 and layout.node_rank == 0
        self._start = bytes_sent() if self._reads else 0

    def total(self) -> int:
        """Bytes sent by all nodes since construction, the same on every rank. Collective."""
        mine = bytes_sent() - self._start if self._reads else 0
        return int(all_reduce_object(mine, self._comm))
