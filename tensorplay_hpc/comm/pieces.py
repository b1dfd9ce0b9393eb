"""Blocking allreduce of a large tensor in cache-sized pieces.

One ``Allreduce`` of tens of MiB streams through memory several times; the same bytes in pieces
of a few MiB stay in the cache between the steps of the algorithm, and Open MPI's blocking
(tuned) allreduce in pieces measured 2-4x faster than in one call on a shared-memory node
(16.8M floats, 2 ranks). Pieces are contiguous slices, so nothing is copied.
"""
from __future__ import annotations

import os

import torch
from mpi4py import MPI

from .collectives import all_reduce
from .dtypes import ReduceOp

PIECE_ENV = "TENSORPLAY_HPC_PIECE_BYTES"
PIECE_BYTES = 4 << 20


def piece_bytes() -> int:
    """The size of one piece (``TENSORPLAY_HPC_PIECE_BYTES``, default 4 MiB)."""
    return int(os.environ.get(PIECE_ENV) or PIECE_BYTES)


def all_reduce_in_pieces(tensor: torch.Tensor, comm: MPI.Intracomm,
                         op: ReduceOp = ReduceOp.SUM) -> None:
    """:func:`~.collectives.all_reduce` of a contiguous tensor, one piece at a time, in place.
    Collective: every rank passes a tensor of the same size."""
    flat = tensor.view(-1)
    step = max(1, piece_bytes() // flat.element_size())
    for start in range(0, max(flat.numel(), 1), step):
        all_reduce(flat[start:start + step], comm, op)
