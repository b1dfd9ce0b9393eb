"""GPU support: is MPI CUDA-aware, and which GPU a rank uses.

``TENSORPLAY_HPC_CUDA_AWARE=1`` or ``0`` overrides the detection. Without an override, the MPI
library is asked (Open MPI's ``MPIX_Query_cuda_support``), then the environment variables that
Cray MPICH and MVAPICH2 use to switch GPU support on are read.
"""
from __future__ import annotations

import ctypes
import functools
import os
from typing import Optional, Tuple

import torch
from mpi4py import MPI

CUDA_AWARE_ENV = "TENSORPLAY_HPC_CUDA_AWARE"


def _query_library() -> Optional[bool]:
    try:
        query = ctypes.CDLL(None).MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return None
    query.restype = ctypes.c_int
    return bool(query())


@functools.lru_cache(maxsize=None)
def _detected() -> Tuple[bool, str]:
    answer = _query_library()
    if answer is not None:
        return answer, "the MPI library (MPIX_Query_cuda_support)"
    for variable in ("MPICH_GPU_SUPPORT_ENABLED", "MV2_USE_CUDA"):
        if os.environ.get(variable) == "1":
            return True, f"{variable}=1"
    return False, ("no answer from the MPI library, and neither MPICH_GPU_SUPPORT_ENABLED nor "
                   "MV2_USE_CUDA is 1")


def cuda_awareness() -> Tuple[bool, str]:
    """Whether device pointers may be handed straight to MPI, and how that was decided."""
    override = os.environ.get(CUDA_AWARE_ENV)
    if override is not None and override != "":
        return override.lower() in ("1", "true", "yes", "on"), f"{CUDA_AWARE_ENV}={override}"
    return _detected()


def is_cuda_aware() -> bool:
    """Whether device pointers may be handed straight to MPI."""
    return cuda_awareness()[0]


def local_rank(comm: Optional[MPI.Intracomm] = None) -> int:
    """This process's rank among the processes of its node (``Split_type(COMM_TYPE_SHARED)``)."""
    node = (comm or MPI.COMM_WORLD).Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_rank()
    finally:
        node.Free()


def device_for_rank(comm: Optional[MPI.Intracomm] = None) -> torch.device:
    """The GPU this rank should use: node-local rank modulo the GPUs visible, else the CPU.

    Collective over ``comm`` (default ``MPI.COMM_WORLD``).
    """
    index = local_rank(comm)
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", index % torch.cuda.device_count())
