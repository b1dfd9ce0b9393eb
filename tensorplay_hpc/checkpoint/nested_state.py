"""Nested state (dicts and lists holding tensors, as ``state_dict()`` returns) as a skeleton
that JSON holds and a flat set of named tensors: a checkpoint stores the skeleton as an attribute
and the tensors as the datasets of one folder."""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

__all__ = ["flatten", "rebuild"]


def flatten(value: Any) -> Tuple[Any, Dict[str, torch.Tensor]]:
    """``(skeleton, tensors)``: ``value`` with each tensor replaced by a reference to its name
    in ``tensors`` (``t0``, ``t1``, ... in the order met). Dict keys keep their type."""
    tensors: Dict[str, torch.Tensor] = {}

    def walk(item: Any) -> Any:
        if isinstance(item, torch.Tensor):
            name = f"t{len(tensors)}"
            tensors[name] = item
            return {"tensor": name}
        if isinstance(item, dict):
            return {"dict": [[key, walk(entry)] for key, entry in item.items()]}
        if isinstance(item, (list, tuple)):
            return {"list": [walk(entry) for entry in item]}
        return {"value": item}

    return walk(value), tensors


def rebuild(skeleton: Any, tensors: Dict[str, torch.Tensor]) -> Any:
    """The value :func:`flatten` took apart (tuples come back as lists).

    Raises:
        KeyError: ``tensors`` lacks a tensor the skeleton names.
    """
    (kind, content), = skeleton.items()
    if kind == "tensor":
        return tensors[content]
    if kind == "dict":
        return {key: rebuild(entry, tensors) for key, entry in content}
    if kind == "list":
        return [rebuild(entry, tensors) for entry in content]
    return content
