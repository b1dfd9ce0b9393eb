"""Checkpoints written in the background: training stalls only while each rank copies its part
of the state into host buffers; the file is then written by a thread of each rank, on a private
communicator, through the same phases as a blocking save (:func:`.writer.plan`,
:func:`.writer.write_data`, :func:`.writer.commit`).

The thread runs MPI and MPI-IO calls while the main thread runs its own collectives, which needs
``MPI_THREAD_MULTIPLE`` on every rank. Below it the write is deferred instead: it runs, blocking,
in :meth:`SaveHandle.wait` (or the next save, or :meth:`AsyncCheckpointer.close`), so the file is
still complete and correct, only not written while training runs.
"""
from __future__ import annotations

import os
import threading
import time
import weakref
from typing import Any, Callable, Dict, Optional

import torch

from tensorplay_hpc.comm import Closeable, ProcessGroup, trace
from tensorplay_hpc.comm.capabilities import ranks_below_multiple
from tensorplay_hpc.comm.mpi import MPI

from . import collector, same_call, snapshot, writer
from .host_copy import HostBuffers
from .optimizers import Checkpointable

__all__ = ["AsyncCheckpointer", "NICENESS", "SaveHandle", "join_writers"]


_writing: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()

NICENESS = 19
"""How much lower the writer thread's scheduling priority is than training's (Linux ``nice``):
the write uses the cores training leaves idle rather than taking them from it."""


def _lower_priority() -> None:
    """Lower the calling thread's priority by :data:`NICENESS`, where the system allows."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                       os.getpriority(os.PRIO_PROCESS, 0) + NICENESS)
    except (AttributeError, OSError):   # no per-thread priorities here: the write runs as is
        pass


class SaveHandle:
    """A checkpoint being written in the background, as :func:`save_async` returns it.

    Attributes:
        path: the checkpoint's absolute path.
        stall_seconds: how long the save blocked its caller (the host copy, and waiting for the
            save before it).
        write_seconds: how long the background write took (``None`` until it is done).
    """

    def __init__(self, path: str, write: Callable[[], str], threaded: bool,
                 stall_seconds: float) -> None:
        self.path = os.path.abspath(path)
        self.stall_seconds = stall_seconds
        self.write_seconds: Optional[float] = None
        self.waited = False
        self._write = write
        self._result: Optional[str] = None
        self._error: Optional[BaseException] = None
        self._finished = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if threaded:
            self._thread = threading.Thread(target=self._run, name="tensorplay_hpc-checkpoint")
            _writing.add(self._thread)
            self._thread.start()

    def _run(self) -> None:
        started = time.perf_counter()
        if self._thread is not None:
            _lower_priority()
        try:
            self._result = self._write()
        except BaseException as error:   # handed to wait() on the caller's thread
            self._error = error
        finally:
            self.write_seconds = time.perf_counter() - started
            self._finished.set()

    def done(self) -> bool:
        """Whether the write has finished, successfully or not. Not collective. Below
        ``MPI_THREAD_MULTIPLE`` the write runs in :meth:`wait`: ``False`` until then."""
        return self._finished.is_set()

    def wait(self) -> str:
        """Wait until the file is written and return its absolute path. Collective over the
        save's process group (below ``MPI_THREAD_MULTIPLE`` the write runs now).

        Raises:
            CheckpointError: on every rank, if any rank failed; the previous checkpoint at
                :attr:`path` is then untouched.
        """
        if self._thread is None:
            if not self._finished.is_set():
                self._run()
        else:
            self._thread.join()
        self.waited = True
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


def join_writers() -> None:
    """Wait until no background write of this process is running; their outcomes stay for
    :meth:`SaveHandle.wait`. Local. A blocking save runs this first, so that saves complete in
    the order they were made and do not compete for the disk."""
    for thread in list(_writing):
        thread.join()


class AsyncCheckpointer(Closeable):
    """Saves checkpoints in the background, one at a time (a save first waits for the one
    before). Owns this rank's host buffers and the writer's private duplicate of
    ``process_group``. Collective to construct and to :meth:`close`; a context manager.

    Args:
        process_group: the ranks saving together (default ``MPI.COMM_WORLD``).

    Attributes:
        threaded: whether saves are written by a background thread (every rank runs at
            ``MPI_THREAD_MULTIPLE``); otherwise the write runs in :meth:`SaveHandle.wait`.
    """

    def __init__(self, process_group: Optional[MPI.Intracomm] = None) -> None:
        self._group = ProcessGroup(process_group, owner="checkpoint.AsyncCheckpointer")
        self.threaded: bool = not ranks_below_multiple(self._group.comm)
        self._buffers = HostBuffers()
        self._pending: Optional[SaveHandle] = None

    @collector.paused()
    @trace.caller("checkpoint.save_async")
    def save(self, path: str, model: Optional[torch.nn.Module] = None,
             optimizer: Optional[Checkpointable] = None, extra: Optional[Dict[str, Any]] = None,
             keep: Optional[int] = None,
             replica_group: Optional[MPI.Intracomm] = None) -> SaveHandle:
        """Copy this rank's part of the state to host buffers and start writing ``path`` in the
        background; the arguments are :func:`~tensorplay_hpc.checkpoint.save`'s. Collective.

        Raises:
            CheckpointError: on every rank, if taking the snapshot failed on any, or if the
                save before this one failed and was not waited for.
        """
        started = time.perf_counter()
        self._finish_previous()
        group = self._group.comm
        same_call.check_save(group, path, model, optimizer, replica_group)
        snap = snapshot.collect(group, path, model, optimizer, extra, replica_group,
                                self._buffers.copy)
        self._pending = SaveHandle(
            path, lambda: writer.write(path, snap, group, keep, background=self.threaded),
            self.threaded, time.perf_counter() - started)
        return self._pending

    def _finish_previous(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None and not pending.waited:
            pending.wait()

    def wait(self) -> Optional[str]:
        """Wait for the save in flight; its path, or ``None`` without one. Collective.

        Raises:
            CheckpointError: on every rank, if that save failed.
        """
        pending, self._pending = self._pending, None
        return None if pending is None else pending.wait()

    @property
    def host_bytes(self) -> int:
        """The bytes of this rank's host buffers, kept for the next save."""
        return self._buffers.nbytes

    def close(self) -> None:
        """Wait for the save in flight, then free the writer's communicator. Collective;
        closing again does nothing.

        Raises:
            CheckpointError: if the save in flight failed and was not waited for.
        """
        try:
            self._finish_previous()
        finally:
            self._group.close()
