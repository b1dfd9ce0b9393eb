"""Which rank steps which parameters of each DistributedDataParallel gradient bucket when
ZeroRedundancyOptimizer overlaps DDP: PyTorch's two assignments, chosen by the
``shard_buckets`` argument of ``hook_with_zero_step``."""
from __future__ import annotations

from typing import Collection, List, NamedTuple, Sequence


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
