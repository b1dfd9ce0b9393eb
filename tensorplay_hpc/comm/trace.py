"""A record of what this rank communicates: every collective and one-sided (RMA) operation, with
its start, end, bytes, communicator and caller (a DDP bucket, ZeroRedundancyOptimizer's sync,
model averaging, a checkpoint...), and the compute spans that the training job marks.

Every operation's bytes are counted. While the watchdog watches, the last :data:`RECENT`
operations are also recorded, in a ring, so that it can say what each rank was doing when a job
stalled; otherwise nothing is recorded, which spares each collective the cost of a record. With
``TENSORPLAY_HPC_TRACE=DIR`` (or :func:`enable`) every operation is recorded and kept, and
:func:`write` saves them as Chrome trace JSON, which Perfetto (ui.perfetto.dev) and
``chrome://tracing`` open: ``DIR/trace-rank<R>.json`` on every rank and ``DIR/trace.json`` with
all ranks. A trace holds every operation of the run in memory: it is meant for runs of minutes,
not days.
"""
from __future__ import annotations

import atexit
import contextvars
import json
import os
import threading
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from time import perf_counter
from typing import Any, Deque, Dict, Iterator, List, Optional, Union

from .mpi import MPI

__all__ = ["MERGED_FILE", "Operation", "RECENT", "Record", "TRACE_ENV", "UNRECORDED",
           "bytes_communicated", "caller", "chrome_events", "collective", "communicator_name",
           "describe_recent", "directory", "disable", "enable", "keep_recent", "rank_file",
           "recent", "rma", "span", "write"]

TRACE_ENV = "TENSORPLAY_HPC_TRACE"
RECENT = 16
"""How many of the latest operations each rank keeps for the watchdog's report."""
MERGED_FILE = "trace.json"

_caller: contextvars.ContextVar[str] = contextvars.ContextVar("tensorplay_hpc_caller", default="")
_recent: Deque["Operation"] = deque(maxlen=RECENT)
_kept: Optional[List["Operation"]] = None
_ring_kept = False      # set once the watchdog watches
_recording = False      # the ring or the trace is kept: operations are recorded at all
_directory: Optional[Path] = None
_written = False


class _ThreadState:
    """A thread's name, looked up once, and the bytes its operations have handed to MPI
    (counted by the thread alone, so without a lock)."""

    __slots__ = ("thread", "name", "communicated")

    def __init__(self, thread: threading.Thread) -> None:
        self.thread, self.name, self.communicated = thread, thread.name, 0


_threads: List[_ThreadState] = []   # the states of the threads alive when the last one began
_finished = [0]                      # the bytes of the threads that have ended since
_threads_lock = threading.Lock()


class _Local(threading.local):
    """``state``: the calling thread's :class:`_ThreadState`, made on the thread's first use."""

    def __init__(self) -> None:
        self.state = state = _ThreadState(threading.current_thread())
        with _threads_lock:     # ended threads count no more: fold them into one total
            ended = [s for s in _threads if not s.thread.is_alive()]
            _finished[0] += sum(s.communicated for s in ended)
            _threads[:] = [s for s in _threads if s not in ended] + [state]


_local = _Local()


class Operation:
    """One recorded operation: a context manager that stamps its start and end.

    ``kind`` is ``"collective"``, ``"rma"``, ``"compute"`` or ``"io"``. A nonblocking operation
    (``asynchronous``) ends when its request completes (:meth:`finish`), not with the block.
    """

    __slots__ = ("name", "kind", "comm", "nbytes", "caller", "thread", "asynchronous", "start",
                 "end")

    def __init__(self, name: str, kind: str, comm: str, nbytes: int, asynchronous: bool,
                 thread: str) -> None:
        self.name, self.kind, self.comm, self.nbytes = name, kind, comm, nbytes
        self.asynchronous, self.thread = asynchronous, thread
        self.caller = _caller.get()
        self.end: Optional[float] = None   # ``start`` is stamped on entry

    def __enter__(self) -> "Operation":
        self.start = perf_counter()
        _recent.append(self)
        if _kept is not None:
            _kept.append(self)
        return self

    def __exit__(self, kind: object, value: object, traceback: object) -> None:
        if not self.asynchronous or kind is not None:
            self.end = perf_counter()

    def finish(self) -> None:
        """Stamp the end of a nonblocking operation (when its requests have completed)."""
        if self.end is None:
            self.end = perf_counter()

    def describe(self, now: float) -> str:
        """One line: what, how many bytes, where, for whom, and how long."""
        where = f" on {self.comm}" if self.comm else ""
        size = f" {_bytes(self.nbytes)}" if self.kind in ("collective", "rma") else ""
        caller = f" for {self.caller}" if self.caller else ""
        when = (f"running for {now - self.start:.3f} s" if self.end is None else
                f"took {(self.end - self.start) * 1e3:.3f} ms, ended {now - self.end:.3f} s ago")
        return f"{self.name}{size}{where}{caller} [{self.thread}]: {when}"


class _Unrecorded:
    """Stands in for an operation while nothing is recorded: enters, exits and finishes at no
    cost."""

    __slots__ = ()

    def __enter__(self) -> "_Unrecorded":
        return self

    def __exit__(self, kind: object, value: object, traceback: object) -> None:
        return None

    def finish(self) -> None:
        return None


UNRECORDED = _Unrecorded()
Record = Union[Operation, _Unrecorded]
"""What :func:`collective`, :func:`rma` and :func:`span` return."""


def _bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    return f"{n / 1024:.1f} KiB" if n < 1 << 20 else f"{n / (1 << 20):.1f} MiB"


def communicator_name(comm: MPI.Comm) -> str:
    """How a trace names ``comm``: its MPI name (a process group names its duplicate after the
    user's communicator and its size), else its size."""
    return comm.Get_name() or f"unnamed communicator of {comm.Get_size()} ranks"


def bytes_communicated() -> int:
    """Bytes of this rank's data handed to collectives and one-sided operations so far (the
    sizes that their trace entries record), by all threads, traced or not. Local."""
    with _threads_lock:
        return _finished[0] + sum(state.communicated for state in _threads)


def collective(name: str, comm: MPI.Comm, nbytes: int, asynchronous: bool = False) -> Record:
    """A collective on ``comm`` moving ``nbytes`` of this rank's data, to run in a ``with``
    block: counted always, recorded while the ring or the trace is kept. Local."""
    state = _local.state
    state.communicated += nbytes
    if not _recording:
        return UNRECORDED
    return Operation(name, "collective", communicator_name(comm), nbytes, asynchronous,
                     state.name)


def rma(name: str, comm_name: str, nbytes: int) -> Record:
    """A one-sided operation (or epoch) on a window over the communicator called ``comm_name``
    (:func:`communicator_name`), in a ``with`` block: counted always, recorded while the ring
    or the trace is kept. Local."""
    state = _local.state
    state.communicated += nbytes
    if not _recording:
        return UNRECORDED
    return Operation(name, "rma", comm_name, nbytes, False, state.name)


def span(name: str, kind: str = "compute") -> Record:
    """A span of other work, in a ``with`` block: ``"compute"`` (forward, backward, optimizer
    step) or ``"io"`` (a checkpoint). Local."""
    if not _recording:
        return UNRECORDED
    return Operation(name, kind, "", 0, False, _local.state.name)


@contextmanager
def caller(label: str) -> Iterator[None]:
    """Name the caller of the operations started inside (nested labels are joined by " / ").
    Threads started inside do not inherit it unless they run in a copy of the context
    (``contextvars.copy_context()``)."""
    outer = _caller.get()
    token = _caller.set(f"{outer} / {label}" if outer else label)
    try:
        yield
    finally:
        _caller.reset(token)


def recent() -> List[Operation]:
    """The latest operations of this rank, oldest first (at most :data:`RECENT`), recorded
    while the ring or the trace is kept."""
    return list(_recent)


def describe_recent() -> str:
    """:func:`recent` as indented lines, for an error report."""
    now = perf_counter()
    operations = recent()
    if not operations:
        return "  (no operations yet)\n"
    return "".join(f"  {operation.describe(now)}\n" for operation in operations)


def keep_recent() -> None:
    """Keep the ring of recent operations from now on (the watchdog's report). Local."""
    global _ring_kept, _recording
    _ring_kept = _recording = True


# -- the full trace ----------------------------------------------------------------------------

def enable(directory: os.PathLike) -> None:
    """Keep every operation from now on, to be written to ``directory`` by :func:`write` (or,
    without it, this rank's file alone when the process exits). Local."""
    global _kept, _directory, _written, _recording
    _directory = Path(directory)
    _written = False
    if _kept is None:
        _kept = []
    _recording = True


def disable() -> None:
    """Stop keeping operations for the trace, and forget those kept (the ring of recent ones
    stays, and is kept on if the watchdog watches). Local."""
    global _kept, _directory, _recording
    _kept, _directory = None, None
    _recording = _ring_kept


def directory() -> Optional[Path]:
    """Where the trace goes, or ``None`` when tracing is off."""
    return _directory


def _thread_ids(operations: List[Operation]) -> Dict[str, int]:
    ids: Dict[str, int] = {}
    for operation in operations:
        ids.setdefault(operation.thread, len(ids))
    return ids


def chrome_events(operations: List[Operation], rank: int, origin: float) -> List[Dict[str, Any]]:
    """``operations`` as Chrome trace events of process ``rank`` (microseconds from
    ``origin``, a ``perf_counter`` value), ordered by time after the naming metadata. A
    blocking operation is one complete ("X") event on its thread; a nonblocking one a
    begin/end pair ("b"/"e"), drawn on a track of its own since such operations overlap."""
    threads = _thread_ids(operations)
    meta: List[Dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "ts": 0, "pid": rank, "tid": 0,
         "args": {"name": f"rank {rank}"}},
        {"name": "process_sort_index", "ph": "M", "ts": 0, "pid": rank, "tid": 0,
         "args": {"sort_index": rank}}]
    meta += [{"name": "thread_name", "ph": "M", "ts": 0, "pid": rank, "tid": tid,
              "args": {"name": name}} for name, tid in threads.items()]
    timed: List[Dict[str, Any]] = []
    for number, op in enumerate(operations):
        end = op.end if op.end is not None else op.start
        base = {"name": op.name, "cat": op.kind, "pid": rank, "tid": threads[op.thread],
                "args": {"bytes": op.nbytes, "comm": op.comm, "caller": op.caller,
                         **({"unfinished": True} if op.end is None else {})}}
        start_us, end_us = (op.start - origin) * 1e6, (end - origin) * 1e6
        if op.asynchronous:
            timed.append({**base, "ph": "b", "id": number, "ts": start_us})
            timed.append({**base, "ph": "e", "id": number, "ts": end_us, "args": {}})
        else:
            timed.append({**base, "ph": "X", "ts": start_us, "dur": end_us - start_us})
    timed.sort(key=lambda event: event["ts"])
    return meta + timed


def _dump(events: List[Dict[str, Any]], path: Path, clock: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms",
                   "otherData": {"clock": clock}}, f)


def rank_file(folder: Path, rank: int) -> Path:
    """Where rank ``rank``'s own trace goes in ``folder``."""
    return folder / f"trace-rank{rank}.json"


def write(comm: Optional[MPI.Intracomm] = None) -> Optional[Path]:
    """Write the trace: every rank its own file, rank 0 also the merged one; return the merged
    file's path on rank 0 (``None`` elsewhere, and when tracing is off). Collective over
    ``comm`` (default ``MPI.COMM_WORLD``), whose ranks are the trace's processes.

    The ranks' clocks are aligned at a barrier taken here: time 0 is the earliest operation of
    any rank.

    Raises:
        RuntimeError: on every rank, when tracing is on for some ranks only (set
            ``TENSORPLAY_HPC_TRACE`` for every rank, e.g. ``mpiexec -x``).
    """
    global _written
    from . import small_collectives as small   # which records its collectives here
    comm = comm or MPI.COMM_WORLD
    operations = list(_kept or ())   # the trace ends before its own writing
    tracing = small.all_gather_object(_kept is not None, comm)
    if not any(tracing):
        return None
    if not all(tracing):
        raise RuntimeError(f"trace.write: tracing is on for ranks "
                           f"{[r for r, on in enumerate(tracing) if on]} only, of "
                           f"{len(tracing)} (rank {comm.Get_rank()}): enable it on every rank")
    small.barrier(comm)
    here = perf_counter()
    earliest = min((op.start for op in operations), default=here)
    lead = small.all_reduce_object(here - earliest, comm, MPI.MAX)
    rank = comm.Get_rank()
    events = chrome_events(operations, rank, here - lead)
    clock = "aligned at a barrier across ranks"
    _dump(events, rank_file(_directory, rank), clock)
    gathered = small.gather_object(events, comm)
    _written = True
    if rank != 0:
        return None
    merged = [e for part in gathered for e in part if e["ph"] == "M"]
    merged += sorted((e for part in gathered for e in part if e["ph"] != "M"),
                     key=lambda event: event["ts"])
    path = _directory / MERGED_FILE
    _dump(merged, path, clock)
    return path


def _write_at_exit() -> None:
    """This rank's file alone, on its own clock, when :func:`write` was not called."""
    if _written or _kept is None or _directory is None or not _kept:
        return
    rank = MPI.COMM_WORLD.Get_rank()
    _dump(chrome_events(list(_kept), rank, min(op.start for op in _kept)),
          rank_file(_directory, rank), "this rank's own (not aligned with other ranks)")


atexit.register(_write_at_exit)
if os.environ.get(TRACE_ENV):
    enable(os.environ[TRACE_ENV])
