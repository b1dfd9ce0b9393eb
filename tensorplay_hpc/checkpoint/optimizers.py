"""How each kind of optimizer's state maps to the checkpoint's consolidated layout.

Whatever the optimizer, the file holds PyTorch's consolidated structure: state by global
parameter index (the numbering of ``torch.optim.Optimizer.state_dict``) and param_groups. An
adapter says which part of it this rank writes, which part it must read back, and how to load it.

- a plain ``torch.optim`` optimizer is replicated: the ranks share the writing, every rank
  reads everything;
- ``ZeroRedundancyOptimizer``: each rank writes and reads the state of the parameters it owns;
- ``PostLocalSGDOptimizer``: its inner optimizer, plus the averager's step counter;
- ``DistributedOptimizer``: each owner writes the state of the parameters it holds.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

State = Dict[int, Dict[str, Any]]


def class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def assign_writers(sizes: Sequence[int], ranks: int) -> List[int]:
    """Spread items over ranks so each writes about the same number of bytes: largest first,
    each to the least loaded rank (ties to the lowest). The same on every rank."""
    loads = [0] * ranks
    writers = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        rank = min(range(ranks), key=lambda r: loads[r])
        writers[index] = rank
        loads[rank] += sizes[index]
    return writers


def _state_bytes(values: Dict[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in values.values() if isinstance(v, torch.Tensor))


class OptimizerAdapter:
    """The checkpoint's view of an optimizer. Subclasses fill in the details."""

    kind = "local"

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    @property
    def optimizer_class(self) -> str:
        """The ``torch.optim`` class whose state is saved."""
        return class_name(type(self.optimizer))

    def param_groups(self) -> List[Dict[str, Any]]:
        """param_groups in PyTorch's structure: hyperparameters, ``params`` as global indices."""
        return self.optimizer.state_dict()["param_groups"]

    def attributes(self) -> Dict[str, Any]:
        """Kind-specific values saved on ``/optimizer``."""
        return {}

    def state_to_write(self, rank: int, size: int) -> State:
        """This rank's share of the consolidated state (replicated: split by bytes)."""
        state = self.optimizer.state_dict()["state"]
        indices = sorted(state)
        writers = assign_writers([_state_bytes(state[i]) for i in indices], size)
        return {i: state[i] for i, w in zip(indices, writers) if w == rank}

    def indices_to_read(self, rank: int) -> Optional[List[int]]:
        """The global indices whose state this rank needs; ``None`` for all of them."""
        return None

    def load(self, state: State, param_groups: List[Dict[str, Any]], attributes: Dict[str, Any]) -> None:
        self.optimizer.load_state_dict({"state": state, "param_groups": param_groups})


class ZeroAdapter(OptimizerAdapter):
    kind = "zero"

    @property
    def optimizer_class(self) -> str:
        return class_name(type(self.optimizer.optim))

    def param_groups(self) -> List[Dict[str, Any]]:
        index_of = {id(p): i for i, p in enumerate(self.optimizer.params_by_index)}
        return [{**{k: v for k, v in group.items() if k != "params"},
                 "params": [index_of[id(p)] for p in group["params"]]}
                for group in self.optimizer.param_groups]

    def state_to_write(self, rank: int, size: int) -> State:
        return self.optimizer.local_state_by_index()

    def indices_to_read(self, rank: int) -> Optional[List[int]]:
        return [i for i, owner in enumerate(self.optimizer.partition.rank_of) if owner == rank]


class PostLocalSGDAdapter(OptimizerAdapter):
    kind = "post_local_sgd"

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer)
        self.inner = adapter_for(optimizer.optim)

    @property
    def optimizer_class(self) -> str:
        return self.inner.optimizer_class

    def param_groups(self) -> List[Dict[str, Any]]:
        return self.inner.param_groups()

    def attributes(self) -> Dict[str, Any]:
        return {**self.inner.attributes(), "averager_step": int(self.optimizer.averager.step)}

    def state_to_write(self, rank: int, size: int) -> State:
        return self.inner.state_to_write(rank, size)

    def indices_to_read(self, rank: int) -> Optional[List[int]]:
        return self.inner.indices_to_read(rank)

    def load(self, state: State, param_groups: List[Dict[str, Any]], attributes: Dict[str, Any]) -> None:
        self.inner.load(state, param_groups, attributes)
        self.optimizer.averager.step = int(attributes.get("averager_step", 0))


def adapter_for(optimizer: torch.optim.Optimizer) -> OptimizerAdapter:
    """The adapter for ``optimizer``'s kind."""
    from tensorplay_hpc.distributed.optim import PostLocalSGDOptimizer, ZeroRedundancyOptimizer
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return ZeroAdapter(optimizer)
    if isinstance(optimizer, PostLocalSGDOptimizer):
        return PostLocalSGDAdapter(optimizer)
    if isinstance(optimizer, torch.optim.Optimizer):
        return OptimizerAdapter(optimizer)
    raise TypeError(f"cannot checkpoint an optimizer of type {type(optimizer).__name__}: "
                    "expected a torch.optim.Optimizer or one of tensorplay_hpc's optimizers")
