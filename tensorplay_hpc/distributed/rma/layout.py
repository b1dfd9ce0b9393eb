"""Byte layouts: where tensors of mixed shapes and dtypes lie in one rank's window memory."""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

__all__ = ["ALIGNMENT", "Layout", "Spec", "aligned", "nbytes_of", "view_at"]

ALIGNMENT = 64
"""Every tensor starts on a multiple of this many bytes (a cache line; enough for any dtype)."""

Spec = Tuple[Tuple[int, ...], torch.dtype]


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of :data:`ALIGNMENT`."""
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def nbytes_of(spec: Spec) -> int:
    """The bytes a tensor of ``spec = (shape, dtype)`` takes."""
    shape, dtype = spec
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def view_at(memory: torch.Tensor, offset: int, shape: Tuple[int, ...],
            dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` viewing the bytes of ``memory`` (``uint8``) from
    ``offset``."""
    nbytes = nbytes_of((shape, dtype))
    return memory[offset:offset + nbytes].view(dtype).view(shape)


class Layout:
    """Tensors of the given ``(shape, dtype)`` specs placed back to back, each aligned.

    ``offsets[i]`` is the byte where tensor ``i`` starts; ``nbytes`` the total size.
    """

    def __init__(self, specs: Sequence[Spec]) -> None:
        self.specs: List[Spec] = [(tuple(shape), dtype) for shape, dtype in specs]
        self.offsets: List[int] = []
        total = 0
        for spec in self.specs:
            self.offsets.append(total)
            total += aligned(nbytes_of(spec))
        self.nbytes = total

    def __len__(self) -> int:
        return len(self.specs)
