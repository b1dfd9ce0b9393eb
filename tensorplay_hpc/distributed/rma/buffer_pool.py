"""Recycled memory for the tensors that remote reads return.

A fetch into freshly allocated memory pays a page fault per page, several times the cost of the
copy itself: PyTorch's CPU allocator hands large blocks back to the system on free, so every
``to_here`` of a large tensor would start from new pages. Here the memory of a returned tensor
goes back to a pool once the tensor's storage is freed (a finalizer on the NumPy array that backs
it), and the next fetch of the same size reuses it.
"""
from __future__ import annotations

import functools
import threading
import weakref
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

__all__ = ["CACHE_LIMIT_BYTES", "empty"]

CACHE_LIMIT_BYTES = 1 << 30
"""Freed blocks beyond this many bytes in the pool are returned to the system."""

_free: Dict[int, List[np.ndarray]] = defaultdict(list)
_cached_bytes = 0
_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def _numpy_dtype(dtype: torch.dtype) -> Optional[np.dtype]:
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:  # bfloat16 and other dtypes NumPy lacks
        return None


def _release(block: np.ndarray) -> None:
    global _cached_bytes
    with _lock:
        if _cached_bytes + block.nbytes <= CACHE_LIMIT_BYTES:
            _free[block.nbytes].append(block)
            _cached_bytes += block.nbytes


def _acquire(nbytes: int) -> np.ndarray:
    global _cached_bytes
    with _lock:
        if _free[nbytes]:
            _cached_bytes -= nbytes
            return _free[nbytes].pop()
    return np.empty(nbytes, dtype=np.uint8)


def empty(shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor of ``shape`` and ``dtype``, in recycled memory where NumPy
    has the dtype."""
    numpy_dtype = _numpy_dtype(dtype)
    if numpy_dtype is None:
        return torch.empty(shape, dtype=dtype)
    block = _acquire(torch.Size(shape).numel() * numpy_dtype.itemsize)
    array = block.view(numpy_dtype).reshape(shape)
    weakref.finalize(array, _release, block)  # when the tensor's storage lets go of it
    return torch.from_numpy(array)
