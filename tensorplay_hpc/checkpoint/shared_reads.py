"""Datasets that several ranks need, read once: the ranks split the reading by bytes, each checks
the checksums of what it read, and each reader broadcasts its datasets' raw bytes in one buffer
(per batch, when the values are cut to each rank's part as they arrive)."""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import torch

from tensorplay_hpc.comm import broadcast, check_consistent
from tensorplay_hpc.comm.agreement import fail_together
from tensorplay_hpc.comm.mpi import MPI

from . import format as fmt
from .optimizers import assign_writers
from .reader import Reader

__all__ = ["read_shared"]


def _views(buffer: np.ndarray, layout: Sequence[tuple]) -> List[np.ndarray]:
    """The arrays of ``layout`` ((shape, dtype) pairs) laid end to end in the byte ``buffer``."""
    views, offset = [], 0
    for shape, dtype in layout:
        stored = fmt.numpy_dtype(dtype)
        nbytes = math.prod(shape) * stored.itemsize
        views.append(buffer[offset:offset + nbytes].view(stored).reshape(shape))
        offset += nbytes
    return views


def read_shared(reader: Reader, names: Sequence[str], comm: MPI.Intracomm,
                keep: Optional[Callable[[str, torch.Tensor], torch.Tensor]] = None,
                batch_bytes: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """Every dataset of ``names`` on every rank of ``comm``, each read from the file by one rank.
    Collective over ``comm``; every rank passes the same ``names``.

    ``keep(name, value)`` gives what this rank keeps of each value (its own rows of a sharded
    tensor, say); with ``batch_bytes`` the datasets are read and shared in batches of about that
    many bytes, each batch's whole values freed once ``keep`` has cut them, so a rank never
    holds much more than one batch of whole values.

    Raises:
        CheckpointError: on every rank, naming the datasets and the ranks that failed.
    """
    what = f"loading checkpoint {reader.path}"
    try:
        check_consistent(comm, "the datasets every rank reads", [(name, "") for name in names])
    except ValueError as failure:
        raise fmt.CheckpointError(f"{what}: {failure}") from None
    layout: List[tuple] = []
    with fail_together(comm, what, fmt.CheckpointError):
        layout = [reader.describe(name) for name in names]
    sizes = [math.prod(shape) * fmt.numpy_dtype(dtype).itemsize for shape, dtype in layout]
    tensors: Dict[str, torch.Tensor] = {}
    for batch in _batches(sizes, batch_bytes):
        shared = _read_batch(reader, [names[i] for i in batch], [layout[i] for i in batch],
                             [sizes[i] for i in batch], comm)
        for name, value in shared.items():
            tensors[name] = keep(name, value) if keep is not None else value
    return tensors


def _batches(sizes: Sequence[int], batch_bytes: Optional[int]) -> List[List[int]]:
    """Consecutive positions of ``sizes`` in batches of at most ``batch_bytes`` (a larger item
    alone); one batch of them all without a limit."""
    if batch_bytes is None:
        return [list(range(len(sizes)))]
    batches: List[List[int]] = []
    total = 0
    for position, size in enumerate(sizes):
        if not batches or total + size > batch_bytes:
            batches.append([])
            total = 0
        batches[-1].append(position)
        total += size
    return batches


def _read_batch(reader: Reader, names: Sequence[str], layout: Sequence[tuple],
                sizes: Sequence[int], comm: MPI.Intracomm) -> Dict[str, torch.Tensor]:
    """The datasets ``names``, each read by one rank (spread by bytes) and broadcast in one
    buffer per reading rank. Collective over ``comm``."""
    rank, what = comm.Get_rank(), f"loading checkpoint {reader.path}"
    readers = assign_writers(sizes, comm.Get_size())
    buffers: Dict[int, np.ndarray] = {}
    for root in range(comm.Get_size()):
        mine = [i for i, r in enumerate(readers) if r == root]
        buffers[root] = np.empty(sum(sizes[i] for i in mine), dtype=np.uint8)
    with fail_together(comm, what, fmt.CheckpointError):
        mine = [i for i, r in enumerate(readers) if r == rank]
        reader.read_all_into([names[i] for i in mine],
                             _views(buffers[rank], [layout[i] for i in mine]))

    tensors: Dict[str, torch.Tensor] = {}
    for root, buffer in buffers.items():
        mine = [i for i, r in enumerate(readers) if r == root]
        if buffer.size:
            broadcast(torch.from_numpy(buffer), comm, root=root)
        for i, view in zip(mine, _views(buffer, [layout[i] for i in mine])):
            tensors[names[i]] = fmt.from_numpy(view, layout[i][1])
    return tensors
