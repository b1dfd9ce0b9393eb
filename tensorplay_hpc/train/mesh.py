"""The device mesh of the ``fsdp`` and ``hsdp`` kinds, on torch.distributed over our ``mpi4py``
backend: one dimension of every rank (ZeRO-3), or (replicate, shard) = (nodes, ranks within a
node) for hybrid sharding."""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.distributed as dist

import tensorplay_hpc.distributed  # noqa: F401  (registers the mpi4py backend)
from tensorplay_hpc import comm
from tensorplay_hpc.comm import fault_tolerance
from tensorplay_hpc.comm.mpi import MPI
from tensorplay_hpc.distributed.backend import MPIProcessGroup, init_process_group

__all__ = ["TorchDistributed", "hybrid_shape"]


def hybrid_shape(layout: comm.NodeLayout) -> Tuple[Tuple[Tuple[int, ...], ...], str]:
    """The ranks of each replica (a row: the ranks sharding one copy) for hybrid sharding, and
    a line saying how they were chosen. Several nodes of one size: a row per node. One node:
    rows of the smallest divisor of the ranks that is at least their square root (2 x 2 for 4
    ranks, one row of 2 for 2), so the replicate dimension is exercised where it can be.
    Local: every rank decides alike.

    Raises:
        ValueError: the nodes hold different numbers of ranks.
    """
    if len(layout.nodes) > 1:
        if layout.node_size is None:
            raise ValueError(f"--optimizer hsdp needs the same number of ranks on every node, "
                             f"got nodes of {[len(n) for n in layout.nodes]} ranks (world rank "
                             f"{MPI.COMM_WORLD.Get_rank()})")
        return layout.nodes, (f"hsdp: {len(layout.nodes)} replicas (one per node) of "
                              f"{layout.node_size} shards")
    size = layout.size
    shards = next(d for d in range(math.isqrt(size - 1) + 1, size + 1) if size % d == 0)
    rows = tuple(tuple(range(r, r + shards)) for r in range(0, size, shards))
    replicas = "1 replica" if len(rows) == 1 else f"{len(rows)} replicas"
    return rows, (f"hsdp: one node, so {replicas} of {shards} shards each (the replicas are "
                  "rows of consecutive ranks, not nodes)")


def _lost_a_rank() -> bool:
    """Whether torch.distributed's default group is ours and lost a rank (its communicator
    revoked). Local."""
    default = dist.distributed_c10d._get_default_group()
    return isinstance(default, MPIProcessGroup) and fault_tolerance.is_revoked(default.comm)


class TorchDistributed(comm.Closeable):
    """torch.distributed's default group on the ``mpi4py`` backend over the ranks of ``world``
    (default ``MPI.COMM_WORLD``), started if no one started it (or again, where the running one
    lost a rank), and the device mesh for ``kind``. Collective: construct and :meth:`close` it
    on every rank of ``world``.

    Attributes:
        mesh: the ``DeviceMesh`` (1-D for ``fsdp``; ``("replicate", "shard")`` for ``hsdp``).
        description: one line saying the mesh's shape.
    """

    def __init__(self, kind: str, device_type: str, world: Optional[MPI.Intracomm] = None) -> None:
        from torch.distributed.device_mesh import DeviceMesh
        world = MPI.COMM_WORLD if world is None else world
        if dist.is_initialized() and _lost_a_rank():
            dist.destroy_process_group()   # to start again on the survivors
        self._started = not dist.is_initialized()
        if self._started:
            init_process_group(world)
        size = dist.get_world_size()
        if kind == "fsdp":
            self.mesh = DeviceMesh(device_type, torch.arange(size), mesh_dim_names=("shard",))
            self.description = f"fsdp: parameters, gradients and optimizer state in {size} shards"
            return
        rows, self.description = hybrid_shape(comm.NodeLayout(world))
        self.mesh = DeviceMesh(device_type, torch.tensor(rows),
                               mesh_dim_names=("replicate", "shard"))

    def close(self) -> None:
        """End torch.distributed, if this object started it. Collective, but after a lost rank
        (the groups' communicators revoked, left to ``MPI_Finalize``)."""
        if self._started and dist.is_initialized():
            dist.destroy_process_group()
