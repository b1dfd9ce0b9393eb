"""Copies of each rank's bytes in the memory of a partner rank on another node: state that one
rank alone holds (a ZeRO shard) outlives that rank, with no disk involved. The bytes travel in
the background, on the worker of the copies' own communicator, while the next step computes.

Ranks are named by their ``MPI.COMM_WORLD`` rank, the names that
:func:`~.fault_tolerance.shrink` reports lost ranks by, so the copies stay usable after the
communicator they travelled on is revoked.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from . import point_to_point
from .fault_tolerance import Unrecoverable
from .group import ProcessGroup
from .mpi import MPI
from .node_layout import NodeLayout
from .small_collectives import all_gather_object
from .work import Work, in_background

__all__ = ["KEPT_STEPS", "PartnerCopies", "newest_common", "partner_of"]

_SIZE, _BYTES = 1, 2   # message tags

KEPT_STEPS = 3
"""Steps whose state a rank keeps, its own and its copies: the two that ranks may be apart when
one is lost, and one more, since the newest copies may still be travelling then."""


def partner_of(nodes: List[List[int]], rank: int) -> int:
    """The rank that holds ``rank``'s copies: the one at the same position on the next node
    (the last node's go to the first), or the next rank when every rank shares one node."""
    if len(nodes) == 1:
        ranks = nodes[0]
        return ranks[(ranks.index(rank) + 1) % len(ranks)]
    node = next(i for i, ranks in enumerate(nodes) if rank in ranks)
    following = nodes[(node + 1) % len(nodes)]
    return following[nodes[node].index(rank) % len(following)]


def newest_common(held: Sequence[Sequence[int]]) -> int:
    """The newest step that every survivor holds whole, from each survivor's list of them
    (gathered). Local.

    Raises:
        Unrecoverable: no step is held by every survivor.
    """
    common = set.intersection(*(set(steps) for steps in held))
    if not common:
        raise Unrecoverable("no committed step is held whole by every survivor")
    return max(common)


class PartnerCopies:
    """Each rank of ``communicator`` sends its bytes to its partner (:func:`partner_of` over
    the nodes) at every :meth:`keep`, and holds those of the ranks it backs for the ``depth``
    newest steps whose exchange has ended. Collective: construct it on every rank of a
    communicator of at least two ranks, and :meth:`close` it.

    Attributes:
        partner: the world rank holding this rank's copies.
        partners: each world rank's partner, by world rank.
        backed: the world ranks whose copies this rank holds.
    """

    def __init__(self, communicator: MPI.Intracomm, depth: int = 2) -> None:
        if communicator.Get_size() < 2:
            raise ValueError(f"PartnerCopies needs two ranks or more, not "
                             f"{communicator.Get_size()} (world rank "
                             f"{MPI.COMM_WORLD.Get_rank()})")
        self._group = ProcessGroup(communicator, owner="PartnerCopies")
        world_of = all_gather_object(MPI.COMM_WORLD.Get_rank(), self._group.comm)
        layout = NodeLayout(self._group.comm)
        nodes = [[world_of[r] for r in ranks] for ranks in layout.nodes]
        self._rank_of = {world: rank for rank, world in enumerate(world_of)}
        self.world_rank = world_of[self._group.rank]
        self.partners: Dict[int, int] = {w: partner_of(nodes, w) for w in world_of}
        self.partner = self.partners[self.world_rank]
        self.backed = [w for w in world_of if self.partners[w] == self.world_rank]
        self.depth = depth
        self._held: Dict[int, Dict[int, torch.Tensor]] = {}   # step: {world rank: bytes}
        self._travelling = Work()

    def keep(self, step: int, payload: torch.Tensor) -> None:
        """Start sending ``payload`` (this rank's bytes after ``step``, a 1-D ``uint8`` CPU
        tensor, not to be changed afterwards) to the partner and receiving the backed ranks'
        bytes of ``step``, once the exchange of the previous :meth:`keep` has ended (raising what
        ended it otherwise); returns at once where MPI lets threads call it, else once the bytes
        are in place. :meth:`settle` waits for them. Collective.

        Raises:
            TypeError: ``payload`` is not a 1-D ``uint8`` CPU tensor (checked here, not on the
                worker, so that the error reaches the caller at once).
        """
        if not (isinstance(payload, torch.Tensor) and payload.dtype == torch.uint8
                and payload.dim() == 1 and payload.device.type == "cpu"):
            kind = (f"a {payload.dim()}-D {payload.dtype} tensor on {payload.device}"
                    if isinstance(payload, torch.Tensor) else type(payload).__name__)
            raise TypeError(f"PartnerCopies.keep: the payload of step {step} must be a 1-D "
                            f"uint8 CPU tensor, got {kind} (world rank {self.world_rank})")
        self.settle()
        comm = self._group.comm
        self._travelling = in_background(comm, lambda: self._exchange(comm, step, payload))

    def settle(self) -> None:
        """Wait until the bytes of the last :meth:`keep` are in place; raise what ended their
        exchange (a lost rank's :class:`~.fault_tolerance.RankLost`). Local."""
        self._travelling.wait()

    def _exchange(self, comm: MPI.Intracomm, step: int, payload: torch.Tensor) -> None:
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        sizes = {w: torch.empty(1, dtype=torch.int64) for w in self.backed}
        self._swap(comm, size, sizes, _SIZE)
        copies = {w: torch.empty(int(n[0]), dtype=torch.uint8) for w, n in sizes.items()}
        self._swap(comm, payload, copies, _BYTES)
        held = {**self._held, step: copies}
        self._held = {s: held[s] for s in sorted(held)[-self.depth:]}   # one assignment

    def _swap(self, comm: MPI.Intracomm, mine: torch.Tensor,
              theirs: Dict[int, torch.Tensor], tag: int) -> None:
        works = [point_to_point.send(mine, comm, self._rank_of[self.partner], tag)]
        works += [point_to_point.receive(t, comm, self._rank_of[w], tag)
                  for w, t in theirs.items()]
        for work in works:
            work.wait(quietly=True)   # beside the next step's computation

    @property
    def comm(self) -> MPI.Intracomm:
        """The private communicator the copies travel on."""
        return self._group.comm

    def held(self, rank: int, step: int) -> Optional[torch.Tensor]:
        """World rank ``rank``'s bytes after ``step``, if this rank holds them (once their
        exchange has ended). Local."""
        return self._held.get(step, {}).get(rank)

    def whole(self, steps: Sequence[int], lost: Sequence[int]) -> List[int]:
        """Those of ``steps`` for which this rank holds the copies of every rank of ``lost``
        (world ranks) that it backs. Local."""
        backed = [rank for rank in lost if rank in self.backed]
        return [step for step in steps
                if all(self.held(rank, step) is not None for rank in backed)]

    def check_survived(self, lost: Sequence[int]) -> None:
        """Raise :class:`~.fault_tolerance.Unrecoverable` if a rank of ``lost`` (world ranks)
        lost its copies too: its partner is among them. Local."""
        for rank in lost:
            if self.partners.get(rank) in lost:
                raise Unrecoverable(f"world rank {rank}'s own state and its copy on world rank "
                                    f"{self.partners[rank]} were both lost")

    @property
    def steps(self) -> List[int]:
        """The steps whose copies this rank holds, oldest first. Local."""
        return sorted(self._held)

    def close(self) -> None:
        """Let the exchange in flight end (raising what ended it otherwise), then free the
        communicator (the copies held stay readable). Collective."""
        self.settle()
        self._group.close()
