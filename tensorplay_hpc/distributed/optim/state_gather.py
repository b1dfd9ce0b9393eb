"""Gathering sharded optimizer state on one rank as flat buffers.

Every rank holds the state of the parameters it owns, keyed by global parameter index. To
consolidate, each rank packs its state tensors into one flat host buffer per dtype and the buffers
go to the target rank through one ``gather`` per dtype; only small metadata is pickled (indices,
keys, shapes, the values of 0-dimensional tensors such as ``step``, and non-tensor values). The
target rebuilds the tensors as views of the received buffers, so consolidation needs the memory of
the state once, on the host, and nothing on the other ranks but a copy of their own shard.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from mpi4py import MPI

from tensorplay_hpc import comm

State = Dict[int, Dict[Any, Any]]

_TENSOR, _SCALAR, _OBJECT = "tensor", "scalar", "object"


def _describe(state: State) -> Tuple[List[tuple], Dict[torch.dtype, List[torch.Tensor]]]:
    """Metadata entries ``(index, key, kind, payload)`` and the tensors to send, by dtype."""
    entries: List[tuple] = []
    tensors: Dict[torch.dtype, List[torch.Tensor]] = {}
    for index, values in state.items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                tensors.setdefault(value.dtype, []).append(value)
                entries.append((index, key, _TENSOR, (value.dtype, tuple(value.shape))))
            elif isinstance(value, torch.Tensor):
                entries.append((index, key, _SCALAR, (value.dtype, value.item())))
            else:
                entries.append((index, key, _OBJECT, value))
    return entries, tensors


def _pack(tensors: List[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    flat = comm.FlatBuffer([t.shape for t in tensors], dtype, "cpu")
    flat.copy_from([t.detach() for t in tensors])
    return flat.buffer


def gather_state(state: State, group: MPI.Intracomm, root: int) -> Optional[State]:
    """Every rank's ``state`` (global index -> state dict) merged on rank ``root``, with its tensors
    on the host; ``None`` on the other ranks. Collective over ``group``."""
    entries, tensors = _describe(state)
    counts = {dtype: sum(t.numel() for t in ts) for dtype, ts in tensors.items()}
    all_counts = group.allgather(counts)
    all_entries = group.gather(entries, root=root)
    flats = {}
    for dtype in sorted({d for c in all_counts for d in c}, key=str):
        send = _pack(tensors.get(dtype, []), dtype)
        flats[dtype] = comm.gather(send, group, root, [c.get(dtype, 0) for c in all_counts])
    if group.Get_rank() != root:
        return None

    merged: State = {}
    cursor = {dtype: 0 for dtype in flats}
    for rank_entries in all_entries:
        for index, key, kind, payload in rank_entries:
            if kind == _TENSOR:
                dtype, shape = payload
                start = cursor[dtype]
                cursor[dtype] = start + torch.Size(shape).numel()
                value = flats[dtype][start:cursor[dtype]].view(shape)
            elif kind == _SCALAR:
                value = torch.tensor(payload[1], dtype=payload[0])
            else:
                value = payload
            merged.setdefault(index, {})[key] = value
    return merged
