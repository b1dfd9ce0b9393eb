"""How the ranks train together: the model wrapper and optimizer for each ``--optimizer``.

- ``zero``: our DistributedDataParallel averages gradients; ZeroRedundancyOptimizer shards the
  optimizer state.
- ``postlocal``: DistributedDataParallel with the post-local SGD hook (global gradient
  averaging during the warm-up, then within the node) and PostLocalSGDOptimizer with a
  PeriodicModelAverager (parameters averaged every ``average_period`` steps).
- ``ddp``: DistributedDataParallel and a plain optimizer.
- ``local``: a plain model and optimizer; gradients averaged by one coalesced allreduce.
- ``fsdp``: PyTorch's FSDP2 (``fully_shard``, each block and the whole model) on a 1-D mesh of
  every rank over our ``mpi4py`` torch.distributed backend (ZeRO-3: parameters, gradients and
  optimizer state sharded), and a plain optimizer over the sharded parameters.
- ``hsdp``: the same on a 2-D (replicate, shard) mesh: a replica per node, sharded within it
  (see :mod:`.mesh`).
- ``diloco``: a plain model on each rank, trained by the inner optimizer on the rank's own
  batches; DiLoCoOptimizer averages the models' changes every ``sync_every`` steps and steps an
  outer Nesterov SGD over them. Between syncs every rank holds a replica of its own, or with
  ``node_local`` every node (its ranks average gradients at every step).

``--comm-hook`` gives the DistributedDataParallel of ``zero`` and ``ddp`` another way to average
gradients: 16-bit compression, PowerSGD (its error feedback and factors travel in checkpoints,
so a resume continues exactly) or the hierarchical allreduce.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Type

import torch
from tensorplay_hpc.comm.mpi import MPI
from torch import nn

from tensorplay_hpc import comm
from tensorplay_hpc.comm import trace
from tensorplay_hpc.comm.communicators import free, split_by_node
from tensorplay_hpc.distributed.algorithms.ddp_comm_hooks.default_hooks import (
    bf16_compress_hook, fp16_compress_hook)
from tensorplay_hpc.distributed.algorithms.ddp_comm_hooks.hierarchical_hook import (
    HierarchicalState, hierarchical_allreduce_hook)
from tensorplay_hpc.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
    PostLocalSGDState, post_localSGD_hook)
from tensorplay_hpc.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    PowerSGDState, powerSGD_hook)
from tensorplay_hpc.distributed.algorithms.model_averaging import averagers
from tensorplay_hpc.distributed.optim import (DiLoCoOptimizer, PostLocalSGDOptimizer,
                                              ZeroRedundancyOptimizer)
from tensorplay_hpc.distributed.parallel import DistributedDataParallel

from .config import TrainConfig
from .mesh import TorchDistributed

__all__ = ["INNER", "POWER_SGD_PREFIX", "Strategy", "build", "inner_defaults"]

INNER: Dict[str, Type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def inner_defaults(config: TrainConfig) -> dict:
    """Hyperparameters of the local optimizer (SGD gets momentum 0.9)."""
    return {"lr": config.lr, **({"momentum": 0.9} if config.inner == "sgd" else {})}


@dataclass
class Strategy:
    """A model to run forward and backward on, the optimizer to step, and what to do between.

    Attributes:
        module: the plain model (what checkpoints hold; its parameters are DTensors for
            ``fsdp`` and ``hsdp``).
        model: what the training step calls (``module`` or its DistributedDataParallel wrapper).
        optimizer: the optimizer to step (collective for every kind but a plain one).
        after_backward: runs after ``backward()`` (the ``local`` kind averages gradients here).
        owned: what holds library communicators, closed by :meth:`close`.
        ranks: the communicator of the ranks that train together (set by :func:`build`).
    """

    module: nn.Module
    model: nn.Module
    optimizer: torch.optim.Optimizer
    after_backward: Callable[[], None]
    owned: List[comm.Closeable] = field(default_factory=list)
    _hook_state: Optional[PostLocalSGDState] = None
    _power_sgd: Optional[PowerSGDState] = None
    _replicas: Optional[comm.ProcessGroup] = None
    _diloco: Optional[DiLoCoOptimizer] = None
    ranks: Optional[MPI.Intracomm] = None

    def close(self) -> None:
        """Free the communicators of the model wrapper, the optimizer and the hook. Collective."""
        for owner in self.owned:
            owner.close()

    def hook_extra(self) -> Dict[str, Any]:
        """What the communication hook needs in this rank's checkpoint extras to resume
        exactly: PowerSGD's state, under keys starting with :data:`POWER_SGD_PREFIX`."""
        if self._power_sgd is None:
            return {}
        return self._power_sgd.state_dict(prefix=POWER_SGD_PREFIX)

    def resumed_at(self, step: int, extra: Dict[str, Any]) -> None:
        """Bring the hooks' state to ``step``: the post-local hook's warm-up counter, and
        PowerSGD's state from ``extra`` when the checkpoint has it (else it warms up again)."""
        if self._hook_state is not None:
            self._hook_state.iter = min(step, self._hook_state.start_localSGD_iter)
        if self._power_sgd is not None and any(k.startswith(POWER_SGD_PREFIX) for k in extra):
            self._power_sgd.load_state_dict(extra, prefix=POWER_SGD_PREFIX)

    def apply_hyperparameters(self, config: TrainConfig) -> None:
        """Set the optimizers' hyperparameters to ``config``'s: after a resume, loading the
        optimizer state brought back the checkpoint's (the inner learning rate, and DiLoCo's
        outer learning rate and momentum)."""
        for group in self.optimizer.param_groups:
            group.update(inner_defaults(config))
        if self._diloco is not None:
            for group in self._diloco.outer_optimizer.param_groups:
                group.update(_outer_defaults(config))

    @property
    def replica_group(self) -> Optional[MPI.Intracomm]:
        """The ranks whose parameters and optimizer state equal this rank's at every step:
        post-local SGD's subgroup (the node), since between averagings the nodes' replicas
        differ; for ``diloco``, whose replicas train apart between syncs, this rank alone, or
        its node with ``node_local``; ``None`` (all ranks) for the other kinds. Checkpoints
        save one copy per group."""
        if self._replicas is not None:
            return self._replicas.comm
        state = self._hook_state
        return None if state is None else state.subgroup


POWER_SGD_PREFIX = "powerSGD."


def _gradients_already_averaged() -> None:
    """DistributedDataParallel averaged the gradients during ``backward()``."""


def _outer_defaults(config: TrainConfig) -> dict:
    """Hyperparameters of DiLoCo's outer SGD (Nesterov unless the momentum is 0)."""
    return {"lr": config.outer_lr, "momentum": config.outer_momentum,
            "nesterov": config.outer_momentum > 0}


def _gradients_stay_local() -> None:
    """Each rank steps on its own gradients (``node_local``: the optimizer averages them within
    the node); the optimizer syncs the replicas now and then."""


def _diloco(module: nn.Module, config: TrainConfig, group: comm.ProcessGroup) -> Strategy:
    """``diloco``: the inner optimizer and an outer SGD with Nesterov momentum, both over the
    model's parameters, in a DiLoCoOptimizer. Collective over ``group``."""
    inner = INNER[config.inner](module.parameters(), **inner_defaults(config))
    outer = torch.optim.SGD(module.parameters(), **_outer_defaults(config))
    delta_dtype = None if config.delta_dtype == "float32" else getattr(torch, config.delta_dtype)
    optimizer = DiLoCoOptimizer(inner, outer, config.sync_every, process_group=group.parent,
                                fragments=config.fragments, delta_dtype=delta_dtype,
                                overlap_steps=config.overlap_steps, node_local=config.node_local)
    owner = "the training run's diloco replicas"
    if config.node_local:
        node = split_by_node(group.comm)
        try:
            replicas = comm.ProcessGroup(node, owner=owner)
        finally:
            free(node)
    else:
        replicas = comm.ProcessGroup(MPI.COMM_SELF, owner=owner)
    return Strategy(module, module, optimizer, _gradients_stay_local, [optimizer, replicas],
                    _replicas=replicas, _diloco=optimizer)


def _register_comm_hook(model: DistributedDataParallel, config: TrainConfig,
                        group: comm.ProcessGroup) -> Optional[Any]:
    """Register ``--comm-hook`` on ``model``; return the hook's state if it has one.
    Collective."""
    kind = config.comm_hook
    if kind in ("fp16", "bf16"):
        model.register_comm_hook(group.parent, fp16_compress_hook if kind == "fp16"
                                 else bf16_compress_hook)
        return None
    if kind == "hierarchical":
        state = HierarchicalState(group.parent)
        model.register_comm_hook(state, hierarchical_allreduce_hook)
        return state
    if kind == "powersgd":
        state = PowerSGDState(group.parent, matrix_approximation_rank=config.powersgd_rank,
                              start_powerSGD_iter=max(2, config.warmup_steps),
                              random_seed=config.seed)
        model.register_comm_hook(state, powerSGD_hook)
        return state
    return None


def _fully_sharded(module: nn.Module, config: TrainConfig, group: comm.ProcessGroup) -> Strategy:
    """``fsdp`` and ``hsdp``: FSDP2 on the mesh of :class:`TorchDistributed`, which the
    strategy owns (it ends torch.distributed when closed). Collective over every rank."""
    from torch.distributed.fsdp import fully_shard
    # The logits are a view (nn.Linear on a batch of sequences), which FSDP2 warns about in
    # case the caller changes them in place; the loss only reads them.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    device_type = next(module.parameters()).device.type
    torch_distributed = TorchDistributed(config.optimizer, device_type, group.parent)
    if group.rank == 0:
        print(torch_distributed.description, flush=True)
    for block in module.blocks:
        fully_shard(block, mesh=torch_distributed.mesh)
    fully_shard(module, mesh=torch_distributed.mesh)
    optimizer = INNER[config.inner](module.parameters(), **inner_defaults(config))
    return Strategy(module, module, optimizer, _gradients_already_averaged, [torch_distributed])


def build(module: nn.Module, config: TrainConfig, group: comm.ProcessGroup) -> Strategy:
    """Wrap ``module`` and make the optimizer for ``config.optimizer``. Collective over
    ``group``."""
    strategy = _build_kind(module, config, group)
    strategy.ranks = group.parent
    return strategy


def _build_kind(module: nn.Module, config: TrainConfig, group: comm.ProcessGroup) -> Strategy:
    inner, defaults = INNER[config.inner], inner_defaults(config)
    if config.optimizer in ("fsdp", "hsdp"):
        return _fully_sharded(module, config, group)
    if config.optimizer == "diloco":
        return _diloco(module, config, group)
    if config.optimizer == "local":
        comm.broadcast_coalesced([p.detach() for p in module.parameters()], group.comm, root=0)
        params = [p for p in module.parameters() if p.requires_grad]

        def average_gradients() -> None:
            with trace.caller("gradient averaging"):
                comm.all_reduce_coalesced([p.grad for p in params], group.comm,
                                          comm.ReduceOp.AVG)
        return Strategy(module, module, inner(params, **defaults), average_gradients)
    model = DistributedDataParallel(module, process_group=group.parent)
    if config.optimizer in ("zero", "ddp"):
        hook_state = _register_comm_hook(model, config, group)
        owned: List[comm.Closeable] = [model]
        if config.optimizer == "zero":
            optimizer = ZeroRedundancyOptimizer(module.parameters(), optimizer_class=inner,
                                                process_group=group.parent, **defaults)
            owned.append(optimizer)
        else:
            optimizer = inner(module.parameters(), **defaults)
        if isinstance(hook_state, comm.Closeable):
            owned.append(hook_state)
        power_sgd = hook_state if isinstance(hook_state, PowerSGDState) else None
        return Strategy(module, model, optimizer, _gradients_already_averaged, owned,
                        _power_sgd=power_sgd)
    state = PostLocalSGDState(process_group=group.parent, subgroup=None,
                              start_localSGD_iter=config.warmup_steps)
    model.register_comm_hook(state, post_localSGD_hook)
    averager = averagers.PeriodicModelAverager(period=config.average_period,
                                               warmup_steps=config.warmup_steps,
                                               process_group=group.parent)
    optimizer = PostLocalSGDOptimizer(inner(module.parameters(), **defaults), averager)
    return Strategy(module, model, optimizer, _gradients_already_averaged,
                    [model, averager, state], _hook_state=state)

