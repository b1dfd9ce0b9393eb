"""GPU support: is MPI CUDA-aware, and which GPU a rank uses.

``TENSORPLAY_HPC_CUDA_AWARE=1`` or ``0`` overrides the detection. Without an override, the MPI
library is asked (see :func:`tensorplay_hpc.comm.library.cuda_support`).
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch
from . import library
from .communicators import free, split_by_node
from .mpi import MPI

__all__ = ["CUDA_AWARE_ENV", "cuda_awareness", "device_for_rank", "is_cuda_aware", "local_rank"]

CUDA_AWARE_ENV = "TENSORPLAY_HPC_CUDA_AWARE"


def cuda_awareness() -> Tuple[bool, str]:
    """Whether device pointers may be handed straight to MPI, and how that was decided."""
    override = os.environ.get(CUDA_AWARE_ENV)
    if override is not None and override != "":
        return override.lower() in ("1", "true", "yes", "on"), f"{CUDA_AWARE_ENV}={override}"
    return library.cuda_support()


def is_cuda_aware() -> bool:
    """Whether device pointers may be handed straight to MPI."""
    return cuda_awareness()[0]


def local_rank(comm: Optional[MPI.Intracomm] = None) -> int:
    """This process's rank among the processes of its node (``Split_type(COMM_TYPE_SHARED)``)."""
    node = split_by_node(comm or MPI.COMM_WORLD)
    try:
        return node.Get_rank()
    finally:
        free(node)


def device_for_rank(comm: Optional[MPI.Intracomm] = None) -> torch.device:
    """The GPU this rank should use: node-local rank modulo the GPUs visible, else the CPU.

    Collective over ``comm`` (default ``MPI.COMM_WORLD``).
    """
    index = local_rank(comm)
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", index % torch.cuda.device_count())
