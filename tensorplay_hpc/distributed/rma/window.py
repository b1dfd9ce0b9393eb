"""A byte-addressed MPI window of CPU memory, read and written with tensors (the ``shared`` and
``mpi`` transports of :mod:`.transport`; :mod:`.served` has the same interface without MPI
windows).

Each rank's part of the window is allocated by MPI and is seen locally as a ``uint8`` tensor,
from which typed views are cut. When the group lies within one node the window is made with
``Win.Allocate_shared``: Open MPI then uses its shared-memory component (``osc/sm``), where other
ranks' operations are plain memory copies that need nothing from the target. (Open MPI 4.1 gives
``Win.Allocate`` to ``osc/rdma``, whose shared-memory file is named after the communicator's id,
which the disjoint halves of a ``Split`` share: their windows would overlap.)

Remote operations take contiguous CPU tensors and a byte offset in the target's part; their
memory reaches MPI only through :func:`tensorplay_hpc.comm.staging.memory`, and messages longer
than the chunk limit are split. Operations complete at the end of the lock epoch that holds them.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterator, Optional, Tuple

import torch

from tensorplay_hpc.comm import chunking, lifetime, staging, trace
from tensorplay_hpc.comm.communicators import allocate_window, free_window
from tensorplay_hpc.comm.dtypes import move_datatype, reduce_dtype
from tensorplay_hpc.comm.mpi import MPI

from .layout import view_at

__all__ = ["Window", "check_accumulable", "check_transferable"]


def check_transferable(tensor: torch.Tensor, rank: int) -> None:
    """Raise ``ValueError`` unless ``tensor`` can be a window operation's origin buffer."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"window operations need contiguous CPU tensors (rank {rank})")


def check_accumulable(tensor: torch.Tensor, rank: int) -> None:
    """Raise ``TypeError`` for 16-bit floats, which MPI cannot add."""
    if reduce_dtype(tensor.dtype) != tensor.dtype:
        raise TypeError(f"cannot accumulate {tensor.dtype} in MPI; convert it to "
                        f"{reduce_dtype(tensor.dtype)} first (rank {rank})")


class Window:
    """``nbytes`` of window memory on this rank, in a window over ``communicator``: in shared
    memory (``shared``, all ranks on one node) or from ``Win.Allocate``.

    Collective: every rank of ``communicator`` constructs it (``nbytes`` may differ, or be 0), and
    :meth:`free` it.
    """

    def __init__(self, communicator: MPI.Intracomm, nbytes: int, shared: bool) -> None:
        info = MPI.Info.Create()
        if shared:
            info.Set("alloc_shared_noncontig", "true")  # each rank's part on its own pages
        self.win = allocate_window(communicator, nbytes, shared, info)
        info.Free()
        self._communicator = communicator
        self.shared_memory = self.win.Get_attr(MPI.WIN_CREATE_FLAVOR) == MPI.WIN_FLAVOR_SHARED
        self._segments: Dict[int, torch.Tensor] = {}
        self.rank = communicator.Get_rank()
        self._comm_name = trace.communicator_name(communicator)
        self._token = lifetime.track(f"window of {nbytes} bytes on {self._comm_name}")
        if nbytes:
            self.local = torch.frombuffer(self.win.tomemory(), dtype=torch.uint8)
        else:
            self.local = torch.empty(0, dtype=torch.uint8)

    def view(self, offset: int, shape: Tuple[int, ...], dtype: torch.dtype,
             rank: Optional[int] = None) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` viewing the memory of ``rank`` (default: this
        one) from byte ``offset``. Another rank's memory is seen only in a shared-memory window
        (:attr:`shared_memory`), and only inside an epoch on it, after :meth:`sync`."""
        memory = self.local if rank is None or rank == self.rank else self._segment(rank)
        return view_at(memory, offset, shape, dtype)

    def _segment(self, rank: int) -> torch.Tensor:
        if not self.shared_memory:
            raise RuntimeError(f"rank {self.rank} cannot see rank {rank}'s window memory: the "
                               "window is not in shared memory")
        if rank not in self._segments:
            memory, _ = self.win.Shared_query(rank)
            self._segments[rank] = (torch.frombuffer(memory, dtype=torch.uint8) if len(memory)
                                    else torch.empty(0, dtype=torch.uint8))
        return self._segments[rank]

    def sync(self) -> None:
        """Order this rank's direct loads and stores of window memory with everyone's RMA
        (``MPI.Win.Sync``); call it inside an epoch, after taking and before releasing it."""
        self.win.Sync()

    def _transfer(self, what: str, method, tensor: torch.Tensor, rank: int, offset: int,
                  **kwargs) -> None:
        check_transferable(tensor, self.rank)
        datatype = move_datatype(tensor.dtype)
        size = tensor.element_size()
        with trace.rma(f"{what} rank {rank}", self._comm_name, tensor.nbytes):
            for start, count in chunking.chunks(tensor.numel()):
                method([staging.memory(tensor, start, count), count, datatype], rank,
                       target=(offset + start * size, count, datatype), **kwargs)

    def get(self, tensor: torch.Tensor, rank: int, offset: int) -> None:
        """Start reading ``rank``'s bytes from ``offset`` into ``tensor``."""
        self._transfer("get from", self.win.Get, tensor, rank, offset)

    def put(self, tensor: torch.Tensor, rank: int, offset: int) -> None:
        """Start writing ``tensor`` into ``rank``'s bytes from ``offset``."""
        self._transfer("put to", self.win.Put, tensor, rank, offset)

    def accumulate(self, tensor: torch.Tensor, rank: int, offset: int,
                   op: Optional[MPI.Op] = None) -> None:
        """Start combining ``tensor`` into ``rank``'s values at ``offset`` with ``op``, element by
        element atomically with respect to other accumulates. 16-bit floats, which MPI cannot add,
        must be converted to their :func:`~tensorplay_hpc.comm.dtypes.reduce_dtype` first."""
        check_accumulable(tensor, self.rank)
        self._transfer("accumulate to", self.win.Accumulate, tensor, rank, offset,
                       op=MPI.SUM if op is None else op)

    @contextmanager
    def locked(self, rank: int, exclusive: bool = False) -> Iterator[None]:
        """A passive-target epoch on ``rank``: operations started inside have completed (at
        origin and target) when the block ends. ``rank`` takes no part."""
        with trace.rma(f"{'exclusive' if exclusive else 'shared'} epoch on rank {rank}",
                       self._comm_name, 0):
            self.win.Lock(rank, MPI.LOCK_EXCLUSIVE if exclusive else MPI.LOCK_SHARED)
            try:
                yield
            finally:
                self.win.Unlock(rank)

    def flush(self, rank: int) -> None:
        """Complete the operations started on ``rank`` in the current epoch."""
        with trace.rma(f"flush rank {rank}", self._comm_name, 0):
            self.win.Flush(rank)

    def abandon(self) -> None:
        """After a lost rank: nothing to stop (no thread serves the window); it is left to
        ``MPI_Finalize``. Local."""

    def free(self) -> None:
        """Release the window. Collective; local views of it must not be used afterwards."""
        self.local = torch.empty(0, dtype=torch.uint8)
        self._segments.clear()
        if self.win != MPI.WIN_NULL and not MPI.Is_finalized():
            free_window(self.win, self._communicator)
        lifetime.untrack(self._token)
