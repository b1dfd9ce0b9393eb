"""DiLoCo's state in a training checkpoint.

A checkpoint holds each rank's model and inner optimizer as replicas of their own (the ranks
train apart between syncs). The rest of :meth:`DiLoCoOptimizer.state_dict` (the outer
optimizer, the global copy, the step count, the schedule and any sync in flight) travels in
each rank's extras: its tensors as datasets under keys starting with :data:`PREFIX`, its
structure as one JSON value.
"""
from __future__ import annotations

from typing import Any, Dict

import torch

from tensorplay_hpc.distributed.optim import DiLoCoOptimizer

__all__ = ["PREFIX", "diloco_extra", "load_diloco_extra"]

PREFIX = "diloco."
_STRUCTURE = f"{PREFIX}structure"


def _skeleton(value: Any, tensors: Dict[str, torch.Tensor], name: str) -> Any:
    """``value`` as JSON, its tensors moved into ``tensors`` under names starting with
    ``name`` (dict keys kept with their type: a state dict's are parameter indices)."""
    if isinstance(value, torch.Tensor):
        tensors[name] = value
        return {"tensor": name}
    if isinstance(value, dict):
        return {"dict": [[k, _skeleton(v, tensors, f"{name}.{k}")] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        return {"list": [_skeleton(v, tensors, f"{name}.{i}") for i, v in enumerate(value)]}
    return {"value": value}


def _rebuild(skeleton: Dict[str, Any], extra: Dict[str, Any]) -> Any:
    (kind, content), = skeleton.items()
    if kind == "tensor":
        return extra[content]
    if kind == "dict":
        return {key: _rebuild(value, extra) for key, value in content}
    if kind == "list":
        return [_rebuild(value, extra) for value in content]
    return content


def diloco_extra(optimizer: DiLoCoOptimizer) -> Dict[str, Any]:
    """The optimizer's state but the inner optimizer's, as checkpoint extras. Collective when
    a sync is in flight (see :meth:`DiLoCoOptimizer.state_dict`)."""
    state = optimizer.state_dict()
    del state["inner"]
    tensors: Dict[str, torch.Tensor] = {}
    structure = _skeleton(state, tensors, PREFIX.rstrip("."))
    return {_STRUCTURE: structure, **tensors}


def load_diloco_extra(optimizer: DiLoCoOptimizer, extra: Dict[str, Any]) -> None:
    """Load what :func:`diloco_extra` saved, with the inner optimizer's state as it is now (the
    checkpoint loaded it). Collective.

    Raises:
        KeyError: the extras hold no DiLoCo state (the checkpoint was not saved by a DiLoCo
            run).
    """
    if _STRUCTURE not in extra:
        raise KeyError("the checkpoint holds no DiLoCo state (no extra "
                       f"{_STRUCTURE!r}): it was saved by a run with another --optimizer")
    state = _rebuild(extra[_STRUCTURE], extra)
    optimizer.load_state_dict({**state, "inner": optimizer.optim.state_dict()})
