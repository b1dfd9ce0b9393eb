"""Gathering sharded optimizer state on one rank as flat buffers.

Every rank holds the state of the parameters it owns, keyed by global parameter index. To
consolidate, each rank packs its state tensors into one flat host buffer per stream (dtype and
device, 0-dimensional values such as ``step`` apart) and the buffers go to the target rank
through one ``gather`` per stream; only small metadata is pickled (indices, keys, shapes and
non-tensor values). The target rebuilds the tensors as views of the received buffers, a few
calls per stream rather than a few per tensor, so consolidation needs the memory of the state
once, on the host, and nothing on the other ranks but a copy of their own shard.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from tensorplay_hpc import comm
from tensorplay_hpc.comm.mpi import MPI
from tensorplay_hpc.comm.small_collectives import all_gather_object, gather_object

__all__ = ["State", "Stream", "gather_state"]

State = Dict[int, Dict[Any, Any]]
Stream = Tuple[torch.dtype, torch.device, bool]
"""``(dtype, device, 0-dimensional)``: state tensors that travel in one flat buffer."""


class _Shard:
    """One rank's state taken apart: the key order of each entry, the tensors by stream (with
    ``(index, key, shape)`` of each) and the other values."""

    def __init__(self, state: State) -> None:
        self.keys: List[Tuple[int, tuple]] = []
        self.layouts: Dict[Stream, List[tuple]] = {}
        self.tensors: Dict[Stream, List[torch.Tensor]] = {}
        self.objects: List[tuple] = []
        for index, values in state.items():
            self.keys.append((index, tuple(values)))
            for key, value in values.items():
                if isinstance(value, torch.Tensor):
                    shape = tuple(value.shape)
                    stream = (value.dtype, value.device, not shape)
                    if stream not in self.tensors:
                        self.layouts[stream], self.tensors[stream] = [], []
                    self.layouts[stream].append((index, key, shape))
                    self.tensors[stream].append(value)
                else:
                    self.objects.append((index, key, value))

    def metadata(self) -> tuple:
        return self.keys, self.layouts, self.objects

    def counts(self) -> Dict[Stream, int]:
        return {stream: sum(t.numel() for t in tensors)
                for stream, tensors in self.tensors.items()}

    def pack(self, stream: Stream) -> torch.Tensor:
        """The stream's tensors back to back in one new host buffer."""
        dtype, _, scalar = stream
        tensors = self.tensors.get(stream)
        if not tensors:
            return torch.empty(0, dtype=dtype)
        with torch.no_grad():
            if scalar:
                flat = torch.stack(tensors)
            else:
                flat = torch.cat([t if t.dim() == 1 else t.reshape(-1) for t in tensors])
        return flat.to("cpu")


def _unpack(flat: torch.Tensor, layout: List[tuple], scalar: bool) -> List[torch.Tensor]:
    """Views of ``flat``, one per ``(index, key, shape)`` of ``layout``."""
    if scalar:
        return list(flat.unbind())
    pieces = flat.split([torch.Size(shape).numel() for _, _, shape in layout])
    return [piece if len(shape) == 1 else piece.view(shape)
            for piece, (_, _, shape) in zip(pieces, layout)]


def gather_state(state: State, group: MPI.Intracomm, root: int) -> Optional[State]:
    """Every rank's ``state`` (global index -> state dict) merged on rank ``root``, with its tensors
    on the host; ``None`` on the other ranks. Collective over ``group``."""
    shard = _Shard(state)
    all_counts = all_gather_object(shard.counts(), group)
    all_metadata = gather_object(shard.metadata(), group, root)
    flats = {}
    for stream in sorted({s for counts in all_counts for s in counts}, key=str):
        flats[stream] = comm.gather(shard.pack(stream), group, root,
                                    [counts.get(stream, 0) for counts in all_counts])
    if group.Get_rank() != root:
        return None

    merged: State = {index: dict.fromkeys(keys)
                     for keys_of_rank, _, _ in all_metadata for index, keys in keys_of_rank}
    for stream, flat in flats.items():
        layout = [entry for _, layouts, _ in all_metadata for entry in layouts.get(stream, [])]
        for (index, key, _), value in zip(layout, _unpack(flat, layout, stream[2])):
            merged[index][key] = value
    for _, _, objects in all_metadata:
        for index, key, value in objects:
            merged[index][key] = value
    return merged
