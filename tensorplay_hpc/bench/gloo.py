"""torch.distributed over gloo on the MPI ranks: the side-by-side baseline."""
from __future__ import annotations

import os
import socket

import torch.distributed as dist
from mpi4py import MPI


def free_port(comm: MPI.Intracomm = MPI.COMM_WORLD) -> int:
    """A free local TCP port, picked by rank 0 of ``comm`` and broadcast. Collective."""
    port = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    return comm.bcast(port, root=0)


def init_gloo(comm: MPI.Intracomm = MPI.COMM_WORLD) -> None:
    """Start torch.distributed (gloo) on the ranks of ``comm`` if not already started.
    Collective: rank 0 picks a free local port and broadcasts it."""
    if dist.is_initialized():
        return
    port = free_port(comm)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=comm.Get_rank(), world_size=comm.Get_size())
