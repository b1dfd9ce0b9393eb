"""torch.distributed over gloo on the MPI ranks: the side-by-side baseline."""
from __future__ import annotations

import os
import socket

import torch.distributed as dist
from mpi4py import MPI


def init_gloo(comm: MPI.Intracomm = MPI.COMM_WORLD) -> None:
    """Start torch.distributed (gloo) on the ranks of ``comm`` if not already started.
    Collective: rank 0 picks a free local port and broadcasts it."""
    if dist.is_initialized():
        return
    port = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=comm.Get_rank(), world_size=comm.Get_size())
