"""Loading a checkpoint's contents back into a model, an optimizer and the user's extras.

Replicated entries (the model, a plain optimizer's state) are read once and broadcast
(:mod:`.shared_reads`); sharded state and the extras are read only by the rank they belong to.
A file holding several replicas loads each rank's own replica when the replica layout is the
same as at save time, and otherwise the average of the replicas (see ``docs/checkpoints.md``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from tensorplay_hpc.comm.agreement import fail_together
from tensorplay_hpc.comm.communicators import free, split
from tensorplay_hpc.comm.small_collectives import broadcast_object
from tensorplay_hpc.comm.mpi import MPI

from . import format as fmt
from .optimizers import Checkpointable, adapter_for
from .reader import Reader
from .replicas import Replicas
from .shared_reads import read_shared
from .sharded_tensors import OwnRows, is_sharded, load_model

__all__ = ["Plan", "READ_BATCH_BYTES", "check_model", "combine", "load_into", "prefixes",
           "saved_replicas", "state_prefix"]

READ_BATCH_BYTES = 64 * 2**20
"""When a checkpoint fills DTensors (an FSDP2 model or its optimizer), the whole values are read
and shared in batches of about this many bytes, each cut to the rank's own rows before the next."""


def saved_replicas(reader: Reader) -> List[List[int]]:
    """The replica groups at save time (one group of every rank in version 1 files)."""
    saved = reader.decoded("", "replicas")
    if saved is None:
        return [list(range(int(reader.attribute("", "world_size", 1))))]
    return [list(group) for group in saved]


def combine(copies: List[torch.Tensor]) -> torch.Tensor:
    """One value from the replicas' copies of an entry: the mean of floating-point ones (in
    double precision), the first copy of anything else (step counters, integer buffers)."""
    if len(copies) == 1 or not copies[0].is_floating_point():
        return copies[0]
    return torch.stack([c.double() for c in copies]).mean(0).to(copies[0].dtype)


def prefixes(reader: Reader) -> List[str]:
    """The folders of the file's replicas."""
    count = len(saved_replicas(reader))
    return [fmt.replica_prefix(j, count) for j in range(count)]


def state_prefix(reader: Reader, prefix: str) -> str:
    """``prefix`` if the optimizer state lies under the replica folders, else ``""`` (sharded
    state is stored once)."""
    return prefix if reader.has(f"{prefix}optimizer/state") else ""


def check_model(reader: Reader, model: torch.nn.Module, prefix: str) -> List[str]:
    """The model's entry names, once checked against the file's names and shapes."""
    expected = model.state_dict()
    saved = set(reader.names(f"{prefix}model"))
    missing = [k for k in expected if k not in saved]
    unexpected = sorted(saved - set(expected))
    if missing or unexpected:
        raise fmt.CheckpointError(
            f"{reader.path}: the model does not match the checkpoint: "
            + (f"missing from the file: {missing[:5]}" if missing else "")
            + ("; " if missing and unexpected else "")
            + (f"not in the model: {unexpected[:5]}" if unexpected else ""))
    saved_shapes = reader.shapes([fmt.model_name(key, prefix) for key in expected])
    for (key, tensor), shape in zip(expected.items(), saved_shapes):
        if shape != tensor.shape:
            raise fmt.CheckpointError(f"{reader.path}: model entry {key!r} has shape {shape} in "
                                      f"the file, {tuple(tensor.shape)} in the model")
    return list(expected)


@dataclass
class Plan:
    """What this rank reads. ``shared`` entries are read over a communicator and combined from
    the ``sources`` (replica folders); ``own`` ones by this rank alone."""

    sources: List[str]
    model_keys: List[str] = field(default_factory=list)
    shared_state: Dict[int, List[str]] = field(default_factory=dict)   # index -> tensor keys
    own_state: Dict[int, List[str]] = field(default_factory=dict)
    state_prefix: str = ""
    tensors: List[str] = field(default_factory=list)

    def shared_names(self) -> List[str]:
        names = [fmt.model_name(k, p) for p in self.sources for k in self.model_keys]
        for p in self.sources:
            names += [self.shared_state_name(i, k, p) for i, keys in self.shared_state.items()
                      for k in keys]
        return names

    def shared_state_name(self, index: int, key: str, source: str) -> str:
        """The dataset of entry ``key`` of parameter ``index``'s shared state in ``source``."""
        return fmt.state_name(index, key, source if self.state_prefix else "")

    def own_rows(self, reader: Reader, model: Optional[torch.nn.Module],
                 optimizer: Optional[Checkpointable]) -> OwnRows:
        """The shared datasets that fill DTensors of ``model`` or of ``optimizer``'s state
        (entries of a DTensor parameter's shape), and the DTensor each fills."""
        targets = {}
        if model is not None:
            own = model.state_dict()
            targets.update((fmt.model_name(k, p), own[k]) for p in self.sources
                           for k in self.model_keys if is_sharded(own[k]))
        if optimizer is not None and self.shared_state:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            for index, keys in self.shared_state.items():
                param = params[index] if index < len(params) else None
                if not is_sharded(param):
                    continue
                for key in keys:
                    for p in self.sources:
                        name = self.shared_state_name(index, key, p)
                        if tuple(reader.describe(name)[0]) == tuple(param.shape):
                            targets[name] = param
        return OwnRows(targets)


def _plan(reader: Reader, sources: List[str], rank: int, model: Optional[torch.nn.Module],
          optimizer: Optional[Checkpointable]) -> Plan:
    plan = Plan(sources)
    if model is not None:
        plan.model_keys = check_model(reader, model, sources[0])
    if optimizer is None:
        return plan
    adapter = adapter_for(optimizer)
    saved_class = reader.attribute("optimizer", "class")
    if saved_class is None:
        raise fmt.CheckpointError(f"{reader.path}: the checkpoint holds no optimizer state")
    if saved_class != adapter.optimizer_class:
        raise fmt.CheckpointError(f"{reader.path}: the checkpoint holds {saved_class} state, "
                                  f"the optimizer is {adapter.optimizer_class}")
    plan.state_prefix = state_prefix(reader, sources[0])
    indices = adapter.indices_to_read(rank)
    listed = {int(i) for i in reader.names(f"{plan.state_prefix}optimizer/state")}
    target = plan.shared_state if indices is None else plan.own_state
    for index in sorted(listed) if indices is None else indices:
        if index in listed:
            target[index] = reader.names(fmt.state_node(index, plan.state_prefix))
    plan.tensors = [name for name in adapter.tensors_to_read(rank) if reader.has(name)]
    plan.tensors += [f"{folder}/{key}" for folder in adapter.folders_to_read(rank)
                     for key in reader.names(folder)]
    return plan


def _optimizer_values(reader: Reader, plan: Plan) -> Dict[Any, Any]:
    """The optimizer's non-tensor values: param_groups, attributes, each shared state's values."""
    found = {"param_groups": reader.required("optimizer", "param_groups"),
             "attributes": reader.decoded("optimizer", "attributes", default={})}
    for index in plan.shared_state:
        found[index] = reader.decoded(fmt.state_node(index, plan.state_prefix), default={})
    return found


def _extra(reader: Reader, rank: int) -> Dict[str, Any]:
    """The extras saved by this rank, or by rank 0 when the file was saved on fewer ranks."""
    group = fmt.extra_group(rank)
    if not reader.has(group):
        group = fmt.extra_group(0)
    extra = dict(reader.decoded(group, default={}))
    keys = reader.names(group)
    tensors = reader.tensors([f"{group}/{key}" for key in keys])
    extra.update((key, tensors[f"{group}/{key}"]) for key in keys)
    return extra


def load_into(reader: Reader, comm: MPI.Intracomm, replicas: Replicas,
              model: Optional[torch.nn.Module], optimizer: Optional[Checkpointable]) -> Dict[str, Any]:
    """Load ``reader``'s checkpoint into ``model`` and ``optimizer``; return this rank's extras.
    Collective over ``comm``. Nothing is loaded unless every rank read its part.

    Raises:
        CheckpointError: on every rank, naming the problem and the ranks that hit it.
    """
    rank, what = comm.Get_rank(), f"loading checkpoint {reader.path}"
    model = fmt.unwrap_model(model)
    plan, own_layout, rows = None, False, OwnRows({})
    with fail_together(comm, what, fmt.CheckpointError):
        saved = saved_replicas(reader)
        own_layout = len(saved) > 1 and saved == replicas.describe()
        sources = [fmt.replica_prefix(replicas.index, len(saved))] if own_layout else prefixes(reader)
        plan = _plan(reader, sources, rank, model, optimizer)
        rows = plan.own_rows(reader, model, optimizer)

    optimizer_values = {}
    with fail_together(comm, what, fmt.CheckpointError):
        if rank == 0 and optimizer is not None:
            optimizer_values = _optimizer_values(reader, plan)
    optimizer_values = broadcast_object(optimizer_values, comm)
    sharing = split(comm, replicas.index, rank) if own_layout else comm
    try:
        shared = read_shared(reader, plan.shared_names(), sharing, keep=rows.cut,
                             batch_bytes=READ_BATCH_BYTES if rows else None)
    finally:
        if sharing is not comm:
            free(sharing)

    extra = {}
    with fail_together(comm, what, fmt.CheckpointError):
        own = reader.tensors(plan.tensors)
        read = reader.tensors([fmt.state_name(i, k) for i, keys in plan.own_state.items()
                               for k in keys])
        own_state = {i: {k: read[fmt.state_name(i, k)] for k in keys}
                     for i, keys in plan.own_state.items()}
        own_values = {i: reader.decoded(fmt.state_node(i), default={}) for i in plan.own_state}
        extra = _extra(reader, rank)

    with fail_together(comm, what, fmt.CheckpointError):
        if model is not None:
            load_model(model, {k: combine([shared[fmt.model_name(k, p)] for p in plan.sources])
                               for k in plan.model_keys})
        if optimizer is not None:
            state: Dict[int, Dict[str, Any]] = {}
            for index, keys in plan.shared_state.items():
                entry = dict(optimizer_values[index])
                for key in keys:
                    names = [plan.shared_state_name(index, key, p) for p in plan.sources]
                    entry[key] = rows.wrap(names[0], combine([shared[n] for n in names]))
                state[index] = entry
            for index, tensors in own_state.items():
                state[index] = {**own_values[index], **tensors}
            adapter_for(optimizer).load(state, optimizer_values["param_groups"],
                                        optimizer_values["attributes"], own)
    return extra
