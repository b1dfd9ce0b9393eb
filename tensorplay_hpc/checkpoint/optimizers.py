"""How each kind of optimizer's state maps to the checkpoint's consolidated layout.

Whatever the optimizer, the file holds PyTorch's consolidated structure: state by global
parameter index (the numbering of ``torch.optim.Optimizer.state_dict``) and param_groups. An
adapter says which part of it this rank writes, which part it must read back, and how to load it,
plus any further datasets under ``/optimizer`` its kind needs.

- a plain ``torch.optim`` optimizer is replicated: the ranks of each replica share the writing
  of its copy, and the reading (each dataset read by one rank and broadcast);
- a :class:`ShardedOptimizer` (``ZeroRedundancyOptimizer``, ``DistributedOptimizer``): each
  rank writes and reads the state of the parameters it owns, through the optimizer's
  ``owned_indices``, ``owned_state``, ``indexed_param_groups`` and its load of that state;
- ``PostLocalSGDOptimizer``: its inner optimizer, plus the averager's step counter;
- ``DiLoCoOptimizer``: its inner optimizer, plus the outer optimizer, the global copy, the
  schedule and the syncs in flight (see :class:`DiLoCoAdapter`);
- ``DistributedOptimizer``: also the values of the parameters each owner holds (they live in
  its window memory, not in a model).
"""
from __future__ import annotations

from itertools import zip_longest
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Protocol, Sequence, Union

import torch

from .format import CheckpointError, dtype_name
from .nested_state import flatten, rebuild

if TYPE_CHECKING:
    from tensorplay_hpc.distributed.optim import DistributedOptimizer

__all__ = ["Checkpointable", "DiLoCoAdapter", "DistributedOptimizerAdapter", "OptimizerAdapter",
           "PostLocalSGDAdapter", "ShardedAdapter", "ShardedOptimizer", "State", "WrapperAdapter",
           "ZeroAdapter", "adapter_for", "assign_writers", "class_name", "parameter_name"]

State = Dict[int, Dict[str, Any]]
Checkpointable = Union[torch.optim.Optimizer, "DistributedOptimizer"]
"""What ``checkpoint.save`` and ``load`` take as ``optimizer``."""


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
    replicated = True
    """Whether every rank of a replica holds the whole state (else each rank holds its own)."""

    def __init__(self, optimizer: Checkpointable) -> None:
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

    def state_to_write(self, rank: int, writers: Sequence[int]) -> State:
        """This rank's share of the consolidated state; replicated state is split by bytes
        between ``writers``, the ranks holding the same copy."""
        state = self.optimizer.state_dict()["state"]
        indices = sorted(state)
        shares = assign_writers([_state_bytes(state[i]) for i in indices], len(writers))
        return {i: state[i] for i, w in zip(indices, shares) if writers[w] == rank}

    def indices_to_read(self, rank: int) -> Optional[List[int]]:
        """The global indices whose state this rank needs; ``None`` for all of them."""
        return None

    def tensors_to_write(self, rank: int) -> Dict[str, torch.Tensor]:
        """Further datasets (by path in the file, under ``optimizer/``) this rank writes."""
        return {}

    def tensors_to_read(self, rank: int) -> List[str]:
        """The further datasets this rank needs; those missing from the file are left out."""
        return []

    def folders_to_read(self, rank: int) -> List[str]:
        """Folders of the file all of whose datasets this rank needs (absent ones: none)."""
        return []

    def load(self, state: State, param_groups: List[Dict[str, Any]], attributes: Dict[str, Any],
             tensors: Dict[str, torch.Tensor]) -> None:
        """Load ``state`` (this rank's :meth:`indices_to_read`) and ``tensors`` (those of
        :meth:`tensors_to_read` in the file)."""
        self.optimizer.load_state_dict({"state": state, "param_groups": param_groups})


class ShardedOptimizer(Protocol):
    """What a checkpoint needs of an optimizer whose state is split between the ranks (each
    parameter's state held by one rank): ``ZeroRedundancyOptimizer`` and
    ``DistributedOptimizer`` implement it. Indices are global (``state_dict``'s numbering)."""

    def owned_indices(self) -> List[int]:
        """The parameters whose state this rank holds."""

    def owned_state(self) -> State:
        """Their state (parameters not stepped yet have none), in dicts the caller may keep."""

    def indexed_param_groups(self) -> List[Dict[str, Any]]:
        """The param groups: hyperparameters, and ``params`` as global indices."""


class ShardedAdapter(OptimizerAdapter):
    """A :class:`ShardedOptimizer`: each rank writes and reads the state it holds."""

    replicated = False

    def param_groups(self) -> List[Dict[str, Any]]:
        return self.optimizer.indexed_param_groups()

    def state_to_write(self, rank: int, writers: Sequence[int]) -> State:
        return self.optimizer.owned_state()

    def indices_to_read(self, rank: int) -> Optional[List[int]]:
        return self.optimizer.owned_indices()


class ZeroAdapter(ShardedAdapter):
    kind = "zero"

    @property
    def optimizer_class(self) -> str:
        return class_name(type(self.optimizer.optim))

    def load(self, state: State, param_groups: List[Dict[str, Any]], attributes: Dict[str, Any],
             tensors: Dict[str, torch.Tensor]) -> None:
        # The state was read from the file for this optimizer alone: kept, not copied again.
        self.optimizer.load_owned_state(state, param_groups)


class WrapperAdapter(OptimizerAdapter):
    """An optimizer wrapping another (``optimizer.optim``), whose state is saved as that
    optimizer's kind saves it."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer)
        self.inner = adapter_for(optimizer.optim)
        self.replicated = self.inner.replicated

    @property
    def optimizer_class(self) -> str:
        return self.inner.optimizer_class

    def param_groups(self) -> List[Dict[str, Any]]:
        return self.inner.param_groups()

    def attributes(self) -> Dict[str, Any]:
        return self.inner.attributes()

    def state_to_write(self, rank: int, writers: Sequence[int]) -> State:
        return self.inner.state_to_write(rank, writers)

    def indices_to_read(self, rank: int) -> Optional[List[int]]:
        return self.inner.indices_to_read(rank)

    def tensors_to_write(self, rank: int) -> Dict[str, torch.Tensor]:
        return self.inner.tensors_to_write(rank)

    def tensors_to_read(self, rank: int) -> List[str]:
        return self.inner.tensors_to_read(rank)

    def load(self, state: State, param_groups: List[Dict[str, Any]], attributes: Dict[str, Any],
             tensors: Dict[str, torch.Tensor]) -> None:
        self.inner.load(state, param_groups, attributes, tensors)


class PostLocalSGDAdapter(WrapperAdapter):
    """A ``PostLocalSGDOptimizer``: its inner optimizer and the averager's step counter."""

    kind = "post_local_sgd"

    def attributes(self) -> Dict[str, Any]:
        return {**super().attributes(), "averager_step": int(self.optimizer.averager.step)}

    def load(self, state: State, param_groups: List[Dict[str, Any]], attributes: Dict[str, Any],
             tensors: Dict[str, torch.Tensor]) -> None:
        super().load(state, param_groups, attributes, tensors)
        self.optimizer.averager.step = int(attributes.get("averager_step", 0))


class DiLoCoAdapter(WrapperAdapter):
    """A ``DiLoCoOptimizer``: its inner optimizer as that kind is saved (the ranks' replicas
    differ between syncs, so save with each rank a replica of its own), and the rest of its
    ``state_dict()`` under ``optimizer/diloco``: the part every rank holds alike (outer
    optimizer, global copy, step count, schedule, the syncs in flight's averages) written once,
    by rank 0, in ``shared``; each rank's fragments as they were when its syncs in flight
    started in ``rank<r>``. A file saved with syncs in flight loads only at its world size."""

    kind = "diloco"
    FOLDER = "optimizer/diloco"

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer)
        self._parts: Optional[Dict[str, Any]] = None

    def _split(self) -> Dict[str, Any]:
        """The state to save, taken once: skeletons and tensors of the shared and own parts."""
        if self._parts is None:
            state = self.optimizer.state_dict()
            del state["inner"]
            own = [sync.pop("local") for sync in state["in_flight"]]
            (shared, shared_tensors), (mine, own_tensors) = flatten(state), flatten(own)
            self._parts = {"shared": shared, "own": mine, "shared_tensors": shared_tensors,
                           "own_tensors": own_tensors}
        return self._parts

    def attributes(self) -> Dict[str, Any]:
        parts = self._split()
        return {**super().attributes(), "diloco": parts["shared"], "diloco_own": parts["own"],
                "diloco_ranks": self.optimizer.world_size}

    def tensors_to_write(self, rank: int) -> Dict[str, torch.Tensor]:
        parts, written = self._split(), dict(super().tensors_to_write(rank))
        if rank == 0:
            written.update((f"{self.FOLDER}/shared/{k}", t)
                           for k, t in parts["shared_tensors"].items())
        written.update((f"{self.FOLDER}/rank{rank}/{k}", t) for k, t in parts["own_tensors"].items())
        return written

    def folders_to_read(self, rank: int) -> List[str]:
        return [f"{self.FOLDER}/shared", f"{self.FOLDER}/rank{rank}"]

    def load(self, state: State, param_groups: List[Dict[str, Any]], attributes: Dict[str, Any],
             tensors: Dict[str, torch.Tensor]) -> None:
        """The inner optimizer's state, then the rest. Collective (``load_state_dict``)."""
        if "diloco" not in attributes:
            raise CheckpointError("the checkpoint holds no DiLoCoOptimizer state (it was saved "
                                  "from another kind of optimizer)")
        super().load(state, param_groups, attributes, tensors)
        shared = rebuild(attributes["diloco"], _under(tensors, f"{self.FOLDER}/shared/"))
        own_tensors = _under(tensors, f"{self.FOLDER}/rank{self.optimizer.rank}/")
        if shared["in_flight"] and attributes["diloco_ranks"] != self.optimizer.world_size:
            raise CheckpointError(
                f"the checkpoint was saved on {attributes['diloco_ranks']} ranks with a DiLoCo "
                f"sync in flight, which only the same ranks can finish; this job has "
                f"{self.optimizer.world_size} (load at another world size from a checkpoint "
                "taken at a sync boundary)")
        for sync, local in zip(shared["in_flight"], rebuild(attributes["diloco_own"], own_tensors)):
            sync["local"] = local
        self.optimizer.load_state_dict({**shared, "inner": self.optimizer.optim.state_dict()})


def _under(tensors: Dict[str, torch.Tensor], prefix: str) -> Dict[str, torch.Tensor]:
    """The tensors whose names start with ``prefix``, by the rest of the name."""
    return {name[len(prefix):]: t for name, t in tensors.items() if name.startswith(prefix)}


def parameter_name(index: int) -> str:
    """The dataset holding the value of a DistributedOptimizer's parameter ``index`` (global)."""
    return f"optimizer/parameters/{index}"


class DistributedOptimizerAdapter(ShardedAdapter):
    """A ``DistributedOptimizer``: global index = position in its sorted ``(owner, index)`` keys.

    Each owner writes and reads back the values and state of the parameters it owns, straight
    from and into its window memory. The ``parameters`` attribute lists every parameter's
    ``[owner, index, shape, dtype]``; loading needs the same list.
    """

    kind = "distributed"

    @property
    def optimizer_class(self) -> str:
        return class_name(self.optimizer.optimizer_class)

    def attributes(self) -> Dict[str, Any]:
        return {"parameters": self._structure()}

    def _structure(self) -> List[list]:
        return [[ref.owner(), ref.index, list(ref.shape), dtype_name(ref.dtype)]
                for ref in self.optimizer.parameter_refs]

    def tensors_to_write(self, rank: int) -> Dict[str, torch.Tensor]:
        return {parameter_name(i): value
                for i, value in self.optimizer.owned_parameters().items()}

    def tensors_to_read(self, rank: int) -> List[str]:
        return [parameter_name(i) for i in self.optimizer.owned_indices()]

    def load(self, state: State, param_groups: List[Dict[str, Any]], attributes: Dict[str, Any],
             tensors: Dict[str, torch.Tensor]) -> None:
        """The values and state of this rank's parameters; the hyperparameters stay those of
        construction (a DistributedOptimizer has no param_groups to change)."""
        self._check_structure(attributes.get("parameters"))
        parameters = {}
        for index in self.optimizer.owned_indices():
            if parameter_name(index) not in tensors:
                raise CheckpointError(f"the checkpoint lacks the value of parameter {index}")
            parameters[index] = tensors[parameter_name(index)]
        self.optimizer.load_owned(parameters, state)

    def _check_structure(self, saved: Optional[List[list]]) -> None:
        """Raise CheckpointError, naming the first differing parameter, unless the checkpoint
        was saved from a DistributedOptimizer over the same parameters."""
        if saved is None:
            raise CheckpointError("the checkpoint holds no DistributedOptimizer parameters (it "
                                  "was saved from another kind of optimizer)")
        ours = self._structure()
        for index, (in_file, here) in enumerate(zip_longest(saved, ours)):
            if in_file != here:
                raise CheckpointError(
                    f"the DistributedOptimizer's parameters do not match the checkpoint's "
                    f"({len(saved)} in the file, {len(ours)} here): parameter {index} is "
                    f"{_describe_parameter(in_file)} in the file, {_describe_parameter(here)} "
                    "here")


def _describe_parameter(entry: Optional[list]) -> str:
    if entry is None:
        return "absent"
    owner, index, shape, dtype = entry
    return f"tensor {index} of rank {owner} ({dtype}, shape {tuple(shape)})"


def adapter_for(optimizer: Checkpointable) -> OptimizerAdapter:
    """The adapter for ``optimizer``'s kind."""
    from tensorplay_hpc.distributed.optim import (DiLoCoOptimizer, DistributedOptimizer,
                                                  PostLocalSGDOptimizer, ZeroRedundancyOptimizer)
    if isinstance(optimizer, DiLoCoOptimizer):
        return DiLoCoAdapter(optimizer)
    if isinstance(optimizer, DistributedOptimizer):
        return DistributedOptimizerAdapter(optimizer)
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return ZeroAdapter(optimizer)
    if isinstance(optimizer, PostLocalSGDOptimizer):
        return PostLocalSGDAdapter(optimizer)
    if isinstance(optimizer, torch.optim.Optimizer):
        from .sharded_tensors import ShardedTensorAdapter, holds_sharded
        if holds_sharded(optimizer):
            return ShardedTensorAdapter(optimizer)
        return OptimizerAdapter(optimizer)
    raise TypeError(f"cannot checkpoint an optimizer of type {type(optimizer).__name__}: "
                    "expected a torch.optim.Optimizer or one of tensorplay_hpc's optimizers")
