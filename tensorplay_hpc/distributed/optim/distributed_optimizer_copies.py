"""Surviving a lost owner of :class:`~.distributed_optimizer.DistributedOptimizer` parameters
(with ULFM, :mod:`tensorplay_hpc.comm.fault_tolerance`).

An owner alone holds its parameters and their optimizer state. At each commit every rank keeps
a copy of its window memory (:meth:`~.distributed_optimizer.DistributedOptimizer.owned_bytes`:
values and state, flat, no pickling) for the last steps, and sends one to its partner on
another node (:class:`~tensorplay_hpc.comm.partner_copies.PartnerCopies`), in the background.
After a loss, each survivor takes over the tensors of the lost ranks it backs, as of the newest
step that every survivor holds whole, and the survivors share their tensors anew and build a new
optimizer on the smaller group.

A parameter keeps its *origin* through such changes of owner, ``(world rank, index)`` of the
:func:`~tensorplay_hpc.distributed.rma.share` that first exposed it, so that a trainer's model
finds its parameters in the same order before and after: :attr:`DistributedOptimizerCopies.refs`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from tensorplay_hpc.comm import fault_tolerance
from tensorplay_hpc.comm.mpi import MPI
from tensorplay_hpc.comm.partner_copies import KEPT_STEPS, PartnerCopies, newest_common
from tensorplay_hpc.comm.small_collectives import all_gather_object, barrier
from tensorplay_hpc.distributed.rma import RemoteRef

from .distributed_optimizer import DistributedOptimizer

__all__ = ["Adopted", "DistributedOptimizerCopies", "Origin"]

Origin = Tuple[int, int]
"""``(world rank, index)``: where a shared tensor was first exposed."""


@dataclass
class Adopted:
    """What a survivor owns after a loss, as of ``step``: the ``tensors`` to share (its own,
    then those of the lost ranks it backed), their ``origins``, and their optimizer ``states``
    (``{}`` where none)."""

    step: int
    tensors: List[torch.Tensor]
    origins: List[Origin]
    states: List[Dict[str, Any]]

    def load(self, optimizer: DistributedOptimizer) -> None:
        """Give ``optimizer`` (built on the references of the tensors shared anew, this rank's
        being :attr:`tensors` in order) the optimizer state of :attr:`step`. Not collective;
        no trainer may step meanwhile (build every rank's optimizer, then load, then commit)."""
        index_of = {ref.index: i for i, ref in enumerate(optimizer.parameter_refs)
                    if ref.is_owner()}
        optimizer.load_owned({i: self.tensors[j].detach() for j, i in index_of.items()},
                             {i: self.states[j] for j, i in index_of.items() if self.states[j]})


class DistributedOptimizerCopies:
    """Copies of what each rank of ``optimizer``'s group owns, for the survivors of a lost
    rank. Collective: construct it on every rank of the group (of two ranks or more) right
    after the optimizer, and :meth:`close` it (or, after a loss, leave it: its communicator
    is revoked).

    Args:
        optimizer: a :class:`~.distributed_optimizer.DistributedOptimizer`.
        origins: the origin of each tensor this rank shared, in its order; default
            ``(world rank, index)`` (right for a first share; after a loss, the adopter's
            :attr:`Adopted.origins`).

    Attributes:
        refs: every shared tensor's reference, sorted by origin: the same parameters in the
            same order on every rank, before and after a loss.
        origins: each reference's origin.
    """

    def __init__(self, optimizer: DistributedOptimizer,
                 origins: Optional[Sequence[Origin]] = None) -> None:
        self._optimizer = optimizer
        shared = optimizer.parameter_refs[0].shared
        self._comm = shared.communicator
        world = MPI.COMM_WORLD.Get_rank()
        mine = [tuple(o) for o in origins] if origins is not None else [
            (world, i) for i in range(len(shared.refs_of(shared.rank)))]
        if len(mine) != len(shared.refs_of(shared.rank)):
            raise ValueError(f"DistributedOptimizerCopies on world rank {world}: {len(mine)} "
                             f"origins for the {len(shared.refs_of(shared.rank))} tensors this "
                             "rank shared")
        gathered = all_gather_object((world, mine), self._comm)
        self._world_of = [w for w, _ in gathered]
        self._origins_of = {w: o for w, o in gathered}
        self.origins: Dict[RemoteRef, Origin] = {
            ref: gathered[rank][1][ref.index] for rank in range(shared.size)
            for ref in shared.refs_of(rank)}
        self.refs: List[RemoteRef] = sorted(self.origins, key=self.origins.__getitem__)
        self._copies = PartnerCopies(self._comm, depth=KEPT_STEPS)
        self._kept: Dict[int, torch.Tensor] = {}

    def commit(self, step: int) -> None:
        """Keep this rank's parameters and optimizer state after ``step`` and start sending
        them to its partner. Collective: every rank calls it once its steps of ``step`` have
        ended; it returns once every rank has taken its copy, before any trainer steps on."""
        barrier(self._comm)           # every trainer's steps of ``step`` have ended
        payload = self._optimizer.owned_bytes()
        self._kept = {s: self._kept[s] for s in sorted(self._kept)[-(KEPT_STEPS - 1):]}
        self._kept[step] = payload
        self._copies.keep(step, payload)
        barrier(self._comm)           # no trainer steps on before every owner has its copy

    def recover(self, world: MPI.Intracomm) -> Tuple[MPI.Intracomm, List[int], Adopted]:
        """After :class:`~tensorplay_hpc.comm.fault_tolerance.RankLost`: the survivors'
        communicator (``world`` shrunk), the ``MPI.COMM_WORLD`` ranks lost, and what this rank
        owns from now on, as of the newest step every survivor holds whole. Collective over the
        survivors of ``world``; a rank lost meanwhile is left out too.

        Raises:
            Unrecoverable: on every survivor, when a lost rank's partner was lost too, or no
                step is held whole by every survivor.
        """
        fault_tolerance.revoke_all(also=[world])
        self._optimizer.abandon()          # its windows' threads leave MPI before the shrink
        try:
            self._copies.settle()          # before the shrink: a failure there revokes
        except fault_tolerance.RankLost:   # those copies are then not held
            pass
        while True:
            survivors, lost = fault_tolerance.shrink(world)
            self._copies.check_survived(lost)
            try:
                step = newest_common(all_gather_object(
                    self._copies.whole(sorted(self._kept), lost), survivors))
                return survivors, lost, self._adopted(step, lost)
            except fault_tolerance.RankLost:   # one more: the shrunk communicator is revoked
                continue

    def _adopted(self, step: int, lost: List[int]) -> Adopted:
        """This rank's tensors as of ``step``, and those of the ``lost`` ranks it backs."""
        world = MPI.COMM_WORLD.Get_rank()
        sources = [(world, self._kept[step])] + [(rank, self._copies.held(rank, step))
                                                 for rank in lost if rank in self._copies.backed]
        tensors, origins, states = [], [], []
        for rank, payload in sources:
            held = self._optimizer.read_owned_bytes(self._world_of.index(rank), payload)
            for (value, state), origin in zip(held, self._origins_of[rank]):
                tensors.append(value)
                origins.append(origin)
                states.append(state)
        return Adopted(step, tensors, origins, states)

    def close(self) -> None:
        """Free the partners' communicator. Collective."""
        self._copies.close()
