"""The checkpoint file format: names, attributes and how tensors are stored.

One HDF5 file per checkpoint. Tensors and attributes are named as in a tree::

    /                         attrs: format, format_version, package_version, torch_version,
                                     world_size, step, created, replicas (JSON),
                                     metadata_crc32 (JSON, version 5 on)
    model/<name>              each parameter and buffer of model.state_dict(), by name
    optimizer                 attrs: class, kind, param_groups (JSON), and kind-specific values
    optimizer/state/<i>/<k>   optimizer state of global parameter index i, key k
    optimizer/parameters/<i>  a DistributedOptimizer's parameter values, written by their owners
    extra/rank<r>/<k>         the user's extra values saved by rank r (tensors as datasets,
                              everything else in the node's "values" attribute)

With several replicas (ranks whose replicated state differs between groups, as post-local SGD
across nodes), replica ``j``'s model and replicated optimizer state lie under ``replica<j>/``
(``replica<j>/model/<name>``, ``replica<j>/optimizer/state/<i>/<k>``); with one replica (every
file of version 1) there is no prefix.

Since version 3, only the root's attributes are HDF5 attributes; the tree's names, every other
attribute and where each tensor's values lie (a dataset of its own for large tensors, a stretch
of ``/packed/<dtype>`` for small ones) are in the catalog (see :mod:`.catalog`): one JSON
document in version 3, the JSON strings and two ``int64`` columns since version 4. In versions 1
and 2 each tensor was a dataset of its name, each attribute an HDF5 attribute.
Every tensor has a ``torch_dtype`` and the ``crc32`` of its raw bytes; since version 5 the
root's attributes and the catalog have theirs too (see :mod:`.metadata_checksums`). bfloat16,
which HDF5 lacks, is stored as its raw 16-bit words (``int16``).
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import numpy as np
import torch

try:   # the same CRC-32 as zlib's, with the processor's carry-less multiply: some 8x faster
    from isal.isal_zlib import crc32
except ImportError:
    from zlib import crc32

__all__ = ["CHECKSUM_PIECE_BYTES", "CheckpointError", "FORMAT", "FORMAT_VERSION", "SUFFIX",
           "checksum", "dtype_name", "extra_group", "from_numpy", "model_name", "numpy_dtype",
           "replica_prefix", "state_name", "state_node", "to_numpy", "torch_dtype", "unwrap_model"]

FORMAT = "tensorplay_hpc-checkpoint"
FORMAT_VERSION = 5
SUFFIX = ".h5"

_STORED_AS = {torch.bfloat16: torch.int16}


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the file and the problem."""


@functools.lru_cache(maxsize=None)
def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@functools.lru_cache(maxsize=None)
def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown tensor dtype {name!r} in checkpoint")
    return dtype


@functools.lru_cache(maxsize=None)
def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy (and so HDF5) dtype a tensor of ``dtype`` is stored as."""
    stored = _STORED_AS.get(dtype, dtype)
    return torch.empty(0, dtype=stored).numpy().dtype


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous host array of the tensor's raw values (zero-copy for contiguous CPU tensors)."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    tensor = tensor.contiguous()
    stored = _STORED_AS.get(tensor.dtype)
    if stored is not None:
        tensor = tensor.view(stored)
    return tensor.numpy()


def from_numpy(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The tensor stored in ``array`` (as written by :func:`to_numpy`)."""
    array = np.array(array, copy=None, order="C", ndmin=0)   # keeps 0-d scalars 0-d
    tensor = torch.from_numpy(array)
    return tensor.view(dtype) if dtype in _STORED_AS else tensor


CHECKSUM_PIECE_BYTES = 1 << 18
"""Checksums are computed this many bytes at a time, the thread offering its core to others
between pieces (``os.sched_yield``): a background save's thread then keeps training's thread,
when it waits inside MPI and yields, off its core for a piece's time (some 0.1 ms), not for a
scheduler's time slice."""


def checksum(array: np.ndarray, crc: int = 0) -> int:
    """CRC-32 of an array's raw bytes; with ``crc``, that of bytes whose CRC-32 is ``crc``
    followed by the array's."""
    data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    for start in range(0, data.size, CHECKSUM_PIECE_BYTES):
        crc = crc32(data[start:start + CHECKSUM_PIECE_BYTES], crc)
        os.sched_yield()
    return crc & 0xFFFFFFFF


def replica_prefix(replica: int, replicas: int) -> str:
    """The folder of replica ``replica``'s copy when the file holds ``replicas`` of them."""
    return "" if replicas == 1 else f"replica{replica}/"


def model_name(key: str, prefix: str = "") -> str:
    return f"{prefix}model/{key}"


def state_node(index: int, prefix: str = "") -> str:
    return f"{prefix}optimizer/state/{index}"


def state_name(index: int, key: str, prefix: str = "") -> str:
    return f"{state_node(index, prefix)}/{key}"


def extra_group(rank: int) -> str:
    return f"extra/rank{rank}"


def unwrap_model(model: Optional[torch.nn.Module]) -> Optional[torch.nn.Module]:
    """The module inside a data-parallel wrapper."""
    while model is not None and hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model
