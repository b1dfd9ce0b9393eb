"""Environment variables that collectives consult on every call, read once and kept.

Reading and parsing a variable costs about a microsecond, as much as a small collective's own
work in Python, so these are read on first use and kept. A program that changes one of them
while it runs (a test, say) calls :func:`reload` afterwards.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, List, TypeVar

__all__ = ["read_once", "reload"]

T = TypeVar("T")

_cached: List[Any] = []


def read_once(read: Callable[..., T]) -> Callable[..., T]:
    """``read``, called once for each set of (hashable) arguments and then answered from memory
    until :func:`reload`. A read that raises is not kept: the next call reads again."""
    cached = functools.lru_cache(maxsize=None)(read)
    _cached.append(cached)
    return cached


def reload() -> None:
    """Forget every value read so far: the next collectives read the environment again. Local."""
    for cached in _cached:
        cached.cache_clear()
