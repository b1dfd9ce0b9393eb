"""torch.distributed's ``Work`` for the backend's operations: a handle on the comm layer's
nonblocking operation (or on one already complete), with a future that completes with it."""
from __future__ import annotations

import queue
import threading
from datetime import timedelta
from typing import List, Optional

import torch
from torch.distributed import _Work
from torch.futures import Future

from tensorplay_hpc.comm.work import Work

__all__ = ["BackendWork"]


class _Completer:
    """One background thread that waits for operations whose future someone holds (DDP chains
    its bucket's work on the future), so that the future completes without anyone calling
    ``wait()``. Operations complete in the order they were handed over, as they were started."""

    def __init__(self) -> None:
        self._queue: "queue.SimpleQueue[BackendWork]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def is_current(self) -> bool:
        """Whether the caller runs on the completer thread (inside a future's callback)."""
        return threading.current_thread() is self._thread

    def hand_over(self, work: "BackendWork") -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tensorplay-c10d-completer",
                                                daemon=True)
                self._thread.start()
        self._queue.put(work)

    def _run(self) -> None:
        while True:
            work = self._queue.get()
            try:
                work.wait()
            except BaseException:   # the future carries it to whoever waits on it
                pass


_completer = _Completer()


class BackendWork(_Work):
    """A collective, send or receive of the ``mpi4py`` backend. ``pending`` is the comm
    layer's handle, or ``None`` for an operation that has already completed; ``result`` is
    what the future yields (the output tensors)."""

    def __init__(self, pending: Optional[Work], result: List[torch.Tensor],
                 source: int = -1) -> None:
        super().__init__()
        self._pending = pending
        self._result = result
        self._source = source
        self._lock = threading.Lock()
        self._future: Optional[Future] = None
        self._error: Optional[BaseException] = None

    def _finish(self) -> None:
        """Complete the comm layer's operation once (under the lock) and settle the future."""
        with self._lock:
            if self._pending is not None:
                pending, self._pending = self._pending, None
                try:
                    pending.wait()
                except BaseException as error:
                    self._error = error
                    if self._future is not None:
                        self._future.set_exception(error)
                    raise
                if self._future is not None:
                    self._future.set_result(self._result)
            elif self._error is not None:
                raise self._error

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        """Block until the operation is complete and its outputs are in place."""
        self._finish()
        return True

    def is_completed(self) -> bool:
        with self._lock:
            if self._pending is not None and self._pending.is_completed():
                self._pending = None
                if self._future is not None:
                    self._future.set_result(self._result)
            return self._pending is None

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self) -> Optional[BaseException]:
        return self._error

    def result(self) -> List[torch.Tensor]:
        self.wait()
        return self._result

    def source_rank(self) -> int:
        return self._source

    def _source_rank(self) -> int:
        return self._source

    def get_future(self) -> Future:
        """A future of the output tensors; it completes in the background. Asked from a
        callback of another future (PowerSGD waits there for its next allreduce), it completes
        first: the completer thread cannot wait for itself."""
        if _completer.is_current():
            self._finish()
        with self._lock:
            if self._future is None:
                self._future = Future()
                if self._pending is None:
                    if self._error is None:
                        self._future.set_result(self._result)
                    else:
                        self._future.set_exception(self._error)
                else:
                    _completer.hand_over(self)
            return self._future
