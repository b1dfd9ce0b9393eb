"""Parameters of one dtype and device in one flat buffer laid out rank by rank, so that a single
in-place ``all_gather_v`` hands every rank the shards that the others updated."""
from __future__ import annotations

from typing import List, Sequence

import torch
from mpi4py import MPI

from tensorplay_hpc import comm


class ShardBuffer:
    """A flat buffer holding rank 0's parameters, then rank 1's, and so on.

    Args:
        params_per_rank: the parameters (all of one dtype and device) each rank updates.
        rank: this process's rank in the group.
        as_bucket_view: make the parameters views into the buffer (their ``.data`` is replaced),
            so a sync moves no data but the collective's. Otherwise the buffer is a separate
            staging area: this rank's shard is copied in before the sync and the other shards
            copied out after it.
    """

    def __init__(self, params_per_rank: Sequence[Sequence[torch.Tensor]], rank: int,
                 as_bucket_view: bool) -> None:
        self.params: List[torch.Tensor] = [p for params in params_per_rank for p in params]
        first = self.params[0]
        self.flat = comm.FlatBuffer(self.params, first.dtype, first.device)
        self.counts = [sum(p.numel() for p in params) for params in params_per_rank]
        begin = sum(len(params) for params in params_per_rank[:rank])
        end = begin + len(params_per_rank[rank])
        self.as_bucket_view = as_bucket_view
        self._own = (self.params[begin:end], self.flat.views[begin:end])
        self._others = (self.params[:begin] + self.params[end:],
                        self.flat.views[:begin] + self.flat.views[end:])
        if as_bucket_view:
            with torch.no_grad():
                self.flat.copy_from(self.params)
            for param, view in zip(self.params, self.flat.views):
                param.data = view

    def sync(self, group: MPI.Intracomm) -> None:
        """Send this rank's shard to every rank and receive theirs, in place. Collective."""
        if not self.as_bucket_view:
            _copy(self._own[1], self._own[0])
        comm.all_gather_v(self.flat.buffer, self.counts, group)
        if not self.as_bucket_view:
            _copy(self._others[0], self._others[1])

    def release(self) -> None:
        """Give bucket-view parameters storage of their own again, so the buffer can be freed."""
        if self.as_bucket_view:
            for param in self.params:
                param.data = param.data.clone()


def _copy(targets: List[torch.Tensor], sources: List[torch.Tensor]) -> None:
    if targets:
        with torch.no_grad():
            torch._foreach_copy_(targets, sources)
