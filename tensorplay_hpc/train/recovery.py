"""``--recover``: the training job survives a lost rank without leaving the allocation.

A step is *committed* once every rank has agreed on its loss (the allreduce that ends each
step). Each rank keeps, in memory, its model and optimizer state after the last two steps it
committed (never more than one step apart across ranks: a rank enters the next step's agreement
only after finishing this one's). When a rank dies, the library's collectives raise
:class:`~tensorplay_hpc.comm.fault_tolerance.RankLost` on every survivor
(:mod:`tensorplay_hpc.comm.fault_tolerance`); the survivors shrink the job's communicator
(agreeing on who is gone), take the newest step that every survivor committed, restore that
state, and the run rebuilds its groups and re-splits the data over the smaller world.

Where that cannot work, every survivor says why and exits with :data:`EXIT_UNRECOVERABLE`, so
a batch script requeues the job from its last checkpoint, as after any failure.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from tensorplay_hpc.comm import capabilities, fault_tolerance
from tensorplay_hpc.comm.mpi import MPI
from tensorplay_hpc.comm.small_collectives import all_reduce_object

from .config import TrainConfig
from .strategy import Strategy

__all__ = ["EXIT_UNRECOVERABLE", "RECOVERABLE", "Committed", "Rollback", "Unrecoverable",
           "refusal", "survive"]

EXIT_UNRECOVERABLE = 86
"""Exit status of every survivor of a lost rank that could not go on: requeue the job (it
resumes from its last checkpoint)."""

RECOVERABLE = ("ddp", "local", "postlocal")
"""The ``--optimizer`` kinds whose state every rank holds whole (replicated), so the survivors
lose nothing with a rank."""


class Unrecoverable(RuntimeError):
    """The survivors of a lost rank cannot go on in this job; the message says why."""


def refusal(config: TrainConfig, survivors: Optional[int] = None) -> Optional[str]:
    """Why a run with ``config`` cannot continue after losing ranks (with ``survivors`` ranks
    left, when known); ``None`` when it can. Local."""
    if config.optimizer not in RECOVERABLE:
        return (f"--optimizer {config.optimizer} keeps state sharded over the ranks, and a "
                "copy of each shard on a partner rank is not built yet: the lost rank's shard "
                f"is gone (in-job recovery covers {', '.join(RECOVERABLE)})")
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
class Committed:
    """This rank's model and optimizer state after ``step``, copied."""

    step: int
    model: Dict[str, torch.Tensor]
    optimizer: Dict[str, Any]


class Rollback:
    """The state of the last two steps this rank committed, kept in memory. Local."""

    def __init__(self) -> None:
        self.kept: List[Committed] = []

    def commit(self, step: int, strategy: Strategy) -> None:
        """Keep a copy of the state after ``step``, dropping all but the previous one."""
        model = {k: v.detach().clone() for k, v in strategy.module.state_dict().items()}
        optimizer = copy.deepcopy(strategy.optimizer.state_dict())
        self.kept = [*self.kept[-1:], Committed(step, model, optimizer)]

    @property
    def newest(self) -> int:
        """The newest step kept (-1 before the first commit)."""
        return self.kept[-1].step if self.kept else -1

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

    def restore(self, step: int, strategy: Strategy) -> None:
        """Load the state kept for ``step`` into ``strategy``'s model and optimizer (copies:
        the kept state stays as it was)."""
        committed = self.at(step)
        strategy.module.load_state_dict(committed.model)
        strategy.optimizer.load_state_dict(copy.deepcopy(committed.optimizer))
        strategy.resumed_at(step, {})


def survive(world: MPI.Intracomm, rollback: Rollback) -> Tuple[MPI.Intracomm, List[int], int]:
    """After a lost rank: the survivors' communicator, the ``MPI.COMM_WORLD`` ranks lost, and
    the newest step every survivor committed (which every survivor holds). Collective over the
    survivors of ``world``, who must all have seen
    :class:`~tensorplay_hpc.comm.fault_tolerance.RankLost`."""
    fault_tolerance.revoke_all(also=[world])
    survivors, lost = fault_tolerance.shrink(world)
    step = all_reduce_object(rollback.newest, survivors, MPI.MIN)
    holds = any(c.step == step for c in rollback.kept)
    if not fault_tolerance.agree(survivors, holds):
        raise Unrecoverable(f"not every survivor holds step {step}, the newest that all of them "
                            "committed")
    return survivors, lost, step
