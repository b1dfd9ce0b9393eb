"""``--recover``: the training job survives a lost rank without leaving the allocation.

A step is *committed* once every rank has agreed on its loss (the allreduce that ends each
step) and, where a rank alone holds part of the state (ZeRO's optimizer shards, PowerSGD's error
feedback), a copy of that part sits in the memory of a partner rank on another node
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
rebuilds its groups and re-splits the data over the smaller world. A lost rank's PowerSGD error
feedback (the part of its gradients that compression has not delivered yet) joins its partner's,
and every survivor's is scaled by survivors / ranks before, so that the correction still due,
the mean of the ranks' errors, is the same on fewer ranks.

Where that cannot work, every survivor says why and exits with :data:`EXIT_UNRECOVERABLE`, so
a batch script requeues the job from its last checkpoint, as after any failure.
"""
from __future__ import annotations

import copy
import pickle
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from tensorplay_hpc.checkpoint import nested_state
from tensorplay_hpc.checkpoint.sharded_tensors import (
    OwnRows, holds_sharded, is_sharded, load_model, local_part, own_rows, replicated_elsewhere,
    whole_from_rows)
from tensorplay_hpc.comm import capabilities, fault_tolerance
from tensorplay_hpc.comm.mpi import MPI
from tensorplay_hpc.comm.fault_tolerance import Unrecoverable
from tensorplay_hpc.comm.partner_copies import KEPT_STEPS, PartnerCopies, newest_common
from tensorplay_hpc.comm.small_collectives import all_gather_object
from tensorplay_hpc.distributed.optim import ZeroRedundancyOptimizer

from .config import TrainConfig
from .strategy import POWER_SGD_PREFIX, Strategy

__all__ = ["EXIT_UNRECOVERABLE", "RECOVERABLE", "Committed", "Rollback", "Unrecoverable",
           "refusal", "shard_bytes", "shard_from_bytes", "survive"]

EXIT_UNRECOVERABLE = fault_tolerance.EXIT_UNRECOVERABLE
"""Exit status of every survivor of a lost rank that could not go on: requeue the job (it
resumes from its last checkpoint)."""

RECOVERABLE = ("ddp", "diloco", "fsdp", "hsdp", "local", "postlocal", "zero")
"""The ``--optimizer`` kinds the survivors of a lost rank go on with: those whose state every
rank holds whole (replicated) or that replicas train apart (post-local SGD, DiLoCo: a lost
replica's progress not yet averaged is its own), and ZeRO and FSDP2, whose shards have copies
on partner ranks (hybrid sharding's on the other nodes' replicas, too); with any
``--comm-hook``."""

# What a rank alone holds, as its partner keeps it: its optimizer state (ZeRO's shard, FSDP2's
# rows), its rows of FSDP2's parameters, and PowerSGD's error feedback (the hook's entries).
_SHARD, _ROWS = "optimizer", "model"
_ERROR_FEEDBACK = POWER_SGD_PREFIX + "error_dict."
_ROWS_FROM = "rows from"   # with "rows" and "of": a rank's rows of a sharded tensor of so many



def refusal(config: TrainConfig, survivors: Optional[int] = None,
            nodes: Sequence[int] = ()) -> Optional[str]:
    """Why a run with ``config`` cannot continue after losing ranks (with ``survivors`` ranks
    left, when known, on ``nodes`` holding so many ranks each); ``None`` when it can. Local."""
    if config.optimizer not in RECOVERABLE:
        return (f"--optimizer {config.optimizer} is not rebuilt after a lost rank (in-job "
                f"recovery covers {', '.join(RECOVERABLE)})")
    if config.optimizer == "hsdp" and len(set(nodes)) > 1:
        return (f"--optimizer hsdp needs as many ranks on every node, and the survivors' "
                f"nodes hold {', '.join(map(str, nodes))} (a whole node lost is survived)")
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
class Committed:
    """This rank's state after ``step``, copied: the model's (but FSDP2's sharded parameters,
    until :meth:`Rollback.reassemble` puts them together); the optimizer's (its whole
    ``state_dict()``, or a sharded optimizer's ``param_groups`` alone until reassembled); the
    communication hook's (:meth:`~.strategy.Strategy.hook_extra`); and ``own``, what this rank
    alone holds (shards, PowerSGD's error feedback) as :func:`shard_bytes` packs it, the bytes
    its partner also keeps: ``None`` when there is nothing, or once reassembled."""

    step: int
    model: Dict[str, torch.Tensor]
    optimizer: Dict[str, Any]
    hook: Dict[str, Any]
    own: Optional[torch.Tensor] = None


def _rows(tensor: torch.Tensor) -> Dict[str, Any]:
    """This rank's rows of a sharded tensor (not a copy: :func:`shard_bytes` copies them),
    where they start and the tensor's length. Local."""
    start, rows = own_rows(tensor)
    return {_ROWS_FROM: start, "rows": rows, "of": tensor.size(0)}


def _merged(entries: Iterable[Dict[Any, Any]]) -> Dict[Any, Any]:
    """The entries' keys in one dict: the rows of a sharded value (:func:`_rows`) from every
    entry put together, other values taken as they are. Local.

    Raises:
        Unrecoverable: rows of a value are held by no one (every replica of them lost).
    """
    merged: Dict[Any, Any] = {}
    pieces: Dict[Any, List[Tuple[int, torch.Tensor]]] = {}
    lengths: Dict[Any, int] = {}
    for entry in entries:
        for key, value in entry.items():
            if isinstance(value, dict) and _ROWS_FROM in value:
                pieces.setdefault(key, []).append((value[_ROWS_FROM], value["rows"]))
                lengths[key] = value["of"]
            else:
                merged[key] = value
    for key, rows in pieces.items():
        try:
            merged[key] = whole_from_rows(rows, lengths[key])
        except ValueError as gap:
            raise Unrecoverable(f"{key}: {gap}: every rank that held them was lost") from None
    return merged


def shard_bytes(state: Dict[Any, Any]) -> torch.Tensor:
    """``state``'s tensors as one flat byte buffer, after a description of its structure (a
    few bytes per tensor). Local."""
    skeleton, tensors = nested_state.flatten(state)
    flat = [t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in tensors.values()]
    described = pickle.dumps((skeleton, [(n, t.dtype, tuple(t.shape))
                                         for n, t in tensors.items()]))
    length = torch.tensor([len(described)], dtype=torch.int64).view(torch.uint8)
    return torch.cat([length, torch.frombuffer(bytearray(described), dtype=torch.uint8), *flat])


def shard_from_bytes(payload: torch.Tensor) -> Dict[Any, Any]:
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
    copies), and copies of what the ranks it backs alone hold. Local, except :meth:`commit`
    where ranks hold state of their own."""

    def __init__(self) -> None:
        self.kept: List[Committed] = []
        self.copies: Optional[PartnerCopies] = None
        self._copies_of: Optional[Strategy] = None

    def commit(self, step: int, strategy: Strategy) -> None:
        """Keep a copy of the state after ``step``, dropping the oldest. Where ranks hold state
        of their own (ZeRO, FSDP2, PowerSGD's error feedback) on two ranks or more, collective:
        the partners start exchanging it (once that of the previous commit has arrived)."""
        model, rows, replicas = {}, {}, True
        for name, value in strategy.module.state_dict().items():
            if is_sharded(value):
                rows[name] = _rows(value)
                replicas = replicas and replicated_elsewhere(value)
            else:
                model[name] = value.detach().clone()
        optimizer, hook = strategy.optimizer, strategy.hook_extra()
        own: Dict[str, Any] = {k: v for k, v in hook.items() if k.startswith(_ERROR_FEEDBACK)}
        if rows:
            own[_ROWS] = rows
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            own[_SHARD] = optimizer.owned_state()
            state = {"param_groups": optimizer.indexed_param_groups()}
        elif holds_sharded(optimizer):
            whole = optimizer.state_dict()
            own[_SHARD] = {index: {k: _rows(v) if is_sharded(v) else v for k, v in entry.items()}
                           for index, entry in whole["state"].items()}
            state = {"param_groups": copy.deepcopy(whole["param_groups"])}
        else:
            state = copy.deepcopy(optimizer.state_dict())
        payload = shard_bytes(own) if own else None
        # Hybrid sharding's other replicas hold this rank's rows already: no copy of them.
        sent = {k: v for k, v in own.items() if not (rows and replicas and k in (_ROWS, _SHARD))}
        copies = self._partner_copies(strategy) if sent else None
        if copies is not None:
            copies.keep(step, payload if sent.keys() == own.keys() else shard_bytes(sent))
        older = 1 if self.copies is None else KEPT_STEPS - 1
        self.kept = [*self.kept[-older:], Committed(step, model, state, hook, payload)]

    def _partner_copies(self, strategy: Strategy) -> Optional[PartnerCopies]:
        """The copies among ``strategy``'s ranks (new ones after a recovery rebuilt it)."""
        if self._copies_of is not strategy:
            if self.copies is not None and not fault_tolerance.is_revoked(self.copies.comm):
                self.copies.close()
            self._copies_of = strategy
            group = strategy.ranks
            self.copies = (PartnerCopies(group, depth=KEPT_STEPS) if group.Get_size() > 1
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
        whole = (self.copies.whole([c.step for c in self.kept], lost)
                 if self.copies is not None else [c.step for c in self.kept])
        return [c.step for c in self.kept if c.own is None or c.step in whole]

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
        """The steps kept here with state of this rank's own that is not yet reassembled.
        Local."""
        return [c.step for c in self.kept if c.own is not None]

    def reassemble(self, step: int, lost: List[int], survivors: MPI.Intracomm) -> None:
        """Make the state kept for ``step`` what the survivors go on with. The shards (ZeRO's
        optimizer state, FSDP2's parameters and optimizer state) become whole: each survivor's
        own and its copies of the lost ranks', gathered. PowerSGD's error feedback takes in the
        copies of the lost ranks' and is scaled by survivors / ranks before (see the module's
        note). Collective over ``survivors`` (a rank that did so already, in a recovery cut
        short by another lost rank, takes part and adds nothing)."""
        committed = self.at(step)
        mine: Dict[str, List[Dict[Any, Any]]] = {}
        if committed.own is not None:
            own = shard_from_bytes(committed.own)
            theirs = [shard_from_bytes(self.copies.held(rank, step)) for rank in lost
                      if self.copies is not None and rank in self.copies.backed]
            kept = survivors.Get_size() / (survivors.Get_size() + len(lost))
            for key, error in own.items():
                if key.startswith(_ERROR_FEEDBACK):
                    committed.hook[key] = sum((t[key] for t in theirs), error).mul_(kept)
            mine = {part: [held[part] for held in (own, *theirs) if part in held]
                    for part in (_ROWS, _SHARD)}
        gathered = all_gather_object(mine, survivors)
        if committed.own is not None:
            committed.model.update(_merged(
                entry for parts in gathered for entry in parts.get(_ROWS, [])))
            states = [entry for parts in gathered for entry in parts.get(_SHARD, [])]
            if states and "state" not in committed.optimizer:
                indices = sorted({index for entry in states for index in entry})
                committed.optimizer = {"state": {i: _merged(e[i] for e in states if i in e)
                                                 for i in indices}, **committed.optimizer}
        committed.own = None

    def restore(self, step: int, strategy: Strategy) -> None:
        """Load the state kept for ``step`` into ``strategy``'s model and optimizer (copies:
        the kept state stays as it was)."""
        committed = self.at(step)
        own = strategy.module.state_dict()
        load_model(strategy.module, {name: local_part(value, own[name]) if is_sharded(own[name])
                                     else value for name, value in committed.model.items()})
        state = copy.deepcopy(committed.optimizer)
        if holds_sharded(strategy.optimizer):   # whole values to this rank's rows, as DTensors
            params = [p for group in strategy.optimizer.param_groups for p in group["params"]]
            rows = OwnRows({i: p for i, p in enumerate(params) if is_sharded(p)})
            for index, entry in state["state"].items():
                for key, value in entry.items():
                    if (index in rows.targets and isinstance(value, torch.Tensor)
                            and value.shape == params[index].shape):
                        entry[key] = rows.wrap(index, rows.cut(index, value))
        strategy.optimizer.load_state_dict(state)
        strategy.resumed_at(step, committed.hook)


def survive(world: MPI.Intracomm, rollback: Rollback) -> Tuple[MPI.Intracomm, List[int], int]:
    """After a lost rank: the survivors' communicator, the ``MPI.COMM_WORLD`` ranks lost, and
    the newest step every survivor committed and can give whole (its own state, and the copies
    of the lost ranks' shards it holds), which is then restorable on every survivor. Collective
    over the survivors of ``world``, who must all have seen
    :class:`~tensorplay_hpc.comm.fault_tolerance.RankLost`.

    A rank lost while the survivors recover makes them shrink ``world`` again, without it.

    Raises:
        Unrecoverable: on every survivor, when a lost rank's own state and its copy were both
            lost, or no step is held whole by every survivor.
    """
    fault_tolerance.revoke_all(also=[world])
    rollback.settle()
    while True:
        survivors, lost = fault_tolerance.shrink(world)
        if rollback.copies is not None:
            rollback.copies.check_survived(lost)
        try:
            held = all_gather_object((rollback.supplies(lost), rollback.sharded), survivors)
            step = newest_common([steps for steps, _ in held])
            if any(step in sharded for _, sharded in held):
                rollback.reassemble(step, lost, survivors)
            return survivors, lost, step
        except fault_tolerance.RankLost:   # one more: the shrunk communicator is revoked
            continue
