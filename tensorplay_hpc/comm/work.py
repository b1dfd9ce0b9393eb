"""Handles of nonblocking operations."""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

from .mpi import MPI
from .polling import poll_until

from .trace import Record
from .watchdog import watched
from . import worker
from .worker import Job

__all__ = ["Work", "complete", "in_background"]


def _wait_all(requests: List[MPI.Request], quietly: bool = False) -> None:
    """Wait for every request, inside MPI or, ``quietly``, testing them between sleeps
    (:func:`~.polling.poll_until`); where one fails, raise its own error (``Waitall`` reports
    ``MPI_ERR_IN_STATUS`` for them all), so that a lost rank is told apart."""
    statuses = [MPI.Status() for _ in requests]
    try:
        if quietly:
            poll_until(lambda: MPI.Request.Testall(requests, statuses))
        else:
            MPI.Request.Waitall(requests, statuses)
    except MPI.Exception as error:
        if error.Get_error_class() != MPI.ERR_IN_STATUS:
            raise
        own = [s.Get_error() for s in statuses if s.Get_error() not in (MPI.SUCCESS,
                                                                          MPI.ERR_PENDING)]
        if not own:
            raise
        raise MPI.Exception(own[0]) from error


class Work:
    """A nonblocking operation in flight: MPI requests and handles it waits for (calls queued
    to a communicator's :mod:`.worker`, other works), then local work once they complete
    (copying staged buffers back, dividing an average). Like torch.distributed's ``Work``."""

    def __init__(self, requests: Sequence[MPI.Request] = (),
                 then: Optional[Callable[[], object]] = None, keep: Sequence[object] = (),
                 operation: str = "", comm: Optional[MPI.Intracomm] = None,
                 record: Optional[Record] = None, source: Optional[int] = None,
                 parts: Sequence[object] = ()) -> None:
        self._requests: List[MPI.Request] = list(requests)
        self._parts = list(parts)   # each with wait() and is_completed()
        self._then = then
        self._keep = list(keep)   # buffers MPI may still read: alive until completion
        self._done = False
        self._watch = (operation, comm)
        self._record = record   # the trace's entry, ended on completion
        self.source = source   # the sending rank, for a receive

    def _complete(self) -> None:
        self._done = True
        if self._record is not None:
            self._record.finish()
        self._keep = self._parts = []
        if self._then is not None:
            then, self._then = self._then, None
            then()

    def wait(self, quietly: bool = False) -> bool:
        """Block until the operation has completed and its results are in place; raises the
        error of a part that failed. ``quietly``: test its MPI requests between sleeps instead
        of waiting inside MPI, leaving the core to busier threads (a background exchange's
        choice: MPI's own wait keeps a core busy)."""
        if not self._done:
            for part in self._parts:
                part.wait()
            operation, comm = self._watch
            if self._requests and comm is None:
                _wait_all(self._requests, quietly)
            elif self._requests:
                with watched(f"wait for {operation}", comm):
                    _wait_all(self._requests, quietly)
            self._complete()
        return True

    def is_completed(self) -> bool:
        """Test for completion without blocking (and let MPI progress meanwhile)."""
        if (not self._done and all(part.is_completed() for part in self._parts)
                and (not self._requests or MPI.Request.Testall(self._requests))):
            self.wait()   # nothing left to wait for: raises a part's error, runs ``then``
        return self._done

    @classmethod
    def all_of(cls, works: Sequence["Work"], then: Optional[Callable[[], object]] = None) -> "Work":
        """One handle that completes when every one of ``works`` has, then runs ``then``."""
        return cls(then=then, parts=works)

    @classmethod
    def queued(cls, job: Job) -> "Work":
        """The handle of a call queued to a communicator's worker (:func:`.worker.submit`)."""
        return cls(parts=[job])


def complete(requests: List[MPI.Request], then: Callable[[], object], async_op: bool,
             keep: Sequence[object] = (), operation: str = "",
             comm: Optional[MPI.Intracomm] = None,
             record: Optional[Record] = None) -> Optional[Work]:
    """Return a handle for an asynchronous call, or finish a blocking one now. ``keep`` holds
    the buffers that MPI reads until the requests complete; ``operation`` on ``comm`` is what
    the watchdog reports if the wait stalls; ``record``, the trace's entry, ends on completion."""
    if not async_op:  # blocking calls have no requests left
        then()
        return None
    return Work(requests, then, keep, operation, comm, record)


def in_background(comm: MPI.Intracomm, run: Callable[[], object]) -> Work:
    """Run ``run`` (blocking collectives: on ``comm``, and on other communicators in an order
    every rank follows) on ``comm``'s worker, after the calls queued there; return its handle.
    Where there are no workers (:func:`.worker.available`), ``run`` runs here, at once. Local."""
    if worker.available():
        return Work.queued(worker.submit(comm, run))
    run()
    return Work()
