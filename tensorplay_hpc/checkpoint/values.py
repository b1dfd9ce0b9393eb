"""Non-tensor values (hyperparameters, step counters, the user's extras) as JSON text that
``h5dump`` shows. Tuples are kept as tuples; anything JSON cannot hold is pickled into the text."""
from __future__ import annotations

import base64
import json
import pickle
from typing import Any

import torch

__all__ = ["dumps", "loads"]


def _encode(value: Any) -> Any:
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _encode(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.requires_grad:
        return {"__tensor__": value.item(), "dtype": str(value.dtype).replace("torch.", "")}
    return {"__pickle__": base64.b64encode(pickle.dumps(value)).decode("ascii")}


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        if "__tuple__" in value:
            return tuple(_decode(v) for v in value["__tuple__"])
        if "__tensor__" in value:
            return torch.tensor(value["__tensor__"], dtype=getattr(torch, value["dtype"]))
        if "__pickle__" in value:
            return pickle.loads(base64.b64decode(value["__pickle__"]))
        return {k: _decode(v) for k, v in value.items()}
    return value


def dumps(value: Any) -> str:
    return json.dumps(_encode(value), sort_keys=True)


def loads(text: str) -> Any:
    return _decode(json.loads(text))
