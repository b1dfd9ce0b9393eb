"""Checkpoints of models and optimizers whose tensors are DTensors sharded over a device mesh,
as PyTorch's FSDP2 (``fully_shard``) leaves them.

The file holds every tensor at its full shape, as for an unsharded model and a plain
``torch.optim`` optimizer, so it loads at any world size, sharded or not. Saving gathers one
tensor at a time over its mesh and keeps it only on the rank chosen to write it (the writers
share the bytes as for a replicated model), so no rank holds more than its share of the full
tensors plus the one being gathered. Loading reads the whole values in batches, as for an
unsharded model, and each rank keeps of every value only the rows of its own shard
(:class:`OwnRows`), so no rank holds more than its shard plus one batch of whole values.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Dict, List, Sequence, Tuple

import torch
from torch import nn

from .optimizers import OptimizerAdapter, State

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["OwnRows", "ShardedTensorAdapter", "holds_sharded", "is_sharded", "load_model",
           "local_part", "own_rows", "replicated_elsewhere", "whole_from_rows", "writers_share"]


def is_sharded(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor (its values spread over a device mesh). DTensors exist
    only once their module is imported, so a process without any does not pay for importing
    it here."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def holds_sharded(optimizer: torch.optim.Optimizer) -> bool:
    """Whether any parameter of ``optimizer`` is a DTensor."""
    return any(is_sharded(p) for group in optimizer.param_groups for p in group["params"])


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole value of a DTensor (collective over its mesh); other tensors as they are."""
    return tensor.detach().full_tensor() if is_sharded(tensor) else tensor


def writers_share(entries: Sequence[Tuple[str, torch.Tensor]], writers: Sequence[int],
                  rank: int) -> List[Tuple[str, torch.Tensor]]:
    """The entries that ``rank`` writes (``writers[i]`` writes entry ``i``), DTensors gathered
    whole. Collective over the DTensors' meshes when ``entries`` holds any: every rank gathers
    each of them in turn and keeps only its own."""
    mine = []
    for (name, tensor), writer in zip(entries, writers):
        value = _full(tensor)
        if writer == rank:
            mine.append((name, value))
    return mine


def local_part(full: torch.Tensor, like: "DTensor") -> torch.Tensor:
    """The part of ``full`` (a whole value) that this rank holds of a DTensor laid out as
    ``like``: on each mesh dimension that shards tensor dimension ``d`` into ``n`` pieces, the
    rows of piece ``i`` (this rank's coordinate), split as ``torch.chunk`` splits (pieces of
    ``ceil(size / n)`` rows, the last ones shorter or empty). Local."""
    if tuple(full.shape) != tuple(like.shape):
        raise ValueError(f"a value of shape {tuple(full.shape)} for a sharded tensor of shape "
                         f"{tuple(like.shape)}")
    from torch.distributed.tensor import Shard
    mesh, part = like.device_mesh, full
    coordinate = mesh.get_coordinate()
    for mesh_dim, placement in enumerate(like.placements):
        if isinstance(placement, Shard):
            dim, pieces = placement.dim, mesh.size(mesh_dim)
            rows = -(-part.size(dim) // pieces)
            start = min(coordinate[mesh_dim] * rows, part.size(dim))
            part = part.narrow(dim, start, min(rows, part.size(dim) - start))
    return part


def own_rows(tensor: "DTensor") -> Tuple[int, torch.Tensor]:
    """Where this rank's rows of ``tensor`` start, and the rows (its local tensor, not a copy),
    for a DTensor sharded on its first dimension over one mesh dimension and replicated over
    any others (FSDP2's ``fully_shard``, hybrid sharding's too). Local.

    Raises:
        ValueError: ``tensor`` is laid out otherwise.
    """
    from torch.distributed.tensor import Shard
    first, placements = Shard(0), tensor.placements
    sharded = [d for d, p in enumerate(placements) if p == first]
    if len(sharded) != 1 or not all(p == first or p.is_replicate() for p in placements):
        raise ValueError(f"rows of a DTensor sharded on dimension 0 over one mesh dimension, "
                         f"not {placements}")
    mesh_dim = sharded[0]
    rows = -(-tensor.size(0) // tensor.device_mesh.size(mesh_dim))
    start = min(tensor.device_mesh.get_coordinate()[mesh_dim] * rows, tensor.size(0))
    with torch.no_grad():   # no autograd node: a third of the time
        return start, tensor.to_local().detach()


def replicated_elsewhere(tensor: "DTensor") -> bool:
    """Whether other ranks hold the same rows of ``tensor`` as this rank (it is replicated over
    a mesh dimension of two ranks or more, as hybrid sharding's replicas are). Local."""
    return any(p.is_replicate() and tensor.device_mesh.size(d) > 1
               for d, p in enumerate(tensor.placements))


def whole_from_rows(pieces: Sequence[Tuple[int, torch.Tensor]], length: int) -> torch.Tensor:
    """The whole value of ``length`` rows from ``pieces`` (``(start, rows)`` as
    :func:`own_rows` gives them, in any order, a piece more than once allowed). Local.

    Raises:
        ValueError: rows are missing.
    """
    parts, end = [], 0
    for start, rows in sorted(pieces, key=lambda piece: piece[0]):
        if start < end and start + rows.size(0) <= end:
            continue   # a copy of rows already taken
        if start != end:
            raise ValueError(f"rows {end} to {start} of the whole value are missing")
        parts.append(rows)
        end = start + rows.size(0)
    if end != length:
        raise ValueError(f"rows {end} to {length} of the whole value are missing")
    return torch.cat(parts)


class OwnRows:
    """What a rank keeps of the checkpoint's whole values that fill DTensors: ``targets`` maps a
    dataset name to the DTensor it fills (a parameter, or a parameter whose shape an optimizer
    state entry has); other datasets are kept whole."""

    def __init__(self, targets: Dict[str, "DTensor"]) -> None:
        self.targets = targets

    def __bool__(self) -> bool:
        return bool(self.targets)

    def cut(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """This rank's rows of dataset ``name``'s whole ``value``, in memory of their own (the
        whole value can then be freed); ``value`` itself for other datasets. Local."""
        like = self.targets.get(name)
        if like is None:
            return value
        return local_part(value, like).to(like.dtype).clone()

    def wrap(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """The DTensor laid out as dataset ``name``'s target, holding ``rows`` (what :meth:`cut`
        kept); ``rows`` itself for other datasets. Local."""
        like = self.targets.get(name)
        if like is None:
            return rows
        from torch.distributed.tensor import DTensor
        return DTensor.from_local(rows, like.device_mesh, like.placements, run_check=False,
                                  shape=like.shape, stride=like.stride())


def load_model(model: nn.Module, values: Dict[str, torch.Tensor]) -> None:
    """Load ``values`` (by state_dict name) into ``model``: whole values, except for the
    model's DTensors, whose values are this rank's rows (:meth:`OwnRows.cut`). Local."""
    own = model.state_dict()
    if not any(is_sharded(t) for t in own.values()):
        model.load_state_dict(values)
        return
    with torch.no_grad():
        for name, value in values.items():
            target = own[name]
            (target.to_local() if is_sharded(target) else target).copy_(value)


class ShardedTensorAdapter(OptimizerAdapter):
    """A ``torch.optim`` optimizer over DTensor parameters (FSDP2's): its state, sharded as
    the parameters are, is saved whole in PyTorch's consolidated structure (loadable into a
    plain optimizer) and read back as the parameters' DTensors (see :class:`OwnRows`)."""

    replicated = False

    def state_to_write(self, rank: int, writers: Sequence[int]) -> State:
        """This rank's share of the whole state. Collective over the parameters' meshes."""
        mine = set(super().state_to_write(rank, writers))
        state = self.optimizer.state_dict()["state"]
        written: State = {}
        for index in sorted(state):
            entry = {key: _full(value) if isinstance(value, torch.Tensor) else value
                     for key, value in state[index].items()}
            if index in mine:
                written[index] = entry
        return written
