"""A thread per communicator that runs its nonblocking collectives as blocking ones, in the
order they were started.

MPI's nonblocking collectives advance only inside MPI calls on their own rank, and their
algorithms are not the tuned ones of the blocking calls: five 1 MiB ``Iallreduce`` in flight
took 1.05-2.9x the time of the same blocking calls at 2 and 4 ranks under each MPI library
here, and nonblocking averaging 7-96x its cost model at 16 ranks on 2 cores. So where every
rank runs at ``MPI_THREAD_MULTIPLE``, a collective started with ``async_op=True`` is queued to
its communicator's worker thread, which runs the blocking call, and the caller goes on at once
(PyTorch's own MPI backend works the same way).

Order is what keeps this safe: each communicator has one queue, and a blocking collective the
library starts on a communicator from any other thread first waits for that communicator's
queue to empty (:func:`settle`, called by the watchdog's ``watched`` that every collective
enters). So every rank issues the collectives of a communicator in the order its program
started them, as with MPI's own nonblocking calls.

``TENSORPLAY_HPC_NONBLOCKING`` chooses: ``thread`` (the default where every thread may call MPI,
but for Intel MPI) or ``requests`` (MPI's nonblocking calls, as below ``MPI_THREAD_MULTIPLE``).
Work handed to a worker as a whole (:func:`~.work.in_background`: DDP's buckets, the
hierarchical hook's phases) runs there wherever workers are :func:`available`.
"""
from __future__ import annotations

import contextvars
import os
import queue
import threading
from typing import Callable, Dict, Optional

from . import library
from .environment import read_once
from .mpi import MPI

__all__ = ["NONBLOCKING_ENV", "Job", "available", "in_thread", "retire", "settle", "stop",
           "submit"]

NONBLOCKING_ENV = "TENSORPLAY_HPC_NONBLOCKING"
_CHOICES = ("thread", "requests")


def available() -> bool:
    """Whether workers may run: every thread may call MPI (``MPI_THREAD_MULTIPLE``). Local."""
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


@read_once
def in_thread() -> bool:
    """Whether collectives started nonblocking run on workers (else as MPI requests): by
    default wherever workers are :func:`available` and the library runs them safely
    (:func:`~.library.queued_collectives_hang`). Local.

    Raises:
        ValueError: ``TENSORPLAY_HPC_NONBLOCKING`` names neither ``thread`` nor ``requests``.
    """
    choice = os.environ.get(NONBLOCKING_ENV, "").strip().lower()
    if choice not in _CHOICES + ("",):
        raise ValueError(f"{NONBLOCKING_ENV}={choice!r} on world rank "
                         f"{MPI.COMM_WORLD.Get_rank()}: choose thread or requests")
    if not choice:
        choice = "requests" if library.queued_collectives_hang() else "thread"
    return choice == "thread" and available()


class Job:
    """A call queued to a worker: ``wait()`` returns once it has run, raising its error."""

    __slots__ = ("run", "context", "done", "error")

    def __init__(self, run: Callable[[], object]) -> None:
        self.run: Optional[Callable[[], object]] = run
        # The submitter's context, so that the trace names the caller on the worker.
        self.context = contextvars.copy_context()
        self.done = threading.Event()
        self.error: Optional[BaseException] = None

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise self.error


class _Worker:
    """One communicator's queue and the thread that empties it, started on first use."""

    def __init__(self, name: str) -> None:
        self._queue: "queue.SimpleQueue[Optional[Job]]" = queue.SimpleQueue()
        self._unfinished = 0
        self._idle = threading.Condition()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def put(self, job: Job) -> None:
        with self._idle:
            self._unfinished += 1
        self._queue.put(job)

    def drain(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self._unfinished == 0)

    def busy(self) -> bool:
        return self._unfinished > 0

    def end(self, join: bool = True) -> None:
        self._queue.put(None)
        if join and threading.current_thread() is not self.thread:
            self.thread.join()

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                job.context.run(job.run)
            except BaseException as error:   # handed to the waiting thread
                job.error = error
            finally:
                job.run = job.context = None   # hold no buffers while idle
                job.done.set()
                with self._idle:
                    self._unfinished -= 1
                    if self._unfinished == 0:
                        self._idle.notify_all()
            del job


_workers: Dict[int, _Worker] = {}
_lock = threading.Lock()


def submit(comm: MPI.Intracomm, run: Callable[[], object]) -> Job:
    """Queue ``run`` (blocking collectives on ``comm``) to ``comm``'s worker, after the calls
    queued there before; returns at once. Local: each rank queues the same calls in the same
    order, as it would call them."""
    handle = comm.handle
    worker = _workers.get(handle)
    if worker is None:
        with _lock:
            worker = _workers.get(handle)
            if worker is None:
                worker = _workers[handle] = _Worker(f"mpi-worker-{handle:x}")
    job = Job(run)
    worker.put(job)
    return job


def settle(comm: MPI.Comm) -> None:
    """Wait until the calls queued to ``comm``'s worker have run, unless this is that worker:
    what a thread starts on ``comm`` next then follows them on every rank. Local."""
    worker = _workers.get(comm.handle)
    if worker is not None and worker.busy() and threading.current_thread() is not worker.thread:
        worker.drain()


def stop(comm: MPI.Comm) -> None:
    """Run what is queued to ``comm``'s worker and end its thread, before ``comm`` is freed.
    Local."""
    with _lock:
        worker = _workers.pop(comm.handle, None)
    if worker is not None:
        worker.end()


def retire(comm: MPI.Comm) -> None:
    """End ``comm``'s worker once what is queued there has run, without waiting for it (its
    owner was collected, leaving ``comm`` to ``MPI_Finalize``). Local; takes no lock, so a
    finalizer may call it whatever the thread was doing."""
    worker = _workers.pop(comm.handle, None)
    if worker is not None:
        worker.end(join=False)
