"""How the ranks train together: the model wrapper and optimizer for each ``--optimizer``.

- ``zero``: our DistributedDataParallel averages gradients; ZeroRedundancyOptimizer shards the
  optimizer state.
- ``postlocal``: DistributedDataParallel with the post-local SGD hook (global gradient
  averaging during the warm-up, then within the node) and PostLocalSGDOptimizer with a
  PeriodicModelAverager (parameters averaged every ``average_period`` steps).
- ``ddp``: DistributedDataParallel and a plain optimizer.
- ``local``: a plain model and optimizer; gradients averaged by one coalesced allreduce.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Type

import torch
from mpi4py import MPI
from torch import nn

from tensorplay_hpc import comm
from tensorplay_hpc.comm import trace
from tensorplay_hpc.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
    PostLocalSGDState, post_localSGD_hook)
from tensorplay_hpc.distributed.algorithms.model_averaging import averagers
from tensorplay_hpc.distributed.optim import PostLocalSGDOptimizer, ZeroRedundancyOptimizer
from tensorplay_hpc.distributed.parallel import DistributedDataParallel

from .config import TrainConfig

INNER: Dict[str, Type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def inner_defaults(config: TrainConfig) -> dict:
    """Hyperparameters of the local optimizer (SGD gets momentum 0.9)."""
    return {"lr": config.lr, **({"momentum": 0.9} if config.inner == "sgd" else {})}


@dataclass
class Strategy:
    """A model to run forward and backward on, the optimizer to step, and what to do between.

    Attributes:
        module: the plain model (what checkpoints hold).
        model: what the training step calls (``module`` or its DistributedDataParallel wrapper).
        optimizer: the optimizer to step (collective for every kind but a plain one).
        after_backward: runs after ``backward()`` (the ``local`` kind averages gradients here).
        owned: what holds library communicators, closed by :meth:`close`.
    """

    module: nn.Module
    model: nn.Module
    optimizer: torch.optim.Optimizer
    after_backward: Callable[[], None]
    owned: List[comm.Closeable] = field(default_factory=list)
    _hook_state: Optional[PostLocalSGDState] = None

    def close(self) -> None:
        """Free the communicators of the model wrapper, the optimizer and the hook. Collective."""
        for owner in self.owned:
            owner.close()

    def resumed_at(self, step: int) -> None:
        """Bring state kept outside the checkpoint (the post-local hook's warm-up counter) to
        ``step``."""
        if self._hook_state is not None:
            self._hook_state.iter = min(step, self._hook_state.start_localSGD_iter)

    @property
    def replica_group(self) -> Optional[MPI.Intracomm]:
        """The ranks whose parameters and optimizer state equal this rank's at every step:
        post-local SGD's subgroup (the node), since between averagings the nodes' replicas
        differ; ``None`` (all ranks) for the other kinds. Checkpoints save one copy per group."""
        state = self._hook_state
        return None if state is None else state.subgroup


def _gradients_already_averaged() -> None:
    """DistributedDataParallel averaged the gradients during ``backward()``."""


def build(module: nn.Module, config: TrainConfig, group: comm.ProcessGroup) -> Strategy:
    """Wrap ``module`` and make the optimizer for ``config.optimizer``. Collective over
    ``group``."""
    inner, defaults = INNER[config.inner], inner_defaults(config)
    if config.optimizer == "local":
        comm.broadcast_coalesced([p.detach() for p in module.parameters()], group.comm, root=0)
        params = [p for p in module.parameters() if p.requires_grad]

        def average_gradients() -> None:
            with trace.caller("gradient averaging"):
                comm.all_reduce_coalesced([p.grad for p in params], group.comm,
                                          comm.ReduceOp.AVG)
        return Strategy(module, module, inner(params, **defaults), average_gradients)
    model = DistributedDataParallel(module, process_group=group.parent)
    if config.optimizer == "zero":
        optimizer = ZeroRedundancyOptimizer(module.parameters(), optimizer_class=inner,
                                            process_group=group.parent, **defaults)
        return Strategy(module, model, optimizer, _gradients_already_averaged, [model, optimizer])
    if config.optimizer == "ddp":
        return Strategy(module, model, inner(module.parameters(), **defaults),
                        _gradients_already_averaged, [model])
    state = PostLocalSGDState(process_group=group.parent, subgroup=None,
                              start_localSGD_iter=config.warmup_steps)
    model.register_comm_hook(state, post_localSGD_hook)
    averager = averagers.PeriodicModelAverager(period=config.average_period,
                                               warmup_steps=config.warmup_steps,
                                               process_group=group.parent)
    optimizer = PostLocalSGDOptimizer(inner(module.parameters(), **defaults), averager)
    return Strategy(module, model, optimizer, _gradients_already_averaged,
                    [model, averager, state], state)

