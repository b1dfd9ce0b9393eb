"""ZeroRedundancyOptimizer's step overlapped with DistributedDataParallel's backward pass
(``overlap_with_ddp=True``), as PyTorch's ``ddp_zero_hook``.

The shard of each rank is made of DDP gradient buckets (:mod:`.bucket_assignment`): whole
buckets, bucket ``b`` to rank ``b % world_size``, or with ``shard_buckets=True`` runs of each
bucket's parameters spread so that every rank owns about the same number of elements. The
parameters of each bucket become views into one flat buffer. The communication hooks made by
:mod:`~tensorplay_hpc.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook` wrap a reduction hook
(such as ``allreduce_hook``); once a bucket's reduction has completed, each owner of part of the
bucket steps its parameters with the reduced gradients and a nonblocking broadcast from the
owner sends them to every rank:

- ``hook_with_zero_step``: every bucket is stepped when the last bucket's hook runs;
- ``hook_with_zero_step_interleaved``: each bucket as soon as its reduction has completed (DDP
  tests it after every gradient, so this happens while the backward pass goes on, and at the
  latest when it ends).

When ``backward()`` returns, every broadcast has completed: the parameters are updated
everywhere and no ``step()`` call is needed (it warns and does nothing).

Warm-up, as in PyTorch: the first two synchronized backward passes (three after DDP's
``static_graph``) only reduce the gradients, without stepping; PyTorch's DDP settles its buckets
in them. Parameters are updated during the backward pass: a parameter must not be needed by the
backward pass after its gradient is ready (shared weights are not supported), as in PyTorch.
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, List, Tuple

import torch

from tensorplay_hpc import comm
from tensorplay_hpc.comm import trace
from tensorplay_hpc.comm.private import private_comm
from tensorplay_hpc.comm.small_collectives import BACKGROUND_PAUSE_S
from tensorplay_hpc.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_fut
from tensorplay_hpc.distributed.algorithms.ddp_comm_hooks.grad_bucket import (
    CommHook, GradBucket, HookResult, result_done, result_tensor)

from .bucket_assignment import BucketShard

if TYPE_CHECKING:
    from .zero_redundancy_optimizer import ZeroRedundancyOptimizer

__all__ = ["DDPOverlap", "WARMUP_ITERATIONS"]

WARMUP_ITERATIONS = 2
"""Synchronized backward passes that do not step (one more with a static graph)."""


class _BucketStep:
    """A bucket's reduction in flight, followed by the owners' step and the broadcasts; what
    the interleaved hook returns to DDP (``is_completed()`` and ``wait()`` like the
    reduction's)."""

    def __init__(self, overlap: "DDPOverlap", bucket: GradBucket, reduction: HookResult) -> None:
        self._overlap = overlap
        self._bucket = bucket
        self._reduction = reduction
        self._stepped = False

    def _step(self) -> None:
        self._stepped = True
        self._overlap.step_bucket(self._bucket.index(), result_tensor(self._reduction))

    def is_completed(self) -> bool:
        if not self._stepped and result_done(self._reduction):
            self._step()
        return self._stepped

    def wait(self) -> torch.Tensor:
        if not self._stepped:
            self._reduction.wait()
            self._step()
        if self._bucket.is_last():
            self._overlap.finish()
        return result_tensor(self._reduction)


class _OwnersStep(_BucketStep):
    """ZeRO-2: a bucket's gradients reduced only to the ranks owning its parameters (a
    blocking reduce per shard, to its owner, on DDP's communication thread, so the backward
    pass goes on meanwhile: Open MPI's nonblocking reduce advances only inside MPI calls; below
    ``MPI_THREAD_MULTIPLE`` DDP has no such thread and the reduces block in the hook), then the
    owners' step and the nonblocking broadcasts. DDP keeps no gradients of the bucket
    (:attr:`consumes_gradients`).

    The reduces run on the duplicate cached on the process group, the broadcasts on ZeRO's
    own: a rank may start bucket ``b``'s broadcasts before or after bucket ``b + 1``'s reduces,
    and each communicator must see its collectives in the same order on every rank."""

    consumes_gradients = True

    def __init__(self, overlap: "DDPOverlap", bucket: GradBucket) -> None:
        group = private_comm(overlap.zero.process_group)
        flat = overlap.flats[bucket.index()]
        shards = overlap.shards[bucket.index()]

        def reduce_to_owners(buffer: torch.Tensor) -> None:
            comm.quiet_barrier(group, BACKGROUND_PAUSE_S)   # on DDP's thread, as its reductions
            buffer.div_(group.Get_size())
            for shard in shards:
                comm.reduce(buffer[flat.offsets[shard.start]:overlap.end(flat, shard)], group,
                            shard.rank)
        with trace.caller(f"ZeRO-2 gradients, bucket {bucket.index()}"):
            reduction = overlap.ddp.reducer.submit(bucket.buffer(), reduce_to_owners)
        super().__init__(overlap, bucket, reduction)


class DDPOverlap:
    """The stepper of a ZeRO optimizer overlapped with ``ddp``: it carries out the plan
    ``shards`` (from :func:`.bucket_assignment.assign`, which ``zero.overlap_with`` makes and
    builds ``zero``'s partition from), makes each bucket's parameters views into one flat buffer,
    and gives the communication hooks that step. Not collective."""

    def __init__(self, zero: "ZeroRedundancyOptimizer", ddp: Any,
                 shards: List[List[BucketShard]]) -> None:
        self.zero = zero
        self._ddp = weakref.ref(ddp)
        self.params = [bucket.parameters() for bucket in ddp.buckets]
        self.shards = shards
        self.flats = []
        for params in self.params:
            flat = comm.FlatBuffer([p.shape for p in params], params[0].dtype, params[0].device)
            with torch.no_grad():
                flat.copy_from(params)
            for param, view in zip(params, flat.views):
                param.data = view
            self.flats.append(flat)
        self.iterations = 0   # synchronized backward passes seen, warm-up included
        self._stepping = False
        self._broadcasts: List[comm.Work] = []
        self._reduced: List[Tuple[int, Any]] = []

    @property
    def ddp(self) -> Any:
        """The DistributedDataParallel model (held weakly: it holds the hook, which holds
        this)."""
        return self._ddp()

    @property
    def owners(self) -> List[List[int]]:
        """The ranks owning parameters of each bucket, in parameter order."""
        return [[shard.rank for shard in shards] for shards in self.shards]

    def _warmup_iterations(self) -> int:
        ddp = self.ddp
        return WARMUP_ITERATIONS + int(bool(ddp is not None and ddp.static_graph))

    def _steps_in_this_pass(self, bucket: GradBucket) -> bool:
        """Whether this backward pass steps; counts the passes (at their last bucket)."""
        if bucket.index() == 0:
            self._stepping = self.iterations >= self._warmup_iterations()
        if bucket.is_last():
            self.iterations += 1
        return self._stepping

    @staticmethod
    def end(flat: comm.FlatBuffer, shard: BucketShard) -> int:
        """Where ``shard``'s elements end in its bucket's flat buffer."""
        return flat.offsets[shard.stop] if shard.stop < len(flat) else flat.buffer.numel()

    def step_bucket(self, index: int, reduced: torch.Tensor) -> None:
        """Step this rank's parameters of bucket ``index``, then start sending every owner's.
        Only this rank's part of ``reduced`` is read."""
        grads = comm.FlatBuffer([p.shape for p in self.params[index]], reduced.dtype,
                                reduced.device, buffer=reduced.reshape(-1)).views
        flat = self.flats[index]
        for shard in self.shards[index]:
            if shard.rank == self.zero.rank:
                self.zero._step_with_gradients(self.params[index][shard.start:shard.stop],
                                               grads[shard.start:shard.stop])
            with trace.caller(f"ZeRO overlap, bucket {index}"):
                self._broadcasts.append(comm.broadcast(
                    flat.buffer[flat.offsets[shard.start]:self.end(flat, shard)],
                    self.zero._group.comm, shard.rank, async_op=True))

    def finish(self) -> None:
        """Wait for every broadcast of this iteration."""
        for work in self._broadcasts:
            work.wait()
        self._broadcasts.clear()

    def interleaved_hook(self, reduce: CommHook) -> CommHook:
        """A DDP communication hook: ``reduce(state, bucket)``, then the bucket's step as soon as
        the reduction has completed."""
        def reduce_then_step(state: Any, bucket: GradBucket) -> HookResult:
            reduction = reduce(state, bucket)
            if not self._steps_in_this_pass(bucket):
                return reduction
            return _BucketStep(self, bucket, reduction)
        return reduce_then_step

    def owners_hook(self) -> CommHook:
        """A DDP communication hook for ZeRO-2: after the warm-up (plain averaging), each
        bucket's gradients are reduced only to the owners of its parameters, which step as
        soon as their part has arrived; DDP keeps no gradients."""
        def reduce_to_owners(state: Any, bucket: GradBucket) -> HookResult:
            if not self._steps_in_this_pass(bucket):
                return allreduce_fut(private_comm(self.zero.process_group), bucket.buffer())
            return _OwnersStep(self, bucket)
        return reduce_to_owners

    def hook_stepping_after_last(self, reduce: CommHook) -> CommHook:
        """A DDP communication hook: ``reduce(state, bucket)``; the last bucket's call waits for
        every bucket's reduction in turn and steps it."""
        def reduce_then_step_at_last(state: Any, bucket: GradBucket) -> HookResult:
            reduction = reduce(state, bucket)
            if not self._steps_in_this_pass(bucket):
                return reduction
            self._reduced.append((bucket.index(), reduction))
            if bucket.is_last():
                for index, pending in self._reduced:
                    self.step_bucket(index, result_tensor(pending))
                self._reduced.clear()
                self.finish()
            return reduction
        return reduce_then_step_at_last
