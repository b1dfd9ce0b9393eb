"""Flat buffers: many tensors of one dtype and device in one contiguous 1-D tensor, with views,
so that a single collective moves all of them."""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

Key = Tuple[torch.dtype, torch.device]


def group_by_dtype_device(tensors: Iterable[torch.Tensor]) -> "OrderedDict[Key, List[int]]":
    """Indices of ``tensors`` grouped by ``(dtype, device)``, in first-seen order."""
    groups: "OrderedDict[Key, List[int]]" = OrderedDict()
    for index, tensor in enumerate(tensors):
        groups.setdefault((tensor.dtype, tensor.device), []).append(index)
    return groups


class FlatBuffer:
    """A 1-D ``buffer`` holding tensors of the given shapes back to back.

    ``views[i]`` is a view of the buffer shaped like tensor ``i``; ``offsets[i]`` is where it
    starts, in elements.
    """

    def __init__(self, shapes: Sequence[torch.Size], dtype: torch.dtype,
                 device: torch.device | str = "cpu", buffer: Optional[torch.Tensor] = None) -> None:
        self.shapes = [torch.Size(s) for s in shapes]
        self.numels = [s.numel() for s in self.shapes]
        self.offsets: List[int] = []
        total = 0
        for n in self.numels:
            self.offsets.append(total)
            total += n
        if buffer is None:
            buffer = torch.empty(total, dtype=dtype, device=device)
        elif buffer.numel() != total or buffer.dim() != 1:
            raise ValueError(f"buffer has {buffer.numel()} elements, the shapes need {total}")
        self.buffer = buffer
        self.views: List[torch.Tensor] = [
            buffer[o:o + n].view(s) for o, n, s in zip(self.offsets, self.numels, self.shapes)]

    @classmethod
    def pack(cls, tensors: Sequence[torch.Tensor], dtype: Optional[torch.dtype] = None) -> "FlatBuffer":
        """A new buffer filled with copies of ``tensors`` (converted to ``dtype`` if given)."""
        if not tensors:
            raise ValueError("FlatBuffer.pack needs at least one tensor")
        first = tensors[0]
        flat = cls([t.shape for t in tensors], dtype or first.dtype, first.device)
        flat.copy_from(tensors)
        return flat

    def copy_from(self, tensors: Sequence[torch.Tensor]) -> None:
        """Copy ``tensors`` into their places in the buffer."""
        if self.views:
            torch._foreach_copy_(self.views, list(tensors))

    def copy_to(self, tensors: Sequence[torch.Tensor]) -> None:
        """Copy the buffer's contents out into ``tensors``."""
        if self.views:
            torch._foreach_copy_(list(tensors), self.views)

    def __len__(self) -> int:
        return len(self.views)


def pack_by_dtype_device(tensors: Sequence[torch.Tensor],
                         dtype_map=None) -> Dict[Key, Tuple[List[int], FlatBuffer]]:
    """One packed :class:`FlatBuffer` per ``(dtype, device)`` of ``tensors``.

    ``dtype_map`` may choose the buffer's dtype from a tensor dtype (a reduction in float32).
    """
    packed = {}
    for key, indices in group_by_dtype_device(tensors).items():
        dtype = dtype_map(key[0]) if dtype_map else key[0]
        packed[key] = (indices, FlatBuffer.pack([tensors[i] for i in indices], dtype))
    return packed
