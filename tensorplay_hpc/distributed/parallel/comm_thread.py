"""A thread that runs blocking collectives in submission order, so that they overlap the work
of the calling thread (the backward pass). Needs ``MPI_THREAD_MULTIPLE``."""
from __future__ import annotations

import contextvars
import queue
import threading
from typing import Callable, Optional

import torch

__all__ = ["CommThread", "ThreadWork"]


class ThreadWork:
    """A reduction running on a :class:`CommThread`: ``wait()`` returns the reduced tensor."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.done = threading.Event()
        self.error: Optional[BaseException] = None

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self) -> torch.Tensor:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.tensor


class CommThread:
    """A thread that runs blocking reductions in submission order, so that they overlap the
    backward pass while using Open MPI's fast blocking allreduce. Started on first use."""

    def __init__(self) -> None:
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None

    def submit(self, tensor: torch.Tensor, reduce: Callable[[torch.Tensor], None]) -> ThreadWork:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ddp-allreduce", daemon=True)
            self._thread.start()
        work = ThreadWork(tensor)
        # In the submitter's context, so the trace names the caller (the bucket) on the thread.
        self._queue.put((reduce, work, contextvars.copy_context()))
        return work

    def _run(self) -> None:
        while True:
            reduce, work, context = self._queue.get()
            if work is None:
                return
            try:
                context.run(reduce, work.tensor)
            except BaseException as error:   # handed to the waiting thread
                work.error = error
            finally:
                work.done.set()
                del reduce, work, context   # hold nothing (such as the reducer) while idle

    def stop(self) -> None:
        """Finish the queued reductions and end the thread."""
        if self._thread is not None:
            self._queue.put((None, None, None))
            self._thread.join()
            self._thread = None
