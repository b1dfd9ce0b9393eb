"""A served window: :class:`~.window.Window`'s interface where MPI has no one-sided support
between the ranks (Open MPI 4.1 over TCP between nodes).

Each rank's memory is an ordinary local tensor. A service thread per rank and window answers the
other ranks' requests (lock, unlock, get, put, accumulate, flush) with point-to-point messages on
a private duplicate of the communicator, so the owner's application thread takes no part: it may
compute without calling MPI. Headers are small int64 arrays; data moves as flat tensor memory
(:func:`tensorplay_hpc.comm.staging.memory`), split into chunks like :class:`~.window.Window`'s.
Threads of one process call MPI concurrently, so this needs ``MPI_THREAD_MULTIPLE``.

Locks are real: :meth:`ServedWindow.locked` returns only once the target's
:class:`~.locks.LockManager` has granted the lock, and the owner's own accesses take the same
lock manager locally. A rank's requests to one target are served in the order it sent them, and
each operation of a client completes before its next one starts, so the operations of an epoch
have completed at the target when its unlock is acknowledged. A get has completed when it returns,
so a flush costs a round trip only after a put or accumulate.

Unlike MPI's windows, a served window survives a lost rank when recovery is on
(:mod:`tensorplay_hpc.comm.fault_tolerance`): a service thread that sees the loss revokes the
window's communicators and stops, a client's wait for a reply fails, and a wait for a lock
that the lost rank held ends, each with ``RankLost``; the survivors then go on without the
window.

Replies and the data of gets travel on a second duplicate, on which only the client receives, and
every waiting thread polls a pending receive with growing sleeps instead of waiting in a blocking
MPI call, which spins: with more ranks than cores, clients spinning while they wait for a lock
starve the owner's service thread and the rank that holds the lock.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Set, Tuple

import numpy as np
import torch

from tensorplay_hpc import comm
from tensorplay_hpc.comm import chunking, fault_tolerance, library, staging, trace
from tensorplay_hpc.comm.dtypes import move_datatype
from tensorplay_hpc.comm.mpi import MPI
from tensorplay_hpc.comm.small_collectives import all_gather_object, barrier

from .layout import view_at
from .locks import LockManager
from .thread_failure import end_job
from .window import check_accumulable, check_transferable

__all__ = ["HEADER", "ServedWindow"]

# Message tags. To a service (on the window's communicator): requests and the data of puts; back
# to a client (on its reply communicator): replies and the data of gets.
REQUEST, REPLY, TO_SERVICE, TO_CLIENT = 1, 2, 3, 4
LOCK_SHARED, LOCK_EXCLUSIVE, UNLOCK, GET, PUT, ACCUMULATE, FLUSH, STOP = range(8)
HEADER = 6  # operation, byte offset, elements, dtype code, chunk limit, reduction code
_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
_REDUCTIONS = (("SUM", torch.Tensor.add_), ("REPLACE", torch.Tensor.copy_),
               ("PROD", torch.Tensor.mul_),
               ("MAX", lambda target, value: torch.maximum(target, value, out=target)),
               ("MIN", lambda target, value: torch.minimum(target, value, out=target)))
_LOCAL = -1  # the holder name of this rank's own application thread
_IDLE_WAIT = (2e-5, 1e-3)  # a waiting thread's polling interval grows between these
_EAGER_POLL = 5e-5  # a client polls without sleeping this long first (a reply is often quick)


def _poll(ready: Callable[[], bool], eager: float = 0.0) -> None:
    """Call ``ready`` until it returns true: without sleeping for ``eager`` seconds, then with
    sleeps that grow from 20 µs to 1 ms, so that a waiting thread leaves the cores to threads
    with work."""
    deadline = time.perf_counter() + eager
    while time.perf_counter() < deadline:
        if ready():
            return
    wait = _IDLE_WAIT[0]
    while not ready():
        time.sleep(wait)
        wait = min(wait * 2, _IDLE_WAIT[1])


def _reduction_code(op: MPI.Op) -> int:
    for code, (known, _) in enumerate(_REDUCTIONS):
        if op == getattr(MPI, known):
            return code
    raise TypeError("a served window accumulates with MPI.SUM, REPLACE, PROD, MAX or MIN only")


class ServedWindow:
    """``nbytes`` of this rank's memory, reachable by every rank of ``communicator`` through
    this rank's service thread.

    Collective: every rank of ``communicator`` constructs it (``nbytes`` may differ, or be 0), and
    :meth:`free` s it.
    """

    shared_memory = False

    def __init__(self, communicator: MPI.Intracomm, nbytes: int) -> None:
        self._group = comm.ProcessGroup(communicator, owner="ServedWindow")
        self._comm = self._group.comm
        self.rank = self._group.rank
        self._replies_group = comm.ProcessGroup(communicator, owner="ServedWindow replies")
        self._replies = self._replies_group.comm
        self._comm_name = trace.communicator_name(self._comm)
        self._sizes = all_gather_object(nbytes, self._comm)
        self.local = torch.empty(nbytes, dtype=torch.uint8)
        self._locks = LockManager()
        self._writing: Set[int] = set()  # ranks with puts or accumulates not acknowledged yet
        self._accumulating = threading.Lock()  # accumulates are atomic with respect to each other
        self._service = threading.Thread(target=self._serve, daemon=True,
                                         name=f"rma-served-window-rank{self.rank}")
        self._service.start()

    # The client side: this rank's application thread.

    def _send(self, rank: int, operation: int, offset: int = 0,
              tensor: Optional[torch.Tensor] = None, reduction: int = 0) -> None:
        header = np.zeros(HEADER, dtype=np.int64)
        header[:2] = operation, offset
        if tensor is not None:
            header[2:5] = tensor.numel(), _DTYPES.index(tensor.dtype), chunking.chunk_elements()
        header[5] = reduction
        with fault_tolerance.surfacing(f"a request to rank {rank}'s served window", self._comm):
            self._comm.Send([header, MPI.INT64_T], rank, REQUEST)

    def _receive(self, buffer: list, rank: int, tag: int) -> None:
        """Receive a reply or get data from ``rank``'s service, polling."""
        with fault_tolerance.surfacing(f"a reply from rank {rank}'s served window",
                                       self._replies):
            _poll(self._replies.Irecv(buffer, rank, tag).Test, _EAGER_POLL)

    def _await(self, rank: int) -> None:
        self._receive([np.empty(1, dtype=np.int64), MPI.INT64_T], rank, REPLY)

    def _checked(self, tensor: torch.Tensor, rank: int, offset: int) -> torch.Tensor:
        """``rank``'s bytes that ``tensor`` covers from ``offset``, once checked (a view when
        ``rank`` is this one)."""
        check_transferable(tensor, self.rank)
        end = offset + tensor.numel() * tensor.element_size()
        if not 0 <= offset <= end <= self._sizes[rank]:
            raise ValueError(f"rank {self.rank}: bytes {offset}..{end} are outside rank {rank}'s "
                             f"{self._sizes[rank]} bytes of the window")
        return self.local[offset:end] if rank == self.rank else self.local[:0]

    def _stream(self, method, tensor: torch.Tensor, rank: int, tag: int) -> None:
        """Send or receive ``tensor``'s memory in chunks."""
        datatype = move_datatype(tensor.dtype)
        with fault_tolerance.surfacing(f"data for rank {rank}'s served window", self._comm):
            for start, count in chunking.chunks(tensor.numel()):
                method([staging.memory(tensor, start, count), count, datatype], rank, tag)

    def get(self, tensor: torch.Tensor, rank: int, offset: int) -> None:
        """Read ``rank``'s bytes from ``offset`` into ``tensor`` (done when it returns)."""
        local = self._checked(tensor, rank, offset)
        if rank == self.rank:
            tensor.view(-1).view(torch.uint8).copy_(local)
            return
        with trace.rma(f"get from rank {rank}", self._comm_name, tensor.nbytes):
            self._send(rank, GET, offset, tensor)
            self._stream(self._receive, tensor, rank, TO_CLIENT)

    def put(self, tensor: torch.Tensor, rank: int, offset: int) -> None:
        """Write ``tensor`` into ``rank``'s bytes from ``offset``; complete at the target once
        the epoch ends or is flushed."""
        local = self._checked(tensor, rank, offset)
        if rank == self.rank:
            local.copy_(tensor.view(-1).view(torch.uint8))
            return
        with trace.rma(f"put to rank {rank}", self._comm_name, tensor.nbytes):
            self._send(rank, PUT, offset, tensor)
            self._stream(self._comm.Send, tensor, rank, TO_SERVICE)
        self._writing.add(rank)

    def accumulate(self, tensor: torch.Tensor, rank: int, offset: int,
                   op: Optional[MPI.Op] = None) -> None:
        """Combine ``tensor`` into ``rank``'s values at ``offset`` with ``op``, atomically with
        respect to other accumulates; complete at the target once the epoch ends or is flushed.
        16-bit floats must be converted to their reduction dtype first, as for MPI windows."""
        local = self._checked(tensor, rank, offset)
        check_accumulable(tensor, self.rank)
        code = _reduction_code(MPI.SUM if op is None else op)
        if rank == self.rank:
            self._combine(local, tensor.view(-1), code)
            return
        with trace.rma(f"accumulate to rank {rank}", self._comm_name, tensor.nbytes):
            self._send(rank, ACCUMULATE, offset, tensor, code)
            self._stream(self._comm.Send, tensor, rank, TO_SERVICE)
        self._writing.add(rank)

    def _combine(self, memory: torch.Tensor, values: torch.Tensor, code: int) -> None:
        with self._accumulating:
            _REDUCTIONS[code][1](memory.view(values.dtype), values)

    @contextmanager
    def locked(self, rank: int, exclusive: bool = False) -> Iterator[None]:
        """An epoch on ``rank``, entered once ``rank``'s lock is granted: operations started
        inside have completed at the target when the block ends. ``rank`` takes no part."""
        with trace.rma(f"{'exclusive' if exclusive else 'shared'} epoch on rank {rank}",
                       self._comm_name, 0):
            if rank == self.rank:
                self._locks.acquire(_LOCAL, exclusive)
            else:
                self._send(rank, LOCK_EXCLUSIVE if exclusive else LOCK_SHARED)
                self._await(rank)
            try:
                yield
            finally:
                if rank == self.rank:
                    self._locks.release(_LOCAL)
                else:
                    self._send(rank, UNLOCK)
                    self._await(rank)
                    self._writing.discard(rank)

    def flush(self, rank: int) -> None:
        """Complete the operations started on ``rank`` in the current epoch: a round trip if
        puts or accumulates were sent since the last one (gets are complete already)."""
        if rank in self._writing:
            with trace.rma(f"flush rank {rank}", self._comm_name, 0):
                self._send(rank, FLUSH)
                self._await(rank)
            self._writing.discard(rank)

    def sync(self) -> None:
        """Nothing to order: local memory is only reached through this process's locks."""

    def view(self, offset: int, shape: Tuple[int, ...], dtype: torch.dtype,
             rank: Optional[int] = None) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` viewing this rank's memory from byte ``offset``
        (other ranks' memory cannot be seen)."""
        if rank is not None and rank != self.rank:
            raise RuntimeError(f"rank {self.rank} cannot see rank {rank}'s window memory: the "
                               "window is served, not in shared memory")
        return view_at(self.local, offset, shape, dtype)

    def free(self) -> None:
        """Stop the service and release the memory. Collective; every rank's epochs must have
        ended."""
        if self._service.is_alive():
            barrier(self._comm)  # nobody sends requests any more
            self._send(self.rank, STOP)
            self._service.join()
        self.local = torch.empty(0, dtype=torch.uint8)
        self._replies_group.close()
        self._group.close()

    def abandon(self) -> None:
        """After a lost rank: revoke the window's communicators and wait for the service
        thread to stop (the memory and communicators are left to ``MPI_Finalize``). Local;
        call it before shrinking, so that no thread of this window is inside MPI then."""
        fault_tolerance.revoke([self._comm, self._replies])
        self._service.join()

    # The service thread.

    def _serve(self) -> None:
        try:
            self._serve_requests()
        except MPI.Exception as error:
            if not (fault_tolerance.enabled() and fault_tolerance.is_process_failure(error)):
                end_job("the served window's service thread")
                return
            # The survivors recover without this window: every rank's clients and waits for a
            # lock here raise RankLost. (Not every communicator: the main thread may have
            # shrunk the job already, and made new ones.)
            fault_tolerance.revoke([self._comm, self._replies])
            self._locks.break_all(fault_tolerance.RankLost(
                [], f"the lock of a served window on rank {self.rank}", error.Get_error_string()))
        except BaseException:  # a client waiting on this rank would wait forever
            end_job("the served window's service thread")

    def _serve_requests(self) -> None:
        header = np.empty(HEADER, dtype=np.int64)
        status = MPI.Status()
        while True:
            self._receive_request(header, status)
            operation, offset, numel, dtype, limit, reduction = (int(v) for v in header)
            source = status.Get_source()
            if operation == STOP:
                return
            if operation in (LOCK_SHARED, LOCK_EXCLUSIVE):
                self._locks.request(source, operation == LOCK_EXCLUSIVE,
                                    lambda source=source: self._reply(source))
            elif operation == UNLOCK:
                self._locks.release(source)
                self._reply(source)
            elif operation == FLUSH:
                self._reply(source)  # every earlier request of this source has been served
            else:
                self._transfer(operation, source, offset, numel, _DTYPES[dtype], limit, reduction)

    def _receive_request(self, header: np.ndarray, status: MPI.Status) -> None:
        """Wait for the next request, polling with growing sleeps: a pending receive from any
        rank, or, where the library may never complete one
        (:func:`~tensorplay_hpc.comm.library.pending_wildcard_receive_stalls`), a probe, then a
        receive from the rank found (only this thread receives requests)."""
        if library.pending_wildcard_receive_stalls():
            _poll(lambda: self._comm.Iprobe(MPI.ANY_SOURCE, REQUEST, status))
            self._comm.Recv([header, MPI.INT64_T], status.Get_source(), REQUEST, status)
            return
        request = self._comm.Irecv([header, MPI.INT64_T], MPI.ANY_SOURCE, REQUEST)
        _poll(lambda: request.Test(status))

    def _reply(self, rank: int) -> None:
        self._replies.Send([np.zeros(1, dtype=np.int64), MPI.INT64_T], rank, REPLY)

    def _transfer(self, operation: int, source: int, offset: int, numel: int,
                  dtype: torch.dtype, limit: int, reduction: int) -> None:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        memory = self.local[offset:offset + nbytes]
        if operation == GET:
            method, buffer, tag = self._replies.Send, memory.view(dtype), TO_CLIENT
        elif operation == PUT:
            method, buffer, tag = self._comm.Recv, memory.view(dtype), TO_SERVICE
        else:
            method, buffer, tag = self._comm.Recv, torch.empty(numel, dtype=dtype), TO_SERVICE
        datatype = move_datatype(dtype)
        for start, count in chunking.chunks(numel, limit):
            method([staging.memory(buffer, start, count), count, datatype], source, tag)
        if operation == ACCUMULATE:
            self._combine(memory, buffer, reduction)
