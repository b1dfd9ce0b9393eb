"""Turning a tensor into an MPI buffer: the one place where tensors meet MPI memory.

Contiguous CPU tensors are handed to MPI zero-copy (their own memory). Anything else goes
through a staging tensor that is copied back after the operation: a contiguous copy of a strided
tensor, a float32 copy of a 16-bit float tensor that is being reduced, or a host copy (pinned) of
a GPU tensor when MPI is not CUDA-aware. GPU tensors given to a CUDA-aware MPI have their stream
synchronized first, since MPI knows nothing of CUDA streams.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from . import cuda
from .dtypes import NATIVE, move_datatype, reduce_dtype
from .mpi import MPI

__all__ = ["Staged", "direct_datatype", "host_tensor", "memory", "needs_host_copy"]


def needs_host_copy(tensor: torch.Tensor) -> bool:
    """Whether MPI cannot read ``tensor``'s memory directly."""
    return not tensor.is_cpu and not (tensor.is_cuda and cuda.is_cuda_aware())


def host_tensor(like: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """An empty contiguous host tensor shaped like ``like``; pinned when a GPU is present."""
    pin = like.device.type == "cuda"
    return torch.empty(like.shape, dtype=dtype or like.dtype, device="cpu", pin_memory=pin)


def memory(tensor: torch.Tensor, start: int = 0, count: Optional[int] = None) -> MPI.buffer:
    """Zero-copy MPI memory for elements ``[start, start + count)`` of a contiguous tensor (all
    of it by default)."""
    if not start and (count is None or count == tensor.numel()):   # the common case at once
        return MPI.buffer.fromaddress(tensor.data_ptr(), tensor.nbytes)
    size = tensor.element_size()
    if count is None:
        count = tensor.numel() - start
    address = tensor.data_ptr() + start * size if count else 0
    return MPI.buffer.fromaddress(address, count * size)


def direct_datatype(tensor: torch.Tensor) -> Optional[MPI.Datatype]:
    """The MPI datatype of a tensor MPI can take as it is (a contiguous CPU tensor of a dtype MPI
    knows), else ``None``: such a tensor needs no :class:`Staged`."""
    if not (tensor.is_cpu and tensor.is_contiguous()):
        return None
    try:   # a plain lookup: this runs on every collective
        return NATIVE[tensor.dtype]
    except KeyError:
        return None


class Staged:
    """A tensor made ready for MPI.

    Args:
        tensor: the caller's tensor.
        reduce: the operation does arithmetic, so 16-bit floats are staged in float32.
        copy_in: MPI reads the tensor's values (false for pure receive buffers).
    """

    __slots__ = ("tensor", "work", "staged", "datatype")

    def __init__(self, tensor: torch.Tensor, *, reduce: bool = False, copy_in: bool = True) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
        self.tensor = tensor
        dtype = tensor.dtype
        # The common case at once: a contiguous CPU tensor of a dtype MPI knows goes as it is.
        self.datatype: MPI.Datatype = direct_datatype(tensor)
        if self.datatype is not None:
            self.work, self.staged = tensor, False
            return
        if tensor.is_sparse:
            raise ValueError("sparse tensors cannot be communicated")
        work_dtype = reduce_dtype(dtype) if reduce else dtype
        host_copy = needs_host_copy(tensor)
        self.staged = staged = work_dtype != dtype or host_copy or not tensor.is_contiguous()
        if not staged:
            self.work = tensor
        elif host_copy:
            self.work = host_tensor(tensor, work_dtype)
        else:
            self.work = torch.empty(tensor.shape, dtype=work_dtype, device=tensor.device)
        if staged and copy_in:
            self.work.copy_(tensor)
        if self.work.is_cuda:
            torch.cuda.current_stream(self.work.device).synchronize()
        self.datatype = move_datatype(work_dtype)

    @property
    def count(self) -> int:
        return self.work.numel()

    def buf(self, start: int = 0, count: Optional[int] = None) -> List:
        """An mpi4py buffer specification ``[memory, count, datatype]`` for a range of elements."""
        if count is None:
            count = self.count - start
        return [memory(self.work, start, count), count, self.datatype]

    def finish(self) -> torch.Tensor:
        """Copy the received values back into the caller's tensor if it was staged."""
        if self.staged:
            self.tensor.copy_(self.work)
        return self.tensor
