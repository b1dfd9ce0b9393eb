"""A torch.distributed key-value ``Store`` whose keys live on one rank and travel over MPI.

c10d gives every process group a store (gloo meets its peers through it, user code can share
small values). This one needs no address, port or TCP server: rank 0 of the communicator keeps
the keys in a service thread that answers the other ranks' requests, which travel as small
pickled messages on a private communicator (never tensors). Requests for keys not set yet
(``get``, ``wait``) are answered when another rank sets them, or fail after the store's timeout.
The service needs ``MPI_THREAD_MULTIPLE``.
"""
from __future__ import annotations

import atexit
import itertools
import threading
import time
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

import torch.distributed as dist

from tensorplay_hpc.comm import fault_tolerance
from tensorplay_hpc.comm.small_collectives import barrier
from tensorplay_hpc.comm.group import ProcessGroup
from tensorplay_hpc.comm.mpi import MPI
from tensorplay_hpc.comm.polling import poll_until

__all__ = ["MPIStore"]

_REQUEST = 1
_FIRST_REPLY, _REPLY_TAGS = 2, 30000   # one tag per request in flight (MPI guarantees 32767)
_DEFAULT_TIMEOUT = timedelta(minutes=30)


def _poll(comm: MPI.Intracomm, source: int, tag: int, deadline: Optional[float],
          stop: Optional[threading.Event] = None) -> Optional[MPI.Status]:
    """Wait for a message without blocking inside MPI (the caller's thread keeps the GIL free
    and MPI's progress to the others): test, then sleep from 10 us up to 1 ms. ``None`` once
    ``deadline`` (a ``time.monotonic()`` value) passes or ``stop`` is set."""
    status = MPI.Status()
    found = poll_until(lambda: comm.Iprobe(source, tag, status), give_up=lambda: (
        (deadline is not None and time.monotonic() > deadline) or (stop and stop.is_set())))
    return status if found else None


class _Keeper:
    """The keys, on rank 0, and the thread that serves them."""

    def __init__(self, comm: MPI.Intracomm) -> None:
        self._comm = comm
        self._keys: Dict[str, bytes] = {}
        self._waiting: List[Tuple[int, int, str, List[str]]] = []   # source, tag, op, keys
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="tensorplay-store",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _serve(self) -> None:
        while True:
            try:
                status = _poll(self._comm, MPI.ANY_SOURCE, _REQUEST, None, self._stop)
            except MPI.Exception as error:
                if fault_tolerance.is_process_failure(error):   # a rank was lost: the job's
                    return                                       # survivors start a new store
                raise
            if status is None:
                return
            source = status.Get_source()
            tag, op, args = self._comm.recv(source=source, tag=_REQUEST)
            self._answer(source, tag, op, args)

    def _reply(self, source: int, tag: int, value: Any) -> None:
        self._comm.send(value, dest=source, tag=tag)

    def _answer(self, source: int, tag: int, op: str, args: tuple) -> None:
        keys = self._keys
        if op in ("get", "wait"):
            wanted = list(args)
            if all(k in keys for k in wanted):
                self._reply(source, tag, keys[wanted[0]] if op == "get" else None)
            else:
                self._waiting.append((source, tag, op, wanted))
            return
        if op == "set":
            key, value = args
            keys[key] = value
            self._reply(source, tag, None)
        elif op == "add":
            key, amount = args
            total = int(keys.get(key, b"0")) + amount
            keys[key] = str(total).encode()
            self._reply(source, tag, total)
        elif op == "compare_set":
            key, expected, desired = args
            current = keys.get(key)
            if (current is None and expected == b"") or current == expected:
                keys[key] = desired
                current = desired
            self._reply(source, tag, expected if current is None else current)
        elif op == "check":
            self._reply(source, tag, all(k in keys for k in args))
        elif op == "delete_key":
            self._reply(source, tag, keys.pop(args[0], None) is not None)
        elif op == "num_keys":
            self._reply(source, tag, len(keys))
        else:
            self._reply(source, tag, ValueError(f"store: unknown request {op!r}"))
        if op in ("set", "add", "compare_set"):
            self._wake()

    def _wake(self) -> None:
        """Answer the waiting requests whose keys are all set now."""
        still = []
        for source, tag, op, wanted in self._waiting:
            if all(k in self._keys for k in wanted):
                self._reply(source, tag, self._keys[wanted[0]] if op == "get" else None)
            else:
                still.append((source, tag, op, wanted))
        self._waiting = still


class MPIStore(dist.Store):
    """A ``Store`` over the ranks of ``process_group`` (default ``MPI.COMM_WORLD``), its keys
    kept by rank 0. Collective to construct; then each rank uses it on its own. ``close()``
    (collective) stops the service; otherwise it stops at interpreter exit."""

    def __init__(self, process_group: Optional[MPI.Intracomm] = None,
                 timeout: timedelta = _DEFAULT_TIMEOUT) -> None:
        super().__init__()
        self._group = ProcessGroup(process_group, owner="MPIStore")
        comm = self._group.comm
        provided = MPI.Query_thread()
        if provided < MPI.THREAD_MULTIPLE:
            raise RuntimeError(f"MPIStore needs MPI_THREAD_MULTIPLE; the MPI library granted "
                               f"level {provided} (rank {comm.Get_rank()})")
        self._timeout = timeout
        self._tags = itertools.count()
        self._lock = threading.Lock()
        self._keeper = _Keeper(comm) if comm.Get_rank() == 0 else None
        if self._keeper is not None:
            atexit.register(self._keeper.stop)

    # --- the requests -----------------------------------------------------------------------

    def _ask(self, op: str, *args: Any, timeout: Optional[timedelta] = None) -> Any:
        comm = self._group.comm
        with self._lock:
            tag = _FIRST_REPLY + next(self._tags) % _REPLY_TAGS
        comm.send((tag, op, args), dest=0, tag=_REQUEST)
        limit = (timeout or self._timeout).total_seconds()
        status = _poll(comm, 0, tag, time.monotonic() + limit if limit > 0 else None)
        if status is None:
            raise dist.DistStoreError(
                f"MPIStore: {op} {list(args)[:1]} timed out after {limit:g} s (rank "
                f"{comm.Get_rank()}): no rank set the key")
        answer = comm.recv(source=0, tag=tag)
        if isinstance(answer, Exception):
            raise answer
        return answer

    @staticmethod
    def _key(key: Any) -> str:
        return key.decode() if isinstance(key, bytes) else str(key)

    @staticmethod
    def _value(value: Any) -> bytes:
        return value.encode() if isinstance(value, str) else bytes(value)

    def set(self, key: str, value: Any) -> None:
        self._ask("set", self._key(key), self._value(value))

    def get(self, key: str) -> bytes:
        return self._ask("get", self._key(key))

    def add(self, key: str, amount: int) -> int:
        return self._ask("add", self._key(key), int(amount))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._ask("compare_set", self._key(key), self._value(expected),
                         self._value(desired))

    def wait(self, keys: List[str], timeout: Optional[timedelta] = None) -> None:
        self._ask("wait", *[self._key(k) for k in keys], timeout=timeout)

    def check(self, keys: List[str]) -> bool:
        return self._ask("check", *[self._key(k) for k in keys])

    def delete_key(self, key: str) -> bool:
        return self._ask("delete_key", self._key(key))

    def num_keys(self) -> int:
        return self._ask("num_keys")

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    @property
    def timeout(self) -> timedelta:
        return self._timeout

    def close(self) -> None:
        """Stop the service and free the communicator. Collective."""
        barrier(self._group.comm)   # no request is left in flight
        if self._keeper is not None:
            self._keeper.stop()
            atexit.unregister(self._keeper.stop)
            self._keeper = None
        self._group.close()
