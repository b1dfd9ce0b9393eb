"""A watchdog for collectives: one that waits longer than a timeout is reported (which
operation, on which communicator, which ranks have not arrived) and the job is aborted.

Enabled by ``TENSORPLAY_HPC_COLLECTIVE_TIMEOUT`` (seconds) or :func:`enable`. Each rank counts,
for every :class:`~.group.ProcessGroup` made while it is enabled, the collectives it has
entered on it (a local increment). A background thread per process, started by the first
collective or process group while the watchdog is enabled, checks the running collectives
against the timeout and, on a private duplicate of each watched communicator,
answers other ranks' queries for its count (point-to-point messages of one integer, polled a
few times a second). When a collective stalls, the stalled rank asks every rank for its count,
with a bounded wait, and names the ranks whose count is behind and those that did not answer.
Every rank asked, and the stalled one, print their last operations (:mod:`.trace`): which
collective, or which compute span of the training job, each rank was in.

A collective on a communicator that no process group made (a user's communicator, the ``Dup``
that makes a group) is counted on a watched communicator with the same ranks, if there is one;
otherwise (as before the first process group exists) it is still aborted on time, but the late
ranks cannot be named.

Asking needs ``MPI_THREAD_MULTIPLE`` (the thread talks while the main thread is inside the
collective). Below it the watchdog still aborts on time, but says that the late ranks cannot be
named.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from contextlib import nullcontext
from typing import ContextManager, Dict, List, Optional, Set, Tuple

import numpy as np

from . import capabilities, communicators, fault_tolerance, trace, worker
from .environment import read_once
from .library import thread_level_name
from .mpi import MPI

__all__ = ["ANSWER_SECONDS", "ArrivalCounter", "POLL_SECONDS", "TIMEOUT_ENV", "enable", "forget",
           "register", "serve_all", "timeout", "unregister", "watched", "world_ranks"]

TIMEOUT_ENV = "TENSORPLAY_HPC_COLLECTIVE_TIMEOUT"
POLL_SECONDS = 0.1
"""How often the thread checks the running collectives and answers queries."""
ANSWER_SECONDS = 3.0
"""How long a stalled rank waits for the other ranks' counts."""
_QUERY, _ANSWER = 1, 2      # message tags on a counter's private communicator

_timeout: Optional[float] = None


def enable(timeout: float) -> None:
    """Watch every collective from now on (and count those of process groups made from now on);
    abort after ``timeout`` s."""
    global _timeout
    if timeout <= 0:
        raise ValueError(f"the collective timeout must be positive, got {timeout}")
    _timeout = float(timeout)


def timeout() -> Optional[float]:
    """The timeout in seconds, or ``None`` when the watchdog is off."""
    return _timeout if _timeout is not None else _timeout_setting()


@read_once
def _timeout_setting() -> Optional[float]:
    """``TIMEOUT_ENV`` in seconds; ``None`` when unset or 0 (read once: every collective asks)."""
    value = os.environ.get(TIMEOUT_ENV, "")
    return float(value) if value not in ("", "0") else None


class ArrivalCounter:
    """How many collectives this rank has entered on ``comm``, and (at ``MPI_THREAD_MULTIPLE``)
    a private duplicate of ``comm`` on which the ranks ask each other for their counts.
    Collective to create and to free."""

    def __init__(self, comm: MPI.Intracomm, name: str) -> None:
        self.comm, self.name = comm, name
        self.ranks = world_ranks(comm)
        self.count = 0
        self.level = min(capabilities.thread_levels(comm))   # agreed: all ranks Dup or none
        self.queries: Optional[MPI.Intracomm] = (
            communicators.duplicate(comm) if self.level == MPI.THREAD_MULTIPLE else None)
        self._query = np.zeros(1, dtype=np.int64)
        self._sends: List[Tuple[MPI.Request, np.ndarray]] = []

    def serve(self) -> None:
        """Answer the queries that have arrived, with this rank's count. Local."""
        self._sends = [(r, b) for r, b in self._sends if not r.Test()]
        status = MPI.Status()
        while self.queries is not None and self.queries.Iprobe(MPI.ANY_SOURCE, _QUERY, status):
            source = status.Get_source()
            self.queries.Recv(self._query, source, _QUERY)
            self._send(source, _ANSWER)
            _say(f"asked by rank {source} of communicator {self.name} about a stalled "
                 f"collective; this rank has entered {self.count} collectives there. Its last "
                 f"operations, oldest first:\n{trace.describe_recent()}")

    def _send(self, rank: int, tag: int) -> None:
        """Send this rank's count without waiting (the buffer is kept until it has gone)."""
        buffer = np.array([self.count], dtype=np.int64)
        self._sends.append((self.queries.Isend(buffer, rank, tag), buffer))

    def counts(self, deadline: float) -> List[Optional[int]]:
        """Every rank's count, asked for by messages; ``None`` for a rank that did not answer
        by ``deadline`` (``time.monotonic()``). Needs the other ranks' watchdog threads; keeps
        answering their queries meanwhile."""
        size, me = self.comm.Get_size(), self.comm.Get_rank()
        answers = np.full(size, -1, dtype=np.int64)
        pending: Dict[int, MPI.Request] = {}
        with _lock:
            for rank in range(size):
                if rank != me:
                    pending[rank] = self.queries.Irecv(answers[rank:rank + 1], rank, _ANSWER)
                    self._send(rank, _QUERY)
        answers[me] = self.count
        while pending and time.monotonic() < deadline:
            serve_all()
            pending = {rank: r for rank, r in pending.items() if not r.Test()}
            time.sleep(POLL_SECONDS / 10)
        for request in pending.values():    # no late answer lands in ``answers`` once returned
            request.Cancel()
            request.Wait()
        return [None if rank in pending else int(answers[rank]) for rank in range(size)]

    def free(self) -> None:
        """Free the private duplicate. Collective."""
        if self.queries is not None:
            queries, self.queries = self.queries, None
            communicators.free(queries)


def world_ranks(comm: MPI.Comm) -> Tuple[int, ...]:
    """The ``MPI.COMM_WORLD`` ranks of ``comm``'s ranks, in its rank order. Local."""
    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return tuple(MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world))
    finally:
        group.Free()
        world.Free()


class _Watch:
    """The watchdog's view of one blocking collective on ``comm`` while it runs, around the
    context ``within`` (the collective's trace entry); ``counter`` counts it (``None``: no
    watched communicator has these ranks)."""

    __slots__ = ("operation", "comm", "counter", "within", "number", "started")

    def __init__(self, operation: str, comm: MPI.Intracomm, counter: Optional[ArrivalCounter],
                 within: ContextManager) -> None:
        self.operation, self.comm, self.counter, self.within = operation, comm, counter, within

    def __enter__(self) -> None:
        if self.counter is not None:
            self.counter.count += 1
            self.number = self.counter.count
        else:
            self.number = 0
        self.started = time.monotonic()
        _running.add(self)
        self.within.__enter__()

    def __exit__(self, *exc: object) -> None:
        try:
            self.within.__exit__(*exc)
        finally:
            _running.discard(self)


_lock = threading.RLock()      # held while serving, and while a counter leaves the table
_counters: Dict[int, ArrivalCounter] = {}
_running: Set[_Watch] = set()
_stop = threading.Event()
_thread: Optional[threading.Thread] = None


def serve_all() -> None:
    """Answer the count queries that have arrived on every watched communicator. Local."""
    with _lock:
        for handle, counter in list(_counters.items()):
            try:
                counter.serve()
            except MPI.Exception as error:   # a lost rank: the collectives report it, and the
                if not fault_tolerance.is_process_failure(error):   # survivors rebuild
                    raise
                _counters.pop(handle, None)


def _run() -> None:
    while not _stop.wait(POLL_SECONDS):
        serve_all()
        limit = timeout()
        now = time.monotonic()
        for watch in list(_running):
            if limit and now - watch.started > limit:
                _report_and_abort(watch, limit)


def _report_and_abort(watch: _Watch, limit: float) -> None:
    counter = watch.counter
    if counter is None:
        ranks = ("the ranks not arrived cannot be named: no communicator of the library's "
                 "process groups has these ranks, and the watchdog counts collectives only there")
    elif counter.queries is None:
        ranks = (f"the ranks not arrived cannot be named at thread level "
                 f"{thread_level_name(counter.level)} (the watchdog needs MPI_THREAD_MULTIPLE "
                 "to ask them)")
    else:
        counts = counter.counts(time.monotonic() + ANSWER_SECONDS)
        missing = [r for r, c in enumerate(counts) if c is not None and c < watch.number]
        silent = [r for r, c in enumerate(counts) if c is None]
        ranks = (f"ranks not arrived: {missing or 'none'}"
                 + (f"; ranks not answering: {silent}" if silent else ""))
    if counter is not None and watch.comm.handle == counter.comm.handle:
        where = counter.name
    else:
        where = trace.communicator_name(watch.comm) + (
            "" if counter is None else f" (counted with {counter.name})")
    number = "" if counter is None else f" (collective #{watch.number})"
    _say(f"collective timeout: {watch.operation}{number} on communicator {where} of "
         f"{watch.comm.Get_size()} ranks has waited "
         f"{time.monotonic() - watch.started:.0f} s (limit {limit:g} s); {ranks}. Aborting the "
         f"job. This rank's last operations, oldest first:\n{trace.describe_recent()}")
    MPI.COMM_WORLD.Abort(3)


def _say(text: str) -> None:
    """Write ``text`` to standard error at once, each line after this rank's number."""
    prefix = f"[rank {MPI.COMM_WORLD.Get_rank()}] "
    sys.stderr.write("".join(prefix + line + "\n" for line in text.rstrip("\n").split("\n")))
    sys.stderr.flush()


def _stop_thread() -> None:
    # Before MPI is finalized at exit: the thread must not be inside an MPI call then.
    _stop.set()
    if _thread is not None:
        _thread.join()


def _start() -> None:
    """Start the thread, once, and keep the trace's ring of recent operations for its reports.
    Local."""
    global _thread
    with _lock:
        if _thread is None:
            trace.keep_recent()
            _thread = threading.Thread(target=_run, name="tensorplay_hpc-watchdog", daemon=True)
            _thread.start()
            atexit.register(_stop_thread)


def register(comm: MPI.Intracomm, name: str) -> Optional[ArrivalCounter]:
    """Watch the collectives on ``comm`` if the watchdog is on (and start the thread).
    Collective."""
    if timeout() is None:
        return None
    counter = ArrivalCounter(comm, name)
    with _lock:
        _counters[comm.handle] = counter
    _start()
    return counter


def unregister(comm: MPI.Intracomm) -> None:
    """Stop watching ``comm`` and free its private duplicate. Collective."""
    with _lock:     # once out of the table, no thread serves queries on it
        counter = _counters.pop(comm.handle, None)
    if counter is not None:     # outside the lock, which the thread needs to abort a stalled free
        counter.free()


def forget(comm: MPI.Intracomm) -> None:
    """Stop watching ``comm``, leaving its private duplicate to ``MPI_Finalize``. Local: safe
    where ranks are not in step (an object's collection); takes no lock."""
    _counters.pop(comm.handle, None)


_UNWATCHED = nullcontext()


def watched(operation: str, comm: MPI.Intracomm,
            within: ContextManager = _UNWATCHED, counted: bool = True) -> ContextManager:
    """A context in which to run a blocking collective on ``comm`` under the watchdog, entering
    ``within`` (the collective's trace entry) inside it; while the watchdog is off, ``within``
    itself, so that an unwatched collective pays for one context only. The first collective
    watched starts the watchdog's thread, even before any process group exists.
    ``counted=False``: not every rank of ``comm`` takes part (``Create_group``), so the call is
    not counted, and only aborted on time. Waits first for the calls queued to ``comm``'s
    worker (:func:`.worker.settle`), so that it follows them on every rank."""
    worker.settle(comm)
    if fault_tolerance.enabled():
        within = fault_tolerance.surfacing(operation, comm, within)
    if _thread is None:
        if timeout() is None:
            return within
        _start()
    counter = _counters.get(comm.handle) if counted else None
    if counter is None and counted:
        counter = _counter_with_ranks(comm)
    return _Watch(operation, comm, counter, within)


def _counter_with_ranks(comm: MPI.Intracomm) -> Optional[ArrivalCounter]:
    """The counter of a watched communicator with the same ranks as ``comm``, if any."""
    ranks = world_ranks(comm)
    return next((c for c in list(_counters.values()) if c.ranks == ranks), None)
