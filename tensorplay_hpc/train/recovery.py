"""``--recover``: the training job survives a lost rank without leaving the allocation.

A step is *committed* once every rank has agreed on its loss (the allreduce that ends each
step) and, where a rank alone holds part of the state (ZeRO's optimizer shards), a copy of that
part sits in the memory of a partner rank on another node
(:class:`~tensorplay_hpc.comm.partner_copies.PartnerCopies`); the copy travels in the
background, during the next step. Each rank keeps, in memory, its model and optimizer state
after the last two steps it committed (never more than one step apart across ranks: a rank
enters the next step's agreement only after finishing this one's), three with copies (whose
newest may not have arrived when a rank is lost). When a
rank dies, the library's collectives raise
:class:`~tensorplay_hpc.comm.fault_tolerance.RankLost` on every survivor
(:mod:`tensorplay_hpc.comm.fault_tolerance`); the survivors shrink the job's communicator
(agreeing on who is gone), take the newest step that every survivor committed, put the lost
shards of that step back together from the partners' copies, restore that state, and the run
rebuilds its groups and re-splits the data over the smaller world.

Where that cannot work, every survivor says why and exits with :data:`EXIT_UNRECOVERABLE`, so
a batch script requeues the job from its last checkpoint, as after any failure.
"""
from __future__ import annotations

import copy
import pickle
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from tensorplay_hpc.checkpoint import nested_state
from tensorplay_hpc.comm import capabilities, fault_tolerance
from tensorplay_hpc.comm.mpi import MPI
from tensorplay_hpc.comm.partner_copies import PartnerCopies
from tensorplay_hpc.comm.small_collectives import all_gather_object
from tensorplay_hpc.distributed.optim import ZeroRedundancyOptimizer

from .config import TrainConfig
from .strategy import Strategy

__all__ = ["EXIT_UNRECOVERABLE", "RECOVERABLE", "Committed", "Rollback", "Shards",
           "Unrecoverable", "refusal", "shard_bytes", "shard_from_bytes", "survive"]

EXIT_UNRECOVERABLE = 86
"""Exit status of every survivor of a lost rank that could not go on: requeue the job (it
resumes from its last checkpoint)."""

RECOVERABLE = ("ddp", "local", "postlocal", "zero")
"""The ``--optimizer`` kinds the survivors of a lost rank go on with: those whose state every
rank holds whole (replicated), and ZeRO, whose shards have copies on partner ranks."""


_COPIED_STEPS = 3
"""Steps kept with partner copies: the two that ranks may be apart, and one more, since the
newest copies may still be travelling when a rank is lost."""


class Unrecoverable(RuntimeError):
    """The survivors of a lost rank cannot go on in this job; the message says why."""


def refusal(config: TrainConfig, survivors: Optional[int] = None) -> Optional[str]:
    """Why a run with ``config`` cannot continue after losing ranks (with ``survivors`` ranks
    left, when known); ``None`` when it can. Local."""
    if config.optimizer not in RECOVERABLE:
        return (f"--optimizer {config.optimizer} keeps state that each rank holds alone "
                "(shards, or replicas trained apart) without copies on partner ranks: a lost "
                f"rank's part is gone (in-job recovery covers {', '.join(RECOVERABLE)})")
    if config.comm_hook != "none":
        return (f"--comm-hook {config.comm_hook} keeps state of each rank's own (PowerSGD's "
                "error feedback) or of the node layout that is not rebuilt yet")
    if survivors is not None:
        if survivors < config.min_ranks:
            return (f"{survivors} ranks survive, fewer than --min-ranks {config.min_ranks}")
        if config.batch_size % survivors:
            return (f"--batch-size {config.batch_size} does not split over the {survivors} "
                    "surviving ranks")
    unavailable = capabilities.recovery_unavailable()
    if unavailable is not None:
        return f"ULFM is not available: {unavailable}"
    return None


@dataclass
class Shards:
    """A ZeRO optimizer's state as the ranks hold it: ``owned``, the state of this rank's
    parameters by global index as :func:`shard_bytes` packs it (the bytes its partner also
    gets), and the hyperparameters of every group."""

    owned: torch.Tensor
    param_groups: List[Dict[str, Any]]


@dataclass
class Committed:
    """This rank's model and optimizer state after ``step``, copied: the optimizer's whole
    ``state_dict()``, or its :class:`Shards`."""

    step: int
    model: Dict[str, torch.Tensor]
    optimizer: Union[Dict[str, Any], Shards]


def shard_bytes(state: Dict[int, Dict[Any, Any]]) -> torch.Tensor:
    """``state``'s tensors as one flat byte buffer, after a description of its structure (a
    few bytes per tensor). Local."""
    skeleton, tensors = nested_state.flatten(state)
    flat = [t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in tensors.values()]
    described = pickle.dumps((skeleton, [(n, t.dtype, tuple(t.shape))
                                         for n, t in tensors.items()]))
    length = torch.tensor([len(described)], dtype=torch.int64).view(torch.uint8)
    return torch.cat([length, torch.frombuffer(bytearray(described), dtype=torch.uint8), *flat])


def shard_from_bytes(payload: torch.Tensor) -> Dict[int, Dict[Any, Any]]:
    """The state :func:`shard_bytes` made ``payload`` of. Local."""
    length = int(payload[:8].view(torch.int64)[0])
    skeleton, shapes = pickle.loads(payload[8:8 + length].numpy().tobytes())
    tensors, offset = {}, 8 + length
    for name, dtype, shape in shapes:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        tensors[name] = payload[offset:offset + nbytes].clone().view(dtype).reshape(shape)
        offset += nbytes
    return nested_state.rebuild(skeleton, tensors)


class Rollback:
    """The state of the last steps this rank committed, kept in memory (two, three with
    copies), and copies of the ZeRO shards of the ranks it backs. Local, except :meth:`commit`
    of a sharded optimizer."""

    def __init__(self) -> None:
        self.kept: List[Committed] = []
        self.copies: Optional[PartnerCopies] = None
        self._copies_of: Optional[ZeroRedundancyOptimizer] = None

    def commit(self, step: int, strategy: Strategy) -> None:
        """Keep a copy of the state after ``step``, dropping the oldest. With a ZeRO optimizer
        on two ranks or more, collective: the partners start exchanging shards (once those of
        the previous commit have arrived)."""
        model = {k: v.detach().clone() for k, v in strategy.module.state_dict().items()}
        optimizer = strategy.optimizer
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            state: Union[Dict[str, Any], Shards] = Shards(shard_bytes(optimizer.owned_state()),
                                                          optimizer.indexed_param_groups())
            copies = self._partner_copies(optimizer)
            if copies is not None:
                copies.keep(step, state.owned)
        else:
            state = copy.deepcopy(optimizer.state_dict())
        older = 1 if self.copies is None else _COPIED_STEPS - 1
        self.kept = [*self.kept[-older:], Committed(step, model, state)]

    def _partner_copies(self, optimizer: ZeroRedundancyOptimizer) -> Optional[PartnerCopies]:
        """The copies among ``optimizer``'s ranks (new ones after a recovery rebuilt it)."""
        if self._copies_of is not optimizer:
            if self.copies is not None and not fault_tolerance.is_revoked(self.copies.comm):
                self.copies.close()
            self._copies_of = optimizer
            group = optimizer.join_process_group
            self.copies = (PartnerCopies(group, depth=_COPIED_STEPS) if group.Get_size() > 1
                           else None)
        return self.copies

    def settle(self) -> None:
        """Let the copies in flight arrive, or fail with a lost rank. Local."""
        if self.copies is not None:
            try:
                self.copies.settle()
            except fault_tolerance.RankLost:   # those copies are then not held
                pass

    def close(self) -> None:
        """Free the partners' communicator. Collective."""
        if self.copies is not None and not fault_tolerance.is_revoked(self.copies.comm):
            self.copies.close()
        self.copies = None

    @property
    def newest(self) -> int:
        """The newest step kept (-1 before the first commit)."""
        return self.kept[-1].step if self.kept else -1

    def supplies(self, lost: List[int]) -> List[int]:
        """The steps kept here whose whole state this rank can give after losing world ranks
        ``lost``: its own, and the copies of the lost ranks it backs. Local."""
        backed = [r for r in lost if self.copies is not None and r in self.copies.backed]
        return [c.step for c in self.kept if isinstance(c.optimizer, dict) or all(
            self.copies.held(r, c.step) is not None for r in backed)]

    def at(self, step: int) -> Committed:
        """The state kept for ``step``.

        Raises:
            Unrecoverable: it is not kept here.
        """
        for committed in self.kept:
            if committed.step == step:
                return committed
        raise Unrecoverable(f"world rank {MPI.COMM_WORLD.Get_rank()} does not hold step {step} "
                            f"(it holds steps {[c.step for c in self.kept]})")

    @property
    def sharded(self) -> List[int]:
        """The steps kept here as this rank's shard only (not yet reassembled). Local."""
        return [c.step for c in self.kept if isinstance(c.optimizer, Shards)]

    def reassemble(self, step: int, lost: List[int], survivors: MPI.Intracomm) -> None:
        """Replace the shards kept for ``step`` by the whole optimizer state of that step: each
        survivor's own shard and its copies of lost ranks' shards, gathered. Collective over
        ``survivors`` (a rank that holds the whole state already, from a recovery cut short by
        another lost rank, takes part and adds nothing)."""
        committed = self.at(step)
        parts: Dict[int, Dict[Any, Any]] = {}
        if isinstance(committed.optimizer, Shards):
            parts = shard_from_bytes(committed.optimizer.owned)
            for rank in lost:
                if self.copies is not None and rank in self.copies.backed:
                    parts.update(shard_from_bytes(self.copies.held(rank, step)))
        state: Dict[int, Dict[Any, Any]] = {}
        for gathered in all_gather_object(parts, survivors):
            state.update(gathered)
        if isinstance(committed.optimizer, Shards):
            committed.optimizer = {"state": dict(sorted(state.items())),
                                   "param_groups": committed.optimizer.param_groups}

    def restore(self, step: int, strategy: Strategy) -> None:
        """Load the state kept for ``step`` into ``strategy``'s model and optimizer (copies:
        the kept state stays as it was)."""
        committed = self.at(step)
        strategy.module.load_state_dict(committed.model)
        strategy.optimizer.load_state_dict(copy.deepcopy(committed.optimizer))
        strategy.resumed_at(step, {})


def survive(world: MPI.Intracomm, rollback: Rollback) -> Tuple[MPI.Intracomm, List[int], int]:
    """After a lost rank: the survivors' communicator, the ``MPI.COMM_WORLD`` ranks lost, and
    the newest step every survivor committed and can give whole (its own state, and the copies
    of the lost ranks' shards it holds), which is then restorable on every survivor. Collective
    over the survivors of ``world``, who must all have seen
    :class:`~tensorplay_hpc.comm.fault_tolerance.RankLost`.

    A rank lost while the survivors recover makes them shrink ``world`` again, without it.

    Raises:
        Unrecoverable: on every survivor, when a lost rank's shard and its copy were both lost,
            or no step is held whole by every survivor.
    """
    fault_tolerance.revoke_all(also=[world])
    rollback.settle()
    while True:
        survivors, lost = fault_tolerance.shrink(world)
        partners = rollback.copies.partners if rollback.copies is not None else {}
        for rank in lost:
            if partners.get(rank) in lost:
                raise Unrecoverable(f"world rank {rank}'s shard and its copy on world rank "
                                    f"{partners[rank]} were both lost")
        try:
            held = all_gather_object((rollback.supplies(lost), rollback.sharded), survivors)
            common = set.intersection(*(set(steps) for steps, _ in held))
            if not common:
                raise Unrecoverable("no committed step is held whole by every survivor")
            step = max(common)
            if any(step in sharded for _, sharded in held):
                rollback.reassemble(step, lost, survivors)
            return survivors, lost, step
        except fault_tolerance.RankLost:   # one more: the shrunk communicator is revoked
            continue
