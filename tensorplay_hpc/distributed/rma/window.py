"""A byte-addressed MPI window of CPU memory, read and written with tensors.

Each rank's part of the window is allocated by MPI and is seen locally as a ``uint8`` tensor,
from which typed views are cut. When the group lies within one node the window is made with
``Win.Allocate_shared``: Open MPI then uses its shared-memory component (``osc/sm``), where other
ranks' operations are plain memory copies that need nothing from the target. (Open MPI 4.1 gives
``Win.Allocate`` to ``osc/rdma``, whose shared-memory file is named after the communicator's id,
which the disjoint halves of a ``Split`` share: their windows would overlap.) Remote operations take contiguous CPU tensors and a byte offset in the target's
part; their memory reaches MPI only through :func:`tensorplay_hpc.comm.memory`, and messages longer
than the chunk limit are split. Operations complete at the end of the lock epoch that holds them.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Iterator, Optional, Tuple

import numpy as np
import torch
from mpi4py import MPI

from tensorplay_hpc import comm
from tensorplay_hpc.comm.dtypes import move_datatype, reduce_dtype


@functools.lru_cache(maxsize=None)
def _numpy_dtype(dtype: torch.dtype) -> Optional[np.dtype]:
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:  # bfloat16 and other dtypes NumPy lacks
        return None


def empty(shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor to fetch into.

    Its memory comes from NumPy where NumPy has the dtype: PyTorch's CPU allocator hands large
    blocks back to the system when they are freed, so every fetch into a fresh tensor would pay
    page faults (about ten times the copy itself), while NumPy's memory is reused.
    """
    numpy_dtype = _numpy_dtype(dtype)
    if numpy_dtype is None:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(np.empty(shape, dtype=numpy_dtype))


def _within_one_node(communicator: MPI.Intracomm) -> bool:
    """Whether all ranks of ``communicator`` share memory. Collective."""
    node = communicator.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return communicator.allreduce(node.Get_size() == communicator.Get_size(), op=MPI.LAND)
    finally:
        node.Free()


class Window:
    """``nbytes`` of window memory on this rank, in a window over ``communicator``.

    Collective: every rank of ``communicator`` constructs it (``nbytes`` may differ, or be 0), and
    :meth:`free` it.
    """

    def __init__(self, communicator: MPI.Intracomm, nbytes: int) -> None:
        if _within_one_node(communicator):
            info = MPI.Info.Create()
            info.Set("alloc_shared_noncontig", "true")  # each rank's part on its own pages
            self.win = MPI.Win.Allocate_shared(nbytes, disp_unit=1, info=info, comm=communicator)
            info.Free()
        else:
            self.win = MPI.Win.Allocate(nbytes, disp_unit=1, comm=communicator)
        self.rank = communicator.Get_rank()
        if nbytes:
            self.local = torch.frombuffer(self.win.tomemory(), dtype=torch.uint8)
        else:
            self.local = torch.empty(0, dtype=torch.uint8)

    def view(self, offset: int, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` viewing this rank's memory from byte ``offset``."""
        numel = torch.Size(shape).numel()
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        return self.local[offset:offset + nbytes].view(dtype).view(shape)

    def _transfer(self, method, tensor: torch.Tensor, rank: int, offset: int, **kwargs) -> None:
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"window operations need contiguous CPU tensors (rank {self.rank})")
        datatype = move_datatype(tensor.dtype)
        size = tensor.element_size()
        for start, count in comm.chunks(tensor.numel()):
            method([comm.memory(tensor, start, count), count, datatype], rank,
                   target=(offset + start * size, count, datatype), **kwargs)

    def get(self, tensor: torch.Tensor, rank: int, offset: int) -> None:
        """Start reading ``rank``'s bytes from ``offset`` into ``tensor``."""
        self._transfer(self.win.Get, tensor, rank, offset)

    def put(self, tensor: torch.Tensor, rank: int, offset: int) -> None:
        """Start writing ``tensor`` into ``rank``'s bytes from ``offset``."""
        self._transfer(self.win.Put, tensor, rank, offset)

    def accumulate(self, tensor: torch.Tensor, rank: int, offset: int, op: MPI.Op = MPI.SUM) -> None:
        """Start combining ``tensor`` into ``rank``'s values at ``offset`` with ``op``, element by
        element atomically with respect to other accumulates. 16-bit floats, which MPI cannot add,
        must be converted to their :func:`~tensorplay_hpc.comm.dtypes.reduce_dtype` first."""
        if reduce_dtype(tensor.dtype) != tensor.dtype:
            raise TypeError(f"cannot accumulate {tensor.dtype} in MPI; convert it to "
                            f"{reduce_dtype(tensor.dtype)} first (rank {self.rank})")
        self._transfer(self.win.Accumulate, tensor, rank, offset, op=op)

    @contextmanager
    def locked(self, rank: int, exclusive: bool = False) -> Iterator[None]:
        """A passive-target epoch on ``rank``: operations started inside have completed (at
        origin and target) when the block ends. ``rank`` takes no part."""
        self.win.Lock(rank, MPI.LOCK_EXCLUSIVE if exclusive else MPI.LOCK_SHARED)
        try:
            yield
        finally:
            self.win.Unlock(rank)

    def flush(self, rank: int) -> None:
        """Complete the operations started on ``rank`` in the current epoch."""
        self.win.Flush(rank)

    def free(self) -> None:
        """Release the window. Collective; local views of it must not be used afterwards."""
        self.local = torch.empty(0, dtype=torch.uint8)
        if self.win != MPI.WIN_NULL and not MPI.Is_finalized():
            self.win.Free()
