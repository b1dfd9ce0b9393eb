"""Splitting messages into chunks: those that exceed MPI's int count limit, and large blocking
allreduces, which are faster in cache-sized pieces.

The count limit is read from ``TENSORPLAY_HPC_CHUNK_ELEMENTS`` on first use (default
2**31 - 1; :func:`.environment.reload` reads it again), so tests can force many chunks with a
tiny value. One ``Allreduce`` of tens of MiB streams through memory several times; in pieces of
a few MiB the bytes stay in the cache between the steps of the algorithm (Open MPI's blocking
allreduce in 4 MiB pieces measured 2-4x faster than one call on 64 MiB on a shared-memory node).
``TENSORPLAY_HPC_PIECE_BYTES`` sets the piece.
"""
from __future__ import annotations

import os
from typing import Iterable, Tuple

from .environment import read_once

__all__ = ["CHUNK_ENV", "MPI_COUNT_LIMIT", "PIECE_BYTES", "PIECE_ENV", "chunk_elements", "chunks",
           "piece_elements"]

MPI_COUNT_LIMIT = 2**31 - 1
CHUNK_ENV = "TENSORPLAY_HPC_CHUNK_ELEMENTS"
PIECE_ENV = "TENSORPLAY_HPC_PIECE_BYTES"
PIECE_BYTES = 4 << 20


@read_once
def chunk_elements() -> int:
    """The largest element count handed to one MPI call."""
    value = os.environ.get(CHUNK_ENV)
    if not value:
        return MPI_COUNT_LIMIT
    limit = int(value)
    if not 1 <= limit <= MPI_COUNT_LIMIT:
        raise ValueError(f"{CHUNK_ENV} must be between 1 and {MPI_COUNT_LIMIT}, got {value}")
    return limit


@read_once
def _piece_bytes() -> int:
    return int(os.environ.get(PIECE_ENV) or PIECE_BYTES)


@read_once
def piece_elements(element_size: int) -> int:
    """Elements of ``element_size`` bytes in one piece of a blocking allreduce (within the
    count limit)."""
    return max(1, min(chunk_elements(), _piece_bytes() // element_size))


def chunks(count: int, limit: int | None = None) -> Iterable[Tuple[int, int]]:
    """``(start, length)`` pieces covering ``range(count)``, each at most ``limit`` long.

    An empty message still yields one empty piece, so every rank makes the same calls.
    """
    limit = limit or chunk_elements()
    if count <= limit:   # the common case, at the cost of a small collective's own work
        return ((0, count),)
    return ((start, min(limit, count - start)) for start in range(0, count, limit))
