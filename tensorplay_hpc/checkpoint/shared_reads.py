"""Datasets that several ranks need, read once: the ranks split the reading by bytes, each checks
the checksums of what it read, and each reader broadcasts its datasets' raw bytes in one buffer."""
from __future__ import annotations

import math
from typing import Dict, List, Sequence

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


def read_shared(reader: Reader, names: Sequence[str], comm: MPI.Intracomm) -> Dict[str, torch.Tensor]:
    """Every dataset of ``names`` on every rank of ``comm``, each read from the file by one rank.
    Collective over ``comm``; every rank passes the same ``names``.

    Raises:
        CheckpointError: on every rank, naming the datasets and the ranks that failed.
    """
    rank, what = comm.Get_rank(), f"loading checkpoint {reader.path}"
    try:
        check_consistent(comm, "the datasets every rank reads", [(name, "") for name in names])
    except ValueError as failure:
        raise fmt.CheckpointError(f"{what}: {failure}") from None
    layout, sizes, readers = [], [], []
    with fail_together(comm, what, fmt.CheckpointError):
        layout = [reader.describe(name) for name in names]
        sizes = [math.prod(shape) * fmt.numpy_dtype(dtype).itemsize for shape, dtype in layout]
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
