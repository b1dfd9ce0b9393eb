"""Loading a checkpoint's contents back into a model, an optimizer and the user's extras."""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from . import format as fmt
from .optimizers import Checkpointable, adapter_for
from .reader import Reader


def model_state(reader: Reader, model: torch.nn.Module) -> None:
    """Load every parameter and buffer; the names and shapes must match the model's."""
    expected = model.state_dict()
    saved = set(reader.names("model"))
    missing = [k for k in expected if k not in saved]
    unexpected = sorted(saved - set(expected))
    if missing or unexpected:
        raise fmt.CheckpointError(
            f"{reader.path}: the model does not match the checkpoint: "
            + (f"missing from the file: {missing[:5]}" if missing else "")
            + ("; " if missing and unexpected else "")
            + (f"not in the model: {unexpected[:5]}" if unexpected else ""))
    for key, tensor in expected.items():
        shape = tuple(reader.shape(fmt.model_name(key)))
        if shape != tuple(tensor.shape):
            raise fmt.CheckpointError(f"{reader.path}: model entry {key!r} has shape {shape} in "
                                      f"the file, {tuple(tensor.shape)} in the model")
    loaded = {key: reader.tensor(fmt.model_name(key)) for key in expected}
    model.load_state_dict(loaded)


def optimizer_state(reader: Reader, optimizer: Checkpointable, rank: int) -> None:
    """Load the part of the optimizer state (and further optimizer datasets) this rank needs."""
    adapter = adapter_for(optimizer)
    saved_class = reader.attribute("optimizer", "class")
    if saved_class is None:
        raise fmt.CheckpointError(f"{reader.path}: the checkpoint holds no optimizer state")
    if saved_class != adapter.optimizer_class:
        raise fmt.CheckpointError(f"{reader.path}: the checkpoint holds {saved_class} state, "
                                  f"the optimizer is {adapter.optimizer_class}")
    param_groups = reader.decoded("optimizer", "param_groups")
    indices = adapter.indices_to_read(rank)
    if indices is None:
        indices = sorted(int(i) for i in reader.names("optimizer/state"))
    state: Dict[int, Dict[str, Any]] = {}
    for index in indices:
        node = f"optimizer/state/{index}"
        if not reader.has(node):
            continue
        entry = dict(reader.decoded(node, default={}))
        for key in reader.names(node):
            entry[key] = reader.tensor(fmt.state_name(index, key))
        state[index] = entry
    tensors = {name: reader.tensor(name) for name in adapter.tensors_to_read(rank)
               if reader.has(name)}
    adapter.load(state, param_groups, reader.decoded("optimizer", "attributes", default={}),
                 tensors)


def extra_values(reader: Reader, rank: int) -> Dict[str, Any]:
    """The extras saved by this rank, or by rank 0 when the file was saved on fewer ranks."""
    group = fmt.extra_group(rank)
    if not reader.has(group):
        group = fmt.extra_group(0)
    extra = dict(reader.decoded(group, default={}))
    for key in reader.names(group):
        extra[key] = reader.tensor(f"{group}/{key}")
    return extra


def load_into(reader: Reader, rank: int, model: Optional[torch.nn.Module],
              optimizer: Optional[Checkpointable]) -> Dict[str, Any]:
    model = fmt.unwrap_model(model)
    if model is not None:
        model_state(reader, model)
    if optimizer is not None:
        optimizer_state(reader, optimizer, rank)
    return extra_values(reader, rank)
