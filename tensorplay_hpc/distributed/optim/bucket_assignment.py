"""Which rank steps which parameters of each DistributedDataParallel gradient bucket when
ZeroRedundancyOptimizer overlaps DDP (the plan that :mod:`.ddp_overlap` carries out): PyTorch's
two assignments, chosen by the ``shard_buckets`` argument of the ``ddp_zero_hook`` hooks."""
from __future__ import annotations

from typing import Collection, Dict, List, NamedTuple, Sequence, Tuple

import torch

__all__ = ["BucketShard", "assign", "sharded_buckets", "whole_buckets"]


class BucketShard(NamedTuple):
    """Parameters ``start:stop`` (positions in the bucket) of bucket ``bucket``, owned by
    ``rank``."""
    bucket: int
    rank: int
    start: int
    stop: int


def whole_buckets(bucket_numels: Sequence[Sequence[int]],
                  world_size: int) -> List[List[BucketShard]]:
    """Bucket ``b`` goes whole to rank ``b % world_size``. One list of shards per bucket."""
    return [[BucketShard(b, b % world_size, 0, len(numels))]
            for b, numels in enumerate(bucket_numels)]


def _least_loaded(loads: Sequence[int], taken: Collection[int]) -> int:
    """The rank with the smallest load (ties to the lowest) among those not in ``taken``; among
    all ranks when every rank is taken."""
    candidates = [r for r in range(len(loads)) if r not in taken] or range(len(loads))
    return min(candidates, key=loads.__getitem__)


def sharded_buckets(bucket_numels: Sequence[Sequence[int]],
                    world_size: int) -> List[List[BucketShard]]:
    """Buckets split into runs of parameters, so that each rank owns about ``1 / world_size``
    of the elements.

    Buckets are taken smallest first (equal sizes in index order). Each is cut into consecutive
    runs: a run ends before the parameter that would bring it to ``total / world_size``
    elements (a run holds at least one parameter). Each run goes to the least loaded rank not
    yet owning part of the same bucket. One list of shards per bucket, in parameter order.
    """
    threshold = sum(map(sum, bucket_numels)) / world_size
    loads = [0] * world_size
    shards: List[List[BucketShard]] = [[] for _ in bucket_numels]
    for b in sorted(range(len(bucket_numels)), key=lambda b: sum(bucket_numels[b])):
        numels = bucket_numels[b]
        start, size = 0, 0
        for position, numel in enumerate(numels):
            if size + numel >= threshold and position > start:
                rank = _least_loaded(loads, [s.rank for s in shards[b]])
                shards[b].append(BucketShard(b, rank, start, position))
                loads[rank] += size
                start, size = position, 0
            size += numel
        rank = _least_loaded(loads, [s.rank for s in shards[b]])
        shards[b].append(BucketShard(b, rank, start, len(numels)))
        loads[rank] += size
    return shards


def assign(bucket_params: Sequence[Sequence[torch.Tensor]], index_of: Dict[torch.Tensor, int],
           world_size: int, shard_buckets: bool, rank: int) -> Tuple[List[List[BucketShard]],
                                                                    List[int]]:
    """The plan of an overlap: the shards of each bucket (:func:`sharded_buckets` or
    :func:`whole_buckets`), and the owning rank of each parameter by its global index
    (``index_of``; rank 0 for parameters in no bucket, which never step). Local.

    Raises:
        ValueError: a parameter of the buckets is not in ``index_of`` (named with ``rank``).
    """
    for params in bucket_params:
        for param in params:
            if param not in index_of:
                raise ValueError(
                    "overlap_with_ddp: a parameter of the DistributedDataParallel model (shape "
                    f"{tuple(param.shape)}) is not one of the optimizer's (rank {rank})")
    numels = [[p.numel() for p in params] for params in bucket_params]
    shards = (sharded_buckets if shard_buckets else whole_buckets)(numels, world_size)
    rank_of = [0] * len(index_of)
    for shard in (s for per_bucket in shards for s in per_bucket):
        for param in bucket_params[shard.bucket][shard.start:shard.stop]:
            rank_of[index_of[param]] = shard.rank
    return shards, rank_of
