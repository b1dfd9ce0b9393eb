"""What one rank contributes to a checkpoint: the datasets it writes and the attributes it sets."""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from . import format as fmt
from . import values
from .optimizers import adapter_for, assign_writers


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


def take(rank: int, size: int, model: Optional[torch.nn.Module] = None,
         optimizer: Optional[torch.optim.Optimizer] = None,
         extra: Optional[Dict[str, Any]] = None) -> Snapshot:
    """This rank's share of the checkpoint of ``model``, ``optimizer`` and ``extra``.

    Model entries are replicated, so the ranks split them by bytes; optimizer state follows the
    optimizer's own ownership; ``extra`` is saved per rank.
    """
    snap = Snapshot()
    model = fmt.unwrap_model(model)
    if model is not None:
        entries = list(model.state_dict().items())
        writers = assign_writers([t.numel() * t.element_size() for _, t in entries], size)
        snap.datasets += [(fmt.model_name(k), t) for (k, t), w in zip(entries, writers) if w == rank]
        if rank == 0:
            snap.set("model", **{"class": type(model).__qualname__, "entries": len(entries)})

    optimizer_attrs: Dict[str, Any] = {}
    if optimizer is not None:
        adapter = adapter_for(optimizer)
        optimizer_attrs = adapter.attributes()
        for index, state in sorted(adapter.state_to_write(rank, size).items()):
            plain = {}
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    snap.datasets.append((fmt.state_name(index, str(key)), value))
                else:
                    plain[str(key)] = value
            snap.set(f"optimizer/state/{index}", values=values.dumps(plain))
        if rank == 0:
            snap.set("optimizer", **{"class": adapter.optimizer_class, "kind": adapter.kind,
                                     "param_groups": values.dumps(adapter.param_groups()),
                                     "attributes": values.dumps(optimizer_attrs)})

    group = fmt.extra_group(rank)
    plain = {}
    for key, value in (extra or {}).items():
        if isinstance(value, np.ndarray):
            value = torch.from_numpy(value)
        if isinstance(value, torch.Tensor):
            snap.datasets.append((f"{group}/{key}", value))
        else:
            plain[key] = value
    snap.set(group, values=values.dumps(plain))

    if rank == 0:
        snap.set("", format=fmt.FORMAT, format_version=fmt.FORMAT_VERSION,
                 package_version=_package_version(), torch_version=str(torch.__version__),
                 world_size=size, step=_step_of(extra, optimizer_attrs),
                 created=datetime.datetime.now(datetime.timezone.utc).isoformat())
    return snap
