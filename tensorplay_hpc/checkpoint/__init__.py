"""Checkpoints in parallel HDF5: one consolidated file per checkpoint, written by every rank at
once, loadable at any world size. See ``docs/checkpoints.md`` for the file format.

    checkpoint.save(path, model=model, optimizer=optimizer, extra={"step": step})
    handle = checkpoint.save_async(path, model=model, optimizer=optimizer)   # returns at once
    handle.wait()
    extra = checkpoint.load(path, model=model, optimizer=optimizer)

``tensorplay-hpc checkpoint info|list|export|import`` inspects, lists and converts files.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from tensorplay_hpc.comm import ProcessGroup, resolve, trace
from tensorplay_hpc.comm.agreement import fail_together
from tensorplay_hpc.comm.mpi import MPI

from . import background, collector, restore, same_call, snapshot, writer
from .background import AsyncCheckpointer, SaveHandle
from .files import checkpoints, latest
from .format import CheckpointError
from .optimizers import Checkpointable
from .reader import Reader
from .replicas import Replicas

__all__ = ["AsyncCheckpointer", "CheckpointError", "Reader", "SaveHandle", "checkpoints",
           "async_checkpointer", "close_async", "latest", "load", "save", "save_async"]


@collector.paused()
@trace.caller(same_call.SAVE)
def save(path: str, model: Optional[torch.nn.Module] = None,
         optimizer: Optional[Checkpointable] = None, extra: Optional[Dict[str, Any]] = None,
         process_group: Optional[MPI.Intracomm] = None, keep: Optional[int] = None,
         replica_group: Optional[MPI.Intracomm] = None) -> str:
    """Save a checkpoint to ``path``. Collective over ``process_group`` (default world).

    Every rank writes its own share straight into the file: its slice of the replicated model
    and of a plain optimizer's state, or the state shard it owns (ZeroRedundancyOptimizer).
    ``replica_group``, when the ranks' replicated state differs between groups (post-local SGD
    across nodes, between averagings), is this rank's group of ranks holding the same copy (a
    sub-communicator of ``process_group``, such as the node's): each group's copy is saved.
    ``extra`` holds this rank's own values (epoch, RNG states, data position); tensors and
    arrays in it become datasets. The file appears at ``path`` only once complete. A background
    save (:func:`save_async`) still being written is let finish first.

    ``keep`` then deletes the older checkpoints of this run beyond the newest ``keep``. The run
    is ``path``'s folder and name pattern: the files whose names differ from ``path``'s only in
    the last number (``step-0000900.h5`` for ``step-0001000.h5``; not ``old-run-final.h5``, nor
    ``b-step9.h5`` for ``a-step10.h5``). Newest means by the creation time recorded inside each
    file, then the recorded step; never by name. The file just written is never deleted and is
    one of the ``keep``. Only checkpoints whose checksums verify are counted or deleted: a
    truncated, damaged or foreign file of the run is left alone, with a warning naming it.

    Returns:
        The checkpoint's absolute path.

    Raises:
        CheckpointError: on every rank, if any rank failed; the previous file is untouched.
    """
    background.join_writers()
    group = ProcessGroup(process_group, owner="checkpoint.save")
    try:
        same_call.check_save(group.comm, path, model, optimizer, replica_group)
        snap = snapshot.collect(group.comm, path, model, optimizer, extra, replica_group)
        return writer.write(path, snap, group.comm, keep)
    finally:
        group.close()


_checkpointers: Dict[int, AsyncCheckpointer] = {}


def save_async(path: str, model: Optional[torch.nn.Module] = None,
               optimizer: Optional[Checkpointable] = None, extra: Optional[Dict[str, Any]] = None,
               process_group: Optional[MPI.Intracomm] = None, keep: Optional[int] = None,
               replica_group: Optional[MPI.Intracomm] = None) -> SaveHandle:
    """Save a checkpoint in the background: every rank copies its part of the state to host
    buffers (kept for the next save; pinned for GPU tensors) and returns; the file is written
    while training continues. Collective over ``process_group``; the arguments and the file are
    those of :func:`save`.

    One save per process group is in flight at a time: a new one first waits for the previous.
    The writer of each process group (its thread, host buffers and private communicator) is
    made at its first save and freed by :func:`close_async`. Below ``MPI_THREAD_MULTIPLE`` the
    file is written in ``handle.wait()`` instead (see :class:`AsyncCheckpointer`).

    Returns:
        A :class:`SaveHandle`: ``wait()`` (collective) returns the path or raises the same
        :class:`CheckpointError` on every rank; ``done()`` says whether the write has finished.

    Raises:
        CheckpointError: on every rank, if taking the snapshot failed on any rank, or the
            previous save failed and was not waited for.
    """
    key = resolve(process_group).py2f()
    if key not in _checkpointers:
        _checkpointers[key] = AsyncCheckpointer(process_group)
    return _checkpointers[key].save(path, model, optimizer, extra, keep, replica_group)


def async_checkpointer(process_group: Optional[MPI.Intracomm] = None
                       ) -> Optional[AsyncCheckpointer]:
    """The writer that :func:`save_async` made for ``process_group`` (default world), or None
    if it made none or :func:`close_async` has freed it. Local."""
    return _checkpointers.get(resolve(process_group).py2f())


def close_async(process_group: Optional[MPI.Intracomm] = None) -> None:
    """Wait for the background save of ``process_group`` (if any) and free its writer. Collective;
    does nothing when :func:`save_async` never ran on that group.

    Raises:
        CheckpointError: if that save failed and was not waited for.
    """
    checkpointer = _checkpointers.pop(resolve(process_group).py2f(), None)
    if checkpointer is not None:
        checkpointer.close()


@collector.paused()
@trace.caller(same_call.LOAD)
def load(path: str, model: Optional[torch.nn.Module] = None,
         optimizer: Optional[Checkpointable] = None,
         process_group: Optional[MPI.Intracomm] = None,
         replica_group: Optional[MPI.Intracomm] = None) -> Dict[str, Any]:
    """Load a checkpoint saved at any world size. Collective over ``process_group``.

    Replicated entries (the model, a plain optimizer's state) are read once, by ranks taking
    turns by bytes, and broadcast; sharded state is read only by the rank that needs it under the
    current partition. Each reader checks the checksums of what it read. A file holding several
    replicas (see :func:`save`) loads this rank's own replica when ``replica_group`` forms the
    same groups as at save time, and the replicas' average otherwise.

    Returns:
        The extras saved by this rank (by rank 0 if the file was saved on fewer ranks).

    Raises:
        CheckpointError: on every rank, naming the file, the problem and the ranks that hit it.
    """
    group = ProcessGroup(process_group)
    try:
        same_call.check_call(group.comm, same_call.LOAD, path)
        reader, replicas = None, None
        try:
            with fail_together(group.comm, f"loading checkpoint {path}", CheckpointError):
                replicas = Replicas(group.comm, replica_group)  # collective: raises on all or none
                reader = Reader(path)
            return restore.load_into(reader, group.comm, replicas, model, optimizer)
        finally:
            if reader is not None:
                reader.close()
    finally:
        group.close()
