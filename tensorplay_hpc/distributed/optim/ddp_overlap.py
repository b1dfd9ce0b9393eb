"""ZeroRedundancyOptimizer's step overlapped with DistributedDataParallel's backward pass
(``overlap_with_ddp=True``).

The shard of each rank is then made of whole DDP gradient buckets: in bucket order, each bucket
goes to the rank with the smallest load so far (ties to the lowest rank). The parameters of each
bucket become views into one flat buffer. The communication hook made by
:func:`~tensorplay_hpc.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook.hook_with_zero_step`
wraps a reduction hook (such as ``allreduce_hook``); as soon as a bucket's reduction has
completed (DDP tests it after every gradient, so this happens while the backward pass goes on,
and at the latest when it ends), the bucket's owner steps the bucket's parameters with the
reduced gradients and a nonblocking broadcast from the owner sends them to every rank. When
``backward()`` returns, every broadcast has completed: the parameters are updated everywhere and
no ``step()`` call is needed (it warns and does nothing).

Warm-up: none. PyTorch skips the step in the first two iterations while its DDP rebuilds the
buckets; this package's DDP fixes its buckets at construction, so the first backward pass
already steps.

Parameters are updated during the backward pass: a parameter must not be needed by the
backward pass after its gradient is ready (shared weights are not supported), as in PyTorch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, List

import torch

from tensorplay_hpc import comm
from tensorplay_hpc.distributed.parallel.reducer import _done, _reduced_tensor

from .partition import Partition

if TYPE_CHECKING:
    from .zero_redundancy_optimizer import ZeroRedundancyOptimizer


class _BucketStep:
    """A bucket's reduction in flight, followed by the owner's step and the broadcast; what the
    wrapped hook returns to DDP (``is_completed()`` and ``wait()`` like the reduction's)."""

    def __init__(self, overlap: "DDPOverlap", bucket: Any, reduction: Any) -> None:
        self._overlap = overlap
        self._bucket = bucket
        self._reduction = reduction
        self._stepped = False

    def _step(self) -> None:
        self._stepped = True
        self._overlap.step_bucket(self._bucket.index(), _reduced_tensor(self._reduction))

    def is_completed(self) -> bool:
        if not self._stepped and _done(self._reduction):
            self._step()
        return self._stepped

    def wait(self) -> torch.Tensor:
        if not self._stepped:
            self._reduction.wait()
            self._step()
        if self._bucket.is_last():
            self._overlap.finish()
        return _reduced_tensor(self._reduction)


class DDPOverlap:
    """The bucket assignment and parameter buffers of a ZeRO optimizer overlapped with ``ddp``.

    Builds ``zero``'s partition and local optimizer from ``ddp``'s buckets. Not collective.

    Raises:
        ValueError: a parameter of ``ddp``'s buckets is not one of ``zero``'s.
    """

    def __init__(self, zero: "ZeroRedundancyOptimizer", ddp: Any) -> None:
        self.zero = zero
        buckets = [bucket.parameters() for bucket in ddp.buckets]
        loads = [0] * zero.world_size
        self.owners: List[int] = []
        rank_of = [0] * len(zero.params_by_index)   # parameters in no bucket never step
        for params in buckets:
            owner = min(range(zero.world_size), key=loads.__getitem__)
            self.owners.append(owner)
            loads[owner] += sum(p.numel() for p in params)
            for param in params:
                if param not in zero._index_of:
                    raise ValueError(
                        "overlap_with_ddp: a parameter of the DistributedDataParallel model (shape "
                        f"{tuple(param.shape)}) is not one of the optimizer's (rank {zero.rank})")
                rank_of[zero._index_of[param]] = owner
        zero._init_local_optimizer(Partition.assigned(
            rank_of, zero.world_size, [p.numel() for p in zero.params_by_index]))
        self.params = buckets
        self.flats = []
        for params in buckets:
            flat = comm.FlatBuffer([p.shape for p in params], params[0].dtype, params[0].device)
            with torch.no_grad():
                flat.copy_from(params)
            for param, view in zip(params, flat.views):
                param.data = view
            self.flats.append(flat)
        self._broadcasts: List[comm.Work] = []

    def step_bucket(self, index: int, reduced: torch.Tensor) -> None:
        """Step bucket ``index``'s parameters on its owner, then start sending them."""
        owner = self.owners[index]
        if owner == self.zero.rank:
            grads = comm.FlatBuffer([p.shape for p in self.params[index]], reduced.dtype,
                                    reduced.device, buffer=reduced.reshape(-1)).views
            self.zero._step_with_gradients(self.params[index], grads)
        self._broadcasts.append(comm.broadcast(self.flats[index].buffer, self.zero._group.comm,
                                               owner, async_op=True))

    def finish(self) -> None:
        """Wait for every broadcast of this iteration."""
        for work in self._broadcasts:
            work.wait()
        self._broadcasts.clear()

    def hook(self, reduce: Callable[[Any, Any], Any]) -> Callable[[Any, Any], _BucketStep]:
        """A DDP communication hook: ``reduce(state, bucket)``, then the step of the bucket."""
        def reduce_then_step(state: Any, bucket: Any) -> _BucketStep:
            return _BucketStep(self, bucket, reduce(state, bucket))
        return reduce_then_step
