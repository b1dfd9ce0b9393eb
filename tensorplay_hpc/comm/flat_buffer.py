"""Flat buffers: many tensors of one dtype and device in one contiguous 1-D tensor, with views,
so that a single collective moves all of them."""
from __future__ import annotations

import functools
import itertools
from collections import OrderedDict
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["FlatBuffer", "Key", "group_by_dtype_device", "pack_by_dtype_device"]

Key = Tuple[torch.dtype, torch.device]


def group_by_dtype_device(tensors: Iterable[torch.Tensor]) -> "OrderedDict[Key, List[int]]":
    """Indices of ``tensors`` grouped by ``(dtype, device)``, in first-seen order."""
    groups: "OrderedDict[Key, List[int]]" = OrderedDict()
    for index, tensor in enumerate(tensors):
        groups.setdefault((tensor.dtype, tensor.device), []).append(index)
    return groups


class FlatBuffer:
    """A 1-D ``buffer`` holding tensors of the given shapes back to back (``shapes`` may be
    tensors standing in for their shapes, which makes :attr:`views` faster to build).

    ``views[i]`` is a view of the buffer shaped like tensor ``i`` and ``offsets[i]`` is where it
    starts, in elements; both are made on first use, so a buffer packed for one collective and
    copied out again never pays for them.
    """

    def __init__(self, shapes: Sequence[torch.Size], dtype: torch.dtype,
                 device: torch.device | str = "cpu", buffer: Optional[torch.Tensor] = None) -> None:
        self._layout: Sequence = shapes
        total = sum(self.numels)
        if buffer is None:
            buffer = torch.empty(total, dtype=dtype, device=device)
        elif buffer.numel() != total or buffer.dim() != 1:
            raise ValueError(f"buffer has {buffer.numel()} elements, the shapes need {total}")
        self.buffer = buffer

    @classmethod
    def pack(cls, tensors: Sequence[torch.Tensor], dtype: Optional[torch.dtype] = None) -> "FlatBuffer":
        """A new buffer filled with copies of ``tensors`` (converted to ``dtype`` if given)."""
        if not tensors:
            raise ValueError("FlatBuffer.pack needs at least one tensor")
        tensors = list(tensors)
        buffer = _flatten_dense_tensors(tensors)
        if dtype is not None and dtype != buffer.dtype:
            buffer = buffer.to(dtype)
        flat = cls.__new__(cls)
        flat._layout, flat.buffer = tensors, buffer   # the tensors stand in for their shapes
        return flat

    @functools.cached_property
    def shapes(self) -> List[torch.Size]:
        return [item.shape if isinstance(item, torch.Tensor) else torch.Size(item)
                for item in self._layout]

    @functools.cached_property
    def numels(self) -> List[int]:
        return [s.numel() for s in self.shapes]

    @functools.cached_property
    def offsets(self) -> List[int]:
        return list(itertools.accumulate(self.numels[:-1], initial=0)) if self.numels else []

    @functools.cached_property
    def views(self) -> List[torch.Tensor]:
        if self._layout and isinstance(self._layout[0], torch.Tensor):
            return list(_unflatten_dense_tensors(self.buffer, self._layout))   # in C++: fast
        return [part.view(shape) for part, shape in zip(self.buffer.split(self.numels), self.shapes)]

    def copy_from(self, tensors: Sequence[torch.Tensor]) -> None:
        """Copy ``tensors`` into their places in the buffer."""
        if self._layout:
            torch._foreach_copy_(self.views, list(tensors))

    def copy_to(self, tensors: Sequence[torch.Tensor]) -> None:
        """Copy the buffer's contents out into ``tensors`` (which may differ in dtype)."""
        if self._layout:
            tensors = list(tensors)
            torch._foreach_copy_(tensors, _unflatten_dense_tensors(self.buffer, tensors))

    def __len__(self) -> int:
        return len(self._layout)


def pack_by_dtype_device(tensors: Sequence[torch.Tensor],
                         dtype_map: Optional[Callable[[torch.dtype], torch.dtype]] = None,
                         ) -> Dict[Key, Tuple[List[int], FlatBuffer]]:
    """One packed :class:`FlatBuffer` per ``(dtype, device)`` of ``tensors``.

    ``dtype_map`` may choose the buffer's dtype from a tensor dtype (a reduction in float32).
    """
    packed = {}
    for key, indices in group_by_dtype_device(tensors).items():
        dtype = dtype_map(key[0]) if dtype_map else key[0]
        packed[key] = (indices, FlatBuffer.pack([tensors[i] for i in indices], dtype))
    return packed
