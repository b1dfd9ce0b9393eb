"""What one rank contributes to a checkpoint: the datasets it writes and the attributes it sets."""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from tensorplay_hpc.comm.agreement import fail_together
from tensorplay_hpc.comm.mpi import MPI

from . import format as fmt
from . import sharded_tensors, values
from .optimizers import Checkpointable, adapter_for, assign_writers
from .replicas import Replicas

__all__ = ["Snapshot", "add_extra", "add_metadata", "add_model", "add_optimizer", "collect",
           "take"]


@dataclass
class Snapshot:
    """``datasets``: (name, tensor) pairs this rank writes; ``attributes``: {path: {name: value}}
    this rank sets (each path is set by one rank only)."""

    datasets: List[Tuple[str, torch.Tensor]] = field(default_factory=list)
    attributes: Dict[str, Dict[str, Any]] = field(default_factory=dict)

    def set(self, path: str, **attrs: Any) -> None:
        self.attributes.setdefault(path, {}).update(attrs)


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("tensorplay-hpc")
    except PackageNotFoundError:
        return "unknown"


def _step_of(extra: Optional[Dict[str, Any]], attrs: Dict[str, Any]) -> int:
    for value in ((extra or {}).get("step"), attrs.get("averager_step")):
        if isinstance(value, (int, np.integer)):
            return int(value)
    return -1


def _share(sizes: Sequence[int], writers: Sequence[int]) -> List[int]:
    """The writer (a rank of ``writers``) of each item, splitting the bytes evenly."""
    return [writers[w] for w in assign_writers(sizes, len(writers))]


def add_model(snap: Snapshot, entries: Dict[str, torch.Tensor], rank: int,
              writers: Sequence[int], class_name: str, prefix: str = "") -> None:
    """Model entries are replicated: the ranks of ``writers`` (those holding this copy) split
    the writing by bytes. DTensor entries (a sharded model) are gathered whole for their writer,
    one at a time: collective over their meshes."""
    items = list(entries.items())
    owners = _share([t.numel() * t.element_size() for _, t in items], writers)
    snap.datasets += [(fmt.model_name(k, prefix), t)
                      for k, t in sharded_tensors.writers_share(items, owners, rank)]
    if rank == 0:
        snap.set("model", **{"class": class_name, "entries": len(items)})


def add_optimizer(snap: Snapshot, state: Dict[int, Dict[str, Any]], rank: int, kind: str,
                  optimizer_class: str, param_groups: List[dict], attributes: Dict[str, Any],
                  prefix: str = "") -> None:
    """``state``: the state this rank writes, by global index, under ``prefix``; the rest is
    rank 0's to say."""
    for index, entry in sorted(state.items()):
        plain = {}
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                snap.datasets.append((fmt.state_name(index, str(key), prefix), value))
            else:
                plain[str(key)] = value
        if plain or not entry:      # an empty entry is still recorded
            snap.set(fmt.state_node(index, prefix), values=values.dumps(plain))
    if rank == 0:
        snap.set("optimizer", **{"class": optimizer_class, "kind": kind,
                                 "param_groups": values.dumps(param_groups),
                                 "attributes": values.dumps(attributes)})


def add_extra(snap: Snapshot, extra: Optional[Dict[str, Any]], rank: int) -> None:
    """This rank's extras: tensors and arrays as datasets, the rest as JSON values. A key must
    be a non-empty string without ``/`` (which would nest HDF5 groups that a load cannot read)."""
    group = fmt.extra_group(rank)
    plain = {}
    for key, value in (extra or {}).items():
        if not isinstance(key, str) or not key or "/" in key:
            raise ValueError(f"extra key {key!r}: keys must be non-empty strings without '/'")
        if isinstance(value, np.ndarray):
            value = torch.from_numpy(value)
        if isinstance(value, torch.Tensor):
            snap.datasets.append((f"{group}/{key}", value))
        else:
            plain[key] = value
    snap.set(group, values=values.dumps(plain))


def add_metadata(snap: Snapshot, rank: int, size: int, step: int,
                 replicas: Optional[List[List[int]]] = None) -> None:
    if rank == 0:
        snap.set("", format=fmt.FORMAT, format_version=fmt.FORMAT_VERSION,
                 package_version=_package_version(), torch_version=str(torch.__version__),
                 world_size=size, step=step,
                 replicas=values.dumps(replicas or [list(range(size))]),
                 created=datetime.datetime.now(datetime.timezone.utc).isoformat())


def take(rank: int, replicas: Replicas, model: Optional[torch.nn.Module] = None,
         optimizer: Optional[Checkpointable] = None,
         extra: Optional[Dict[str, Any]] = None) -> Snapshot:
    """This rank's share of the checkpoint of ``model``, ``optimizer`` and ``extra``.

    Model entries are replicated, so the ranks of each replica split the writing of their copy
    by bytes; a replicated optimizer state likewise; sharded optimizer state (and the parameter
    values of a DistributedOptimizer) follows the optimizer's own ownership; ``extra`` is saved
    per rank.
    """
    snap = Snapshot()
    size = sum(len(group) for group in replicas.groups)
    model = fmt.unwrap_model(model)
    if model is not None:
        add_model(snap, model.state_dict(), rank, replicas.members, type(model).__qualname__,
                  replicas.prefix())
    attributes: Dict[str, Any] = {}
    if optimizer is not None:
        adapter = adapter_for(optimizer)
        attributes = adapter.attributes()
        add_optimizer(snap, adapter.state_to_write(rank, replicas.members), rank, adapter.kind,
                      adapter.optimizer_class, adapter.param_groups(), attributes,
                      replicas.prefix() if adapter.replicated else "")
        snap.datasets += adapter.tensors_to_write(rank).items()
    add_extra(snap, extra, rank)
    add_metadata(snap, rank, size, _step_of(extra, attributes), replicas.describe())
    return snap


def collect(comm: MPI.Intracomm, path: str, model: Optional[torch.nn.Module],
            optimizer: Optional[Checkpointable], extra: Optional[Dict[str, Any]],
            replica_group: Optional[MPI.Intracomm] = None,
            copy: Optional[Callable[[List[Tuple[str, torch.Tensor]]],
                                    List[Tuple[str, torch.Tensor]]]] = None) -> Snapshot:
    """:func:`take` on every rank of ``comm`` (``replica_group`` as ``save`` takes it), its
    tensors passed through ``copy`` if given. Collective.

    Raises:
        CheckpointError: on every rank, if any rank failed.
    """
    snap = Snapshot()
    with fail_together(comm, f"saving checkpoint {os.path.abspath(path)}", fmt.CheckpointError):
        snap = take(comm.Get_rank(), Replicas(comm, replica_group), model, optimizer, extra)
        if copy is not None:
            snap.datasets = copy(snap.datasets)
    return snap
