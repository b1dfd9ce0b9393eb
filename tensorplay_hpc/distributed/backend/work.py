"""torch.distributed's ``Work`` for the backend's operations: a handle on the comm layer's
nonblocking operation (or on one already complete), and a future of its outputs.

The future is complete when it is handed out: ``get_future()`` first completes the operation.
Callers that chain work on a future (DDP's communication hooks, PowerSGD's second and third
allreduces) then run their callbacks at once, in the calling thread, so every rank starts the
chained collectives in the same order. A future that completed later, on some other thread,
would start them in whatever order threads ran, and MPI matches collectives by order. Callers
that ``wait()`` (FSDP2's prefetching all-gathers) keep the operation in flight until then.
"""
from __future__ import annotations

from datetime import timedelta
from typing import List, Optional

import torch
from torch.distributed import _Work
from torch.futures import Future

from tensorplay_hpc.comm.work import Work

__all__ = ["BackendWork"]


class BackendWork(_Work):
    """A collective, send or receive of the ``mpi4py`` backend. ``pending`` is the comm
    layer's handle, or ``None`` for an operation that has already completed; ``outputs`` is
    what the future yields; ``source`` the sending rank of a receive."""

    def __init__(self, pending: Optional[Work], outputs: list, source: int = -1) -> None:
        super().__init__()
        self._pending = pending
        self.outputs = outputs
        self._source = source
        self._error: Optional[BaseException] = None

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        """Block until the operation is complete and its outputs are in place."""
        if self._error is not None:
            raise self._error
        if self._pending is not None:
            pending, self._pending = self._pending, None
            try:
                pending.wait()
            except BaseException as error:
                self._error = error
                raise
        return True

    @property
    def pending(self) -> bool:
        """Whether the operation may still be in flight."""
        return self._pending is not None

    def is_completed(self) -> bool:
        if self._pending is not None and self._pending.is_completed():
            self._pending = None
        return self._pending is None

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self) -> Optional[BaseException]:
        return self._error

    def result(self) -> List[torch.Tensor]:
        self.wait()
        return self.outputs

    def source_rank(self) -> int:
        return self._source

    def _source_rank(self) -> int:
        return self._source

    def get_future(self) -> Future:
        """A future of the outputs, complete (see the module's note)."""
        future: Future = Future()
        try:
            self.wait()
        except BaseException as error:
            future.set_exception(error)
        else:
            future.set_result(self.outputs)
        return future
