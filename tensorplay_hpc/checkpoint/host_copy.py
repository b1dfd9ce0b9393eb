"""Host copies of the tensors a rank saves in the background, so that training can change the
originals while the file is written. The buffers are kept from one save to the next (a tensor
of the same name, shape and dtype reuses its buffer), and are pinned for GPU tensors, whose
copies then run asynchronously and are waited for once."""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

__all__ = ["Datasets", "HostBuffers"]

Datasets = List[Tuple[str, torch.Tensor]]


class HostBuffers:
    """The host buffers of one background writer. Not collective."""

    def __init__(self) -> None:
        self._buffers: Dict[str, Tuple[torch.Tensor, bool]] = {}

    def copy(self, datasets: Sequence[Tuple[str, torch.Tensor]]) -> Datasets:
        """``datasets`` with each tensor replaced by its copy in this rank's host buffers.
        Buffers of names no longer saved are dropped."""
        kept: Dict[str, Tuple[torch.Tensor, bool]] = {}
        copies: Datasets = []
        from_gpu = False
        for name, tensor in datasets:
            tensor = tensor.detach()
            pinned = tensor.device.type == "cuda"
            buffer, was_pinned = self._buffers.get(name, (None, False))
            if (buffer is None or was_pinned != pinned or buffer.dtype != tensor.dtype
                    or buffer.shape != tensor.shape):
                buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)
            buffer.copy_(tensor, non_blocking=pinned)
            from_gpu |= pinned
            kept[name] = (buffer, pinned)
            copies.append((name, buffer))
        if from_gpu:
            torch.cuda.synchronize()
        self._buffers = kept
        return copies

    @property
    def nbytes(self) -> int:
        """The bytes held."""
        return sum(b.numel() * b.element_size() for b, _ in self._buffers.values())
