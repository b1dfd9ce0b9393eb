"""Checkpoints in parallel HDF5: one consolidated file per checkpoint, written by every rank at
once, loadable at any world size. See ``docs/checkpoints.md`` for the file format.

    checkpoint.save(path, model=model, optimizer=optimizer, extra={"step": step})
    extra = checkpoint.load(path, model=model, optimizer=optimizer)

``python -m tensorplay_hpc.checkpoint info|export|import`` inspects and converts files.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from mpi4py import MPI

from tensorplay_hpc.comm import ProcessGroup, agree

from . import restore, snapshot, writer
from .files import checkpoints, latest
from .format import CheckpointError
from .optimizers import Checkpointable
from .reader import Reader

__all__ = ["CheckpointError", "Reader", "checkpoints", "latest", "load", "save"]


def save(path: str, model: Optional[torch.nn.Module] = None,
         optimizer: Optional[Checkpointable] = None, extra: Optional[Dict[str, Any]] = None,
         process_group: Optional[MPI.Intracomm] = None, keep: Optional[int] = None) -> str:
    """Save a checkpoint to ``path``. Collective over ``process_group`` (default world).

    Every rank writes its own share straight into the file: its slice of the replicated model
    and of a plain optimizer's state, or the state shard it owns (ZeroRedundancyOptimizer).
    ``extra`` holds this rank's own values (epoch, RNG states, data position); tensors and
    arrays in it become datasets. The file appears at ``path`` only once complete; ``keep``
    then deletes all but the newest ``keep`` checkpoints of the folder.

    Returns:
        The checkpoint's absolute path.

    Raises:
        CheckpointError: on every rank, if any rank failed; the previous file is untouched.
    """
    group = ProcessGroup(process_group)
    try:
        error, snap = None, None
        try:
            snap = snapshot.take(group.rank, group.size, model, optimizer, extra)
        except Exception as failure:
            error = failure
        agree(group.comm, error, f"saving checkpoint {path}", CheckpointError)
        return writer.write(path, snap, group.comm, keep)
    finally:
        group.close()


def load(path: str, model: Optional[torch.nn.Module] = None,
         optimizer: Optional[Checkpointable] = None,
         process_group: Optional[MPI.Intracomm] = None) -> Dict[str, Any]:
    """Load a checkpoint saved at any world size. Collective over ``process_group``.

    Each rank reads the model and only the optimizer state it needs under the current
    partition, checking every dataset's checksum.

    Returns:
        The extras saved by this rank (by rank 0 if the file was saved on fewer ranks).

    Raises:
        CheckpointError: on every rank, naming the file, the problem and the ranks that hit it.
    """
    group = ProcessGroup(process_group)
    try:
        error, extra = None, {}
        try:
            with Reader(path) as reader:
                extra = restore.load_into(reader, group.rank, model, optimizer)
        except Exception as failure:
            error = failure
        agree(group.comm, error, f"loading checkpoint {path}", CheckpointError)
        return extra
    finally:
        group.close()
