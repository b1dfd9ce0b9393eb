"""A watchdog for collectives: one that waits longer than a timeout is reported (which
operation, on which communicator, which ranks have not arrived) and the job is aborted.

Enabled by ``TENSORPLAY_HPC_COLLECTIVE_TIMEOUT`` (seconds) or :func:`enable`. Each
:class:`~.group.ProcessGroup` made while it is enabled publishes, in a one-integer MPI window,
how many collectives this rank has entered on it; when a collective stalls, a background thread
reads every rank's count (passive one-sided ``Get``: the other ranks need not cooperate) and
names the ranks whose count is behind.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import nullcontext
from typing import ContextManager, Dict, List, Optional

import numpy as np
from mpi4py import MPI

TIMEOUT_ENV = "TENSORPLAY_HPC_COLLECTIVE_TIMEOUT"
_timeout: Optional[float] = None


def enable(timeout: float) -> None:
    """Watch every collective of process groups made from now on; abort after ``timeout`` s."""
    global _timeout
    if timeout <= 0:
        raise ValueError(f"the collective timeout must be positive, got {timeout}")
    _timeout = float(timeout)


def timeout() -> Optional[float]:
    """The timeout in seconds, or ``None`` when the watchdog is off."""
    if _timeout is not None:
        return _timeout
    value = os.environ.get(TIMEOUT_ENV, "")
    return float(value) if value not in ("", "0") else None


class ArrivalCounter:
    """How many collectives each rank of ``comm`` has entered, readable by any rank. Collective
    to create and to free."""

    def __init__(self, comm: MPI.Intracomm, name: str) -> None:
        self.comm, self.name = comm, name
        self.window = MPI.Win.Allocate(8, 8, comm=comm)
        self.count = np.frombuffer(self.window.tomemory(), dtype=np.int64)
        self.count[0] = 0
        comm.Barrier()

    def counts(self, deadline: float) -> List[Optional[int]]:
        """Every rank's count, read one-sidedly; ``None`` for a rank that did not answer."""
        result: List[Optional[int]] = []
        for rank in range(self.comm.Get_size()):
            value = np.zeros(1, dtype=np.int64)
            self.window.Lock(rank, MPI.LOCK_SHARED)
            request = self.window.Rget(value, rank)
            while not request.Test() and time.monotonic() < deadline:
                time.sleep(0.01)
            self.window.Unlock(rank)
            result.append(int(value[0]) if request.Test() else None)
        return result

    def free(self) -> None:
        self.window.Free()


class _Watchdog(threading.Thread):
    """The background thread: one per process, started on first use."""

    def __init__(self) -> None:
        super().__init__(name="tensorplay_hpc-watchdog", daemon=True)
        self.lock = threading.Lock()
        self.current = None    # (operation, counter, count, started)

    def run(self) -> None:
        while True:
            limit = timeout()
            time.sleep(min(1.0, (limit or 10.0) / 10))
            with self.lock:
                current = self.current
            if current and limit and time.monotonic() - current[3] > limit:
                self.report_and_abort(*current, limit)

    def report_and_abort(self, operation: str, counter: ArrivalCounter, count: int,
                         started: float, limit: float) -> None:
        rank = MPI.COMM_WORLD.Get_rank()
        counts = counter.counts(time.monotonic() + 5.0)
        missing = [r for r, c in enumerate(counts) if c is not None and c < count]
        silent = [r for r, c in enumerate(counts) if c is None]
        sys.stderr.write(
            f"[rank {rank}] collective timeout: {operation} (collective #{count}) on "
            f"communicator {counter.name} of {counter.comm.Get_size()} ranks has waited "
            f"{time.monotonic() - started:.0f} s (limit {limit:g} s); ranks not arrived: "
            f"{missing or 'none'}" + (f"; ranks not answering: {silent}" if silent else "")
            + ". Aborting the job.\n")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(3)


_thread: Optional[_Watchdog] = None
_counters: Dict[int, ArrivalCounter] = {}


def register(comm: MPI.Intracomm, name: str) -> Optional[ArrivalCounter]:
    """Watch the collectives on ``comm`` if the watchdog is on. Collective."""
    if timeout() is None:
        return None
    counter = ArrivalCounter(comm, name)
    _counters[comm.handle] = counter
    return counter


def unregister(comm: MPI.Intracomm) -> None:
    """Stop watching ``comm`` and free its window. Collective."""
    counter = _counters.pop(comm.handle, None)
    if counter is not None:
        counter.free()


class _Watch:
    """The watchdog's view of one blocking collective while it runs."""

    def __init__(self, operation: str, counter: ArrivalCounter) -> None:
        self.operation, self.counter = operation, counter

    def __enter__(self) -> None:
        global _thread
        if _thread is None:
            _thread = _Watchdog()
            _thread.start()
        self.counter.count[0] += 1
        with _thread.lock:
            _thread.current = (self.operation, self.counter, int(self.counter.count[0]),
                               time.monotonic())

    def __exit__(self, *exc: object) -> None:
        with _thread.lock:
            _thread.current = None


_UNWATCHED = nullcontext()


def watched(operation: str, comm: MPI.Intracomm) -> ContextManager[None]:
    """A context in which to run a blocking collective on ``comm`` under the watchdog (a shared
    no-op for a communicator that is not watched)."""
    counter = _counters.get(comm.handle) if _counters else None
    return _UNWATCHED if counter is None else _Watch(operation, counter)
