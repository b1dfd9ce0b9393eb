"""Splitting messages that exceed MPI's int count limit into chunks.

The limit is read from ``TENSORPLAY_HPC_CHUNK_ELEMENTS`` at each call (default 2**31 - 1), so
tests can force many chunks with a tiny value.
"""
from __future__ import annotations

import os
from typing import Iterator, Tuple

MPI_COUNT_LIMIT = 2**31 - 1
CHUNK_ENV = "TENSORPLAY_HPC_CHUNK_ELEMENTS"


def chunk_elements() -> int:
    """The largest element count handed to one MPI call."""
    value = os.environ.get(CHUNK_ENV)
    if not value:
        return MPI_COUNT_LIMIT
    limit = int(value)
    if not 1 <= limit <= MPI_COUNT_LIMIT:
        raise ValueError(f"{CHUNK_ENV} must be between 1 and {MPI_COUNT_LIMIT}, got {value}")
    return limit


def chunks(count: int, limit: int | None = None) -> Iterator[Tuple[int, int]]:
    """``(start, length)`` pieces covering ``range(count)``, each at most ``limit`` long.

    An empty message still yields one empty piece, so every rank makes the same calls.
    """
    limit = limit or chunk_elements()
    if count == 0:
        yield 0, 0
        return
    for start in range(0, count, limit):
        yield start, min(limit, count - start)
