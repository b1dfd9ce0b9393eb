"""How ZeroRedundancyOptimizer hands every rank the shards that the others updated: one
in-place ``all_gather_v`` of parameters laid out rank by rank (:class:`ShardBuffer`, with
``parameters_as_bucket_view``), or the same in rounds through a small staging buffer, the
parameters keeping their own storage (:class:`StagedShards`)."""
from __future__ import annotations

from typing import List, Sequence, Tuple, Union

import torch

from tensorplay_hpc import comm
from tensorplay_hpc.comm.chunking import piece_elements
from tensorplay_hpc.comm.mpi import MPI

__all__ = ["AnyShards", "Segment", "ShardBuffer", "StagedShards"]

Segment = Tuple[int, int, int]
"""``(k, start, stop)``: elements ``start:stop`` of a rank's ``k``-th parameter, flattened."""


class ShardBuffer:
    """The parameters as views into one flat buffer holding rank 0's parameters, then rank
    1's, and so on (their ``.data`` is replaced), so a sync moves no data but the
    collective's.

    Args:
        params_per_rank: the parameters (all of one dtype and device) each rank updates.
    """

    def __init__(self, params_per_rank: Sequence[Sequence[torch.Tensor]]) -> None:
        self.params: List[torch.Tensor] = [p for params in params_per_rank for p in params]
        first = self.params[0]
        self.flat = comm.FlatBuffer(self.params, first.dtype, first.device)
        self.counts = [sum(p.numel() for p in params) for params in params_per_rank]
        with torch.no_grad():
            self.flat.copy_from(self.params)
        for param, view in zip(self.params, self.flat.views):
            param.data = view

    def sync(self, group: MPI.Intracomm) -> None:
        """Send this rank's shard to every rank and receive theirs, in place. Collective."""
        comm.all_gather_v(self.flat.buffer, self.counts, group)

    def release(self) -> None:
        """Give the parameters storage of their own again, so the buffer can be freed."""
        for param in self.params:
            param.data = param.data.clone()


class _Round:
    """One round of :class:`StagedShards`: what each rank sends, and where it sits in the
    staging buffer (rank by rank)."""

    def __init__(self, staging: torch.Tensor, segments: List[List[Segment]],
                 shapes: List[List[torch.Size]]) -> None:
        self.counts = [sum(stop - start for _, start, stop in mine) for mine in segments]
        self.total = sum(self.counts)
        self.whole: List[Tuple[List[int], List[torch.Tensor]]] = []
        self.partial: List[List[Tuple[int, int, int, torch.Tensor]]] = []
        offset = 0
        for rank, mine in enumerate(segments):
            indices, views, pieces = [], [], []
            for k, start, stop in mine:
                piece = staging[offset:offset + stop - start]
                if start == 0 and stop == shapes[rank][k].numel():
                    indices.append(k)
                    views.append(piece.view(shapes[rank][k]))
                else:
                    pieces.append((k, start, stop, piece))
                offset += stop - start
            self.whole.append((indices, views))
            self.partial.append(pieces)


def _segments(numels: List[int], start: int, stop: int) -> List[Segment]:
    """The parameter pieces covering elements ``start:stop`` of parameters laid end to end."""
    found, offset = [], 0
    for k, numel in enumerate(numels):
        if offset + numel > start and offset < stop:
            found.append((k, max(start, offset) - offset, min(stop, offset + numel) - offset))
        offset += numel
        if offset >= stop:
            break
    return found


class StagedShards:
    """The same exchange as :class:`ShardBuffer` for parameters that keep their own storage:
    in rounds, each moving at most one piece (``TENSORPLAY_HPC_PIECE_BYTES``, 4 MiB by
    default) through a staging buffer of that size, so no full-size copy of the parameters is
    ever kept. Round ``i`` carries elements ``i * p`` to ``(i + 1) * p`` of every rank's shard,
    ``p`` being the piece over the number of ranks. Non-contiguous parameters are made
    contiguous (their ``.data`` is replaced).

    Args:
        params_per_rank: the parameters (all of one dtype and device) each rank updates.
        rank: this process's rank in the group.
    """

    def __init__(self, params_per_rank: Sequence[Sequence[torch.Tensor]], rank: int) -> None:
        self.params_per_rank = [list(params) for params in params_per_rank]
        self.rank = rank
        for param in (p for params in self.params_per_rank for p in params):
            if not param.is_contiguous():
                param.data = param.data.contiguous()
        first = next(p for params in self.params_per_rank for p in params)
        shapes = [[p.shape for p in params] for params in self.params_per_rank]
        numels = [[shape.numel() for shape in mine] for mine in shapes]
        counts = [sum(n) for n in numels]
        per_rank = max(1, piece_elements(first.element_size()) // len(counts))
        rounds = max(1, -(-max(counts) // per_rank))
        self.staging = torch.empty(min(per_rank * len(counts), sum(counts)), dtype=first.dtype,
                                   device=first.device)
        self.rounds = [_Round(self.staging, [_segments(n, i * per_rank, (i + 1) * per_rank)
                                             for n in numels], shapes)
                       for i in range(rounds)]

    def sync(self, group: MPI.Intracomm) -> None:
        """Send this rank's shard to every rank and receive theirs. Collective."""
        with torch.no_grad():
            for step in self.rounds:
                self._copy(step, self.rank, outwards=True)
                comm.all_gather_v(self.staging[:step.total], step.counts, group)
                for rank in range(len(step.counts)):
                    if rank != self.rank:
                        self._copy(step, rank, outwards=False)

    def _copy(self, step: _Round, rank: int, outwards: bool) -> None:
        """Copy ``rank``'s parameters of round ``step`` into the staging buffer (``outwards``)
        or back from it."""
        params = self.params_per_rank[rank]
        indices, views = step.whole[rank]
        if indices:
            chosen = [params[k].detach() for k in indices]
            torch._foreach_copy_(*((views, chosen) if outwards else (chosen, views)))
        for k, start, stop, piece in step.partial[rank]:
            flat = params[k].detach().view(-1)[start:stop]
            (piece if outwards else flat).copy_(flat if outwards else piece)

    def release(self) -> None:
        """Nothing to give back: the parameters kept their storage."""


AnyShards = Union[ShardBuffer, StagedShards]
