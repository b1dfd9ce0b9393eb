"""A byte-addressed MPI window of CPU memory, read and written with tensors.

Each rank's part of the window is allocated by MPI (``Win.Allocate``, so Open MPI can use its
shared-memory component on one node) and is seen locally as a ``uint8`` tensor, from which typed
views are cut. Remote operations take contiguous CPU tensors and a byte offset in the target's
part; their memory reaches MPI only through :func:`tensorplay_hpc.comm.memory`, and messages longer
than the chunk limit are split. Operations complete at the end of the lock epoch that holds them.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Tuple

import torch
from mpi4py import MPI

from tensorplay_hpc import comm
from tensorplay_hpc.comm.dtypes import move_datatype, reduce_dtype


class Window:
    """``nbytes`` of window memory on this rank, in a window over ``communicator``.

    Collective: every rank of ``communicator`` constructs it (``nbytes`` may differ, or be 0), and
    :meth:`free` it.
    """

    def __init__(self, communicator: MPI.Intracomm, nbytes: int) -> None:
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
