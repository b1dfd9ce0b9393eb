"""Where a :class:`.Reducer` averages the gradients, one class per way: in flat bucket buffers
(:class:`InBuckets`: what a communication hook is given, and what ``gradient_as_bucket_view``
leaves ``param.grad`` viewing), or where they are (:class:`InPlace`: the built-in reduction
otherwise, which copies no gradient into a bucket and back). Both are local."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch

from tensorplay_hpc.distributed.algorithms.ddp_comm_hooks.grad_bucket import GradBucket, HookResult

__all__ = ["GradientPlaces", "InBuckets", "InPlace"]


class GradientPlaces:
    """What differs between the ways: how a gradient reaches its bucket's reduction, what the
    reduction is given, and how the averages come back to ``param.grad``.

    Args:
        params: the reducer's parameters.
        buckets: its buckets, in order.
        slots: each parameter's ``(bucket, position in the bucket)``.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], buckets: Sequence[GradBucket],
                 slots: Sequence[Tuple[int, int]]) -> None:
        self.params, self.buckets, self.slots = params, buckets, slots

    def place(self, index: int, own: bool) -> None:
        """Parameter ``index``'s gradient is ready (``own``: computed in this pass; else none,
        or one left from an earlier pass, counts as zeros)."""
        raise NotImplementedError

    def inputs(self, bucket: GradBucket) -> List[torch.Tensor]:
        """The tensors the built-in reduction averages for ``bucket``."""
        raise NotImplementedError

    def shadow(self) -> List[Tuple[GradBucket, List[torch.Tensor]]]:
        """Each bucket (or a stand-in for it) with zeros to reduce, for a pass without inputs."""
        raise NotImplementedError

    def reduced(self, bucket: GradBucket, result: HookResult, tensor: torch.Tensor,
                consumed: Set[int]) -> None:
        """``bucket``'s reduction ``result`` has completed with ``tensor``; a hook whose result
        consumes the gradients puts the bucket's index in ``consumed``."""

    def write_back(self, index: int, targets: List[torch.Tensor],
                   sources: List[torch.Tensor]) -> None:
        """Give parameter ``index`` its averaged gradient (or add the copy ``targets[i] <-
        sources[i]`` to those made together at the end)."""
        raise NotImplementedError

    def reset(self) -> None:
        """Forget this pass's gradients (after the write-back)."""


class InBuckets(GradientPlaces):
    """Gradients copied into their slots of the flat bucket buffers, averaged there, and copied
    back (``as_view``: ``param.grad`` left viewing its slot instead)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], buckets: Sequence[GradBucket],
                 slots: Sequence[Tuple[int, int]], as_view: bool) -> None:
        super().__init__(params, buckets, slots)
        self.as_view = as_view
        self._shadow_buckets: Optional[List[GradBucket]] = None

    def _slot(self, index: int) -> torch.Tensor:
        b, position = self.slots[index]
        return self.buckets[b].flat.views[position]

    def place(self, index: int, own: bool) -> None:
        param, slot = self.params[index], self._slot(index)
        grad = param.grad
        if grad is None:
            slot.zero_()
        elif grad.data_ptr() != slot.data_ptr():
            slot.copy_(grad)
            if self.as_view:
                param.grad = slot

    def inputs(self, bucket: GradBucket) -> List[torch.Tensor]:
        return [bucket.buffer()]

    def shadow(self) -> List[Tuple[GradBucket, List[torch.Tensor]]]:
        if self._shadow_buckets is None:
            self._shadow_buckets = [GradBucket(b.index(), b.parameters(), b.is_last())
                                    for b in self.buckets]
        for bucket in self._shadow_buckets:
            bucket.buffer().zero_()
        return [(bucket, [bucket.buffer()]) for bucket in self._shadow_buckets]

    def reduced(self, bucket: GradBucket, result: HookResult, tensor: torch.Tensor,
                consumed: Set[int]) -> None:
        if getattr(result, "consumes_gradients", False):
            consumed.add(bucket.index())
        elif tensor.data_ptr() != bucket.buffer().data_ptr():
            bucket.set_buffer(tensor)

    def write_back(self, index: int, targets: List[torch.Tensor],
                   sources: List[torch.Tensor]) -> None:
        param, slot = self.params[index], self._slot(index)
        grad = param.grad
        if self.as_view:
            if grad is None or grad.data_ptr() != slot.data_ptr():
                param.grad = slot
        elif grad is None:
            param.grad = slot.clone()
        else:
            targets.append(grad)
            sources.append(slot)


class InPlace(GradientPlaces):
    """Gradients averaged in their own memory; a parameter without a gradient of its own in
    this pass is averaged in a stand-in (zeros, or a copy of its earlier gradient), so that an
    unused gradient stays as it was."""

    def __init__(self, params: Sequence[torch.nn.Parameter], buckets: Sequence[GradBucket],
                 slots: Sequence[Tuple[int, int]], bucket_indices: Sequence[Sequence[int]]
                 ) -> None:
        super().__init__(params, buckets, slots)
        self.bucket_indices = bucket_indices
        self._stand_ins: Dict[int, torch.Tensor] = {}
        self._shadow_gradients: Optional[List[List[torch.Tensor]]] = None

    def place(self, index: int, own: bool) -> None:
        if not own:
            grad = self.params[index].grad
            self._stand_ins[index] = (torch.zeros_like(self.params[index]) if grad is None
                                      else grad.detach().clone())

    def inputs(self, bucket: GradBucket) -> List[torch.Tensor]:
        found = []
        for index in self.bucket_indices[bucket.index()]:
            stand_in = self._stand_ins.get(index)
            found.append(self.params[index].grad if stand_in is None else stand_in)
        return found

    def shadow(self) -> List[Tuple[GradBucket, List[torch.Tensor]]]:
        if self._shadow_gradients is None:
            self._shadow_gradients = [[torch.zeros_like(p) for p in b.parameters()]
                                      for b in self.buckets]
        for zeros in self._shadow_gradients:
            torch._foreach_zero_(zeros)
        return list(zip(self.buckets, self._shadow_gradients))

    def write_back(self, index: int, targets: List[torch.Tensor],
                   sources: List[torch.Tensor]) -> None:
        stand_in = self._stand_ins.get(index)
        if stand_in is None:
            return   # averaged in place
        grad = self.params[index].grad
        if grad is None:
            self.params[index].grad = stand_in
        else:
            targets.append(grad)
            sources.append(stand_in)

    def reset(self) -> None:
        self._stand_ins = {}
