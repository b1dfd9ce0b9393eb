"""Collectives on tensors over an mpi4py intracommunicator.

Every function here is collective: each rank of ``comm`` must call it, in the same order, with
matching sizes. Each takes ``async_op``: ``False`` completes the operation before returning,
``True`` returns a :class:`~tensorplay_hpc.comm.work.Work` to ``wait()`` on: the blocking call
queued to the communicator's :mod:`.worker` thread, or MPI's nonblocking calls where threads
cannot call MPI (errors in the arguments are then raised by ``wait()``). Messages longer than
the chunk limit (:mod:`.chunking`) are split into several MPI calls; results are the same.
"""
from __future__ import annotations

import functools
from typing import Callable, List, Optional, Sequence, TypeVar

import numpy as np
import torch
from .mpi import MPI
from torch._utils import _unflatten_dense_tensors

from . import trace, worker
from .chunking import chunk_elements, chunks, piece_elements
from .consistency import check_collective, debug_enabled
from .dtypes import ReduceOp, half_sum_op, is_half, reduce_dtype, reduce_op
from .flat_buffer import group_by_dtype_device, pack_by_dtype_device
from .small_collectives import all_gather_array
from .staging import Staged, direct_datatype, memory, needs_host_copy
from .watchdog import watched
from .work import Work, complete

__all__ = ["all_gather", "all_gather_v", "all_reduce", "all_reduce_coalesced", "all_to_all_v",
           "broadcast", "broadcast_coalesced", "gather", "reduce", "reduce_scatter",
           "scatter"]


C = TypeVar("C", bound=Callable)


def _queueable(collective: C) -> C:
    """``collective`` (which takes ``async_op`` by keyword), queued as a blocking call to its
    communicator's worker when started with ``async_op=True`` and :func:`.worker.in_thread`.
    The caller's CUDA streams are synchronized first: the worker's are not the caller's.

    A sum of 16-bit floats in their own type (``in_dtype``) stays with MPI's requests: its
    reduction is Python code that MPI calls back, which on a worker waits for the caller's
    interpreter lock while the caller waits for the MPI library's (Intel MPI holds one lock for
    the whole library): a deadlock."""
    @functools.wraps(collective)
    def call(*args, async_op: bool = False, **kwargs):
        if not async_op:   # the common case at once
            return collective(*args, **kwargs)
        if not worker.in_thread() or kwargs.get("in_dtype") and is_half(args[0].dtype):
            return collective(*args, async_op=True, **kwargs)
        values = (*args, *kwargs.values())
        for value in values:
            for tensor in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
                    torch.cuda.current_stream(tensor.device).synchronize()
        comm = next(v for v in values if isinstance(v, MPI.Comm))
        return Work.queued(worker.submit(comm, functools.partial(collective, *args, **kwargs)))
    return call  # type: ignore[return-value]


def _displacements(counts: Sequence[int]) -> List[int]:
    displs, total = [], 0
    for c in counts:
        displs.append(total)
        total += c
    return displs


def _refuse(what: str, comm: MPI.Intracomm, *values: object) -> None:
    """Raise ``TypeError`` naming ``what``, the first of ``values`` that is not a tensor, and
    the rank. The collectives test ``isinstance`` themselves and call this only on failure,
    since a call costs as much as a small collective's own work."""
    wrong = next(v for v in values if not isinstance(v, torch.Tensor))
    raise TypeError(f"{what}: expected a torch.Tensor, got {type(wrong).__name__} "
                    f"(rank {comm.Get_rank()})")


def _check_counts(counts: Sequence[int], comm: MPI.Intracomm, total: int, what: str) -> List[int]:
    counts = [int(c) for c in counts]
    if len(counts) != comm.Get_size():
        raise ValueError(f"{what}: {len(counts)} counts for a group of {comm.Get_size()} ranks "
                         f"(rank {comm.Get_rank()})")
    if sum(counts) != total:
        raise ValueError(f"{what}: counts add up to {sum(counts)} but the buffer has {total} "
                         f"elements (rank {comm.Get_rank()})")
    return counts


@_queueable
def all_reduce(tensor: torch.Tensor, comm: MPI.Intracomm, op: ReduceOp = ReduceOp.SUM,
               async_op: bool = False, in_dtype: bool = False) -> Optional[Work]:
    """Reduce ``tensor`` across the group, in place, leaving the result on every rank.

    A blocking call works in cache-sized pieces (see :mod:`.chunking`), averaging each piece
    while it is still in cache. 16-bit floats are summed in float32, or with ``in_dtype`` in
    their own type, moving half the bytes (for compression; ``SUM`` and ``AVG`` only). The
    16-bit addition runs on the host: GPU memory that a CUDA-aware MPI reads directly is summed
    in float32.
    """
    if not isinstance(tensor, torch.Tensor):
        _refuse("all_reduce", comm, tensor)
    if type(op) is not ReduceOp:
        op = ReduceOp(op)
    in_half = (in_dtype and is_half(tensor.dtype)
               and (tensor.is_cpu or needs_host_copy(tensor)))
    if in_half and op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"all_reduce in_dtype: {tensor.dtype} tensors are only summed or "
                         f"averaged in their own type, not {op.name} (rank {comm.Get_rank()})")
    average = op is ReduceOp.AVG
    datatype = None if async_op or in_half or average else direct_datatype(tensor)
    if datatype is not None and tensor.numel() <= piece_elements(tensor.element_size()):
        # the common case at once: one call on the tensor's own memory
        staged, work, mpi_op = None, tensor, reduce_op(tensor.dtype, op)
        pieces = [[memory(tensor), tensor.numel(), datatype]]
    else:
        staged = Staged(tensor, reduce=not in_half)
        work = staged.work
        mpi_op = half_sum_op(tensor.dtype) if in_half else reduce_op(work.dtype, op)
        limit = None if async_op else piece_elements(work.element_size())
        pieces = [staged.buf(start, n) for start, n in chunks(staged.count, limit)]
    size = comm.Get_size()
    if debug_enabled():   # tested here, since a call costs as much as a small collective
        check_collective(comm, "all_reduce", count=work.numel(), dtype=tensor.dtype, op=op)
    requests = []
    record = trace.collective("all_reduce", comm, tensor.nbytes, async_op)
    with watched("all_reduce", comm, record):
        if async_op:
            for piece in pieces:
                requests.append(comm.Iallreduce(MPI.IN_PLACE, piece, mpi_op))
        else:
            flat, start = work.view(-1) if average else None, 0
            for piece in pieces:
                comm.Allreduce(MPI.IN_PLACE, piece, mpi_op)
                if average:
                    flat[start:start + piece[1]].div_(size)
                    start += piece[1]
    if staged is None:
        return None

    def finish() -> None:
        if average and async_op:
            work.div_(size)
        staged.finish()
    return complete(requests, finish, async_op, operation="all_reduce", comm=comm,
                    record=record)


@_queueable
def reduce(tensor: torch.Tensor, comm: MPI.Intracomm, root: int,
           op: ReduceOp = ReduceOp.SUM, async_op: bool = False) -> Optional[Work]:
    """Reduce ``tensor`` across the group into ``tensor`` on rank ``root``, in place; the other
    ranks' tensors are left as they were."""
    if not isinstance(tensor, torch.Tensor):
        _refuse("reduce", comm, tensor)
    op = ReduceOp(op)
    is_root = comm.Get_rank() == root
    staged = Staged(tensor, reduce=True)
    mpi_op = reduce_op(staged.work.dtype, op)
    if debug_enabled():
        check_collective(comm, "reduce", count=staged.count, dtype=tensor.dtype, op=op,
                         root=root)
    requests = []
    record = trace.collective("reduce", comm, tensor.nbytes, async_op)
    with watched("reduce", comm, record):
        for start, n in chunks(staged.count):
            send, receive = ((MPI.IN_PLACE, staged.buf(start, n)) if is_root
                             else (staged.buf(start, n), None))
            if async_op:
                requests.append(comm.Ireduce(send, receive, mpi_op, root))
            else:
                comm.Reduce(send, receive, mpi_op, root)

    def finish() -> None:
        if is_root:
            if op is ReduceOp.AVG:
                staged.work.div_(comm.Get_size())
            staged.finish()
    return complete(requests, finish, async_op, keep=[staged], operation="reduce", comm=comm,
                    record=record)


@_queueable
def broadcast(tensor: torch.Tensor, comm: MPI.Intracomm, root: int = 0,
              async_op: bool = False) -> Optional[Work]:
    """Copy ``tensor`` from rank ``root`` into ``tensor`` on every other rank."""
    if not isinstance(tensor, torch.Tensor):
        _refuse("broadcast", comm, tensor)
    count = tensor.numel()
    datatype = None if async_op else direct_datatype(tensor)
    if datatype is not None and count <= chunk_elements():     # the common case at once
        staged, buffers = None, [[memory(tensor), count, datatype]]
    else:
        staged = Staged(tensor, copy_in=comm.Get_rank() == root)
        buffers = [staged.buf(start, n) for start, n in chunks(count)]
    if debug_enabled():
        check_collective(comm, "broadcast", count=count, dtype=tensor.dtype, root=root)
    requests = []
    record = trace.collective("broadcast", comm, tensor.nbytes, async_op)
    with watched("broadcast", comm, record):
        for buffer in buffers:
            if async_op:
                requests.append(comm.Ibcast(buffer, root))
            else:
                comm.Bcast(buffer, root)
    if staged is None:
        return None
    return complete(requests, staged.finish, async_op, operation="broadcast", comm=comm,
                    record=record)


@_queueable
def all_gather_v(output: torch.Tensor, counts: Sequence[int], comm: MPI.Intracomm,
                 input: Optional[torch.Tensor] = None, async_op: bool = False) -> Optional[Work]:
    """Concatenate every rank's part into ``output`` (flattened), in rank order.

    Rank ``r`` contributes ``counts[r]`` elements: ``input`` if given, else the elements already
    at its own place in ``output`` (in place, no extra copy).
    """
    if not isinstance(output, torch.Tensor) or not isinstance(input, (torch.Tensor, type(None))):
        _refuse("all_gather_v", comm, output, input)
    rank = comm.Get_rank()
    counts = _check_counts(counts, comm, output.numel(), "all_gather_v")
    displs = _displacements(counts)
    if input is not None:
        if input.numel() != counts[rank]:
            raise ValueError(f"all_gather_v: rank {rank} contributes {input.numel()} elements, "
                             f"counts say {counts[rank]}")
        if input.dtype != output.dtype:
            raise TypeError(f"all_gather_v: input is {input.dtype}, output {output.dtype} "
                            f"(rank {rank})")
    staged = Staged(output, copy_in=input is None)
    if input is not None:
        staged.work.view(-1)[displs[rank]:displs[rank] + counts[rank]].copy_(input.reshape(-1))
    if debug_enabled():
        check_collective(comm, "all_gather_v", counts=counts, dtype=output.dtype)
    requests = []
    record = trace.collective("all_gather_v", comm, output.nbytes, async_op)
    with watched("all_gather_v", comm, record):
        if staged.count <= chunk_elements():
            spec = [staged.buf()[0], (counts, displs), staged.datatype]
            if async_op:
                requests.append(comm.Iallgatherv(MPI.IN_PLACE, spec))
            else:
                comm.Allgatherv(MPI.IN_PLACE, spec)
        else:  # too long for one call: each rank broadcasts its part, chunk by chunk
            for owner in range(comm.Get_size()):
                for start, n in chunks(counts[owner]):
                    buf = staged.buf(displs[owner] + start, n)
                    if async_op:
                        requests.append(comm.Ibcast(buf, owner))
                    else:
                        comm.Bcast(buf, owner)
    return complete(requests, staged.finish, async_op, operation="all_gather_v", comm=comm,
                    record=record)


@_queueable
def all_gather(output: torch.Tensor, input: torch.Tensor, comm: MPI.Intracomm,
               async_op: bool = False) -> Optional[Work]:
    """Concatenate equal-sized ``input`` tensors from every rank into ``output``, in rank order."""
    if not isinstance(output, torch.Tensor) or not isinstance(input, torch.Tensor):
        _refuse("all_gather", comm, output, input)
    size = comm.Get_size()
    count, total = input.numel(), output.numel()   # a receive count is per rank
    if total != size * count:
        raise ValueError(f"all_gather: output has {total} elements, expected "
                         f"{size} x {count} (rank {comm.Get_rank()})")
    dtype = input.dtype
    if total > chunk_elements() or dtype != output.dtype:
        return all_gather_v(output, [count] * size, comm, input, async_op=async_op)
    if input.data_ptr() == output.data_ptr() + comm.Get_rank() * input.nbytes and count:
        # ``input`` is this rank's part of ``output`` (FSDP2 gathers so): MPI wants IN_PLACE
        return all_gather_v(output, [count] * size, comm, None, async_op=async_op)
    datatype = None if async_op else direct_datatype(input)
    if datatype is not None and output.is_cpu and output.is_contiguous():  # the common case
        send, recv = None, None
        messages = [memory(input), count, datatype], [memory(output), count, datatype]
    else:
        send, recv = Staged(input), Staged(output, copy_in=False)
        messages = send.buf(), [memory(recv.work), count, recv.datatype]
    if debug_enabled():
        check_collective(comm, "all_gather", count=count, dtype=dtype)
    requests = []
    record = trace.collective("all_gather", comm, output.nbytes, async_op)
    with watched("all_gather", comm, record):
        if async_op:
            requests.append(comm.Iallgather(*messages))
        else:
            comm.Allgather(*messages)
    if recv is None:
        return None
    return complete(requests, recv.finish, async_op, keep=[send], operation="all_gather",
                    comm=comm, record=record)


@_queueable
def reduce_scatter(output: torch.Tensor, input: torch.Tensor, comm: MPI.Intracomm,
                   counts: Optional[Sequence[int]] = None, op: ReduceOp = ReduceOp.SUM,
                   async_op: bool = False) -> Optional[Work]:
    """Reduce ``input`` across the group and leave part ``r`` of the result in ``output`` on rank
    ``r``. Parts have ``counts[r]`` elements (equal parts when ``counts`` is ``None``)."""
    if not isinstance(output, torch.Tensor) or not isinstance(input, torch.Tensor):
        _refuse("reduce_scatter", comm, output, input)
    if type(op) is not ReduceOp:
        op = ReduceOp(op)
    size, rank = comm.Get_size(), comm.Get_rank()
    if counts is None:
        if input.numel() % size:
            raise ValueError(f"reduce_scatter: {input.numel()} elements do not split evenly "
                             f"over {size} ranks (rank {rank})")
        counts = [input.numel() // size] * size
    else:
        counts = _check_counts(counts, comm, input.numel(), "reduce_scatter")
    if output.numel() != counts[rank]:
        raise ValueError(f"reduce_scatter: rank {rank} output has {output.numel()} elements, "
                         f"counts say {counts[rank]}")
    datatype = None if async_op or op is ReduceOp.AVG else direct_datatype(input)
    if (datatype is not None and output.dtype == input.dtype and direct_datatype(output)
            and input.numel() <= chunk_elements()):
        # the common case at once: one call on the tensors' own memory
        send = recv = None
        mpi_op = reduce_op(input.dtype, op)
        whole = [memory(input), input.numel(), datatype], [memory(output), counts[rank], datatype]
    else:
        send = Staged(input, reduce=True)
        recv = Staged(output, reduce=True, copy_in=False)
        mpi_op = reduce_op(send.work.dtype, op)
        whole = (send.buf(), recv.buf()) if send.count <= chunk_elements() else None
    if debug_enabled():
        check_collective(comm, "reduce_scatter", counts=counts, dtype=input.dtype, op=op)
    requests = []
    record = trace.collective("reduce_scatter", comm, input.nbytes, async_op)
    with watched("reduce_scatter", comm, record):
        # Reduce_scatter, not Reduce_scatter_block: Open MPI 4.1 runs that as a reduce and a scatter
        if whole is not None and async_op:
            requests.append(comm.Ireduce_scatter(*whole, counts, mpi_op))
        elif whole is not None:
            comm.Reduce_scatter(*whole, counts, mpi_op)
        else:  # too long for one call: reduce each rank's part to it, chunk by chunk
            displs = _displacements(counts)
            for owner in range(size):
                for start, n in chunks(counts[owner]):
                    target = recv.buf(start, n) if owner == rank else None
                    args = (send.buf(displs[owner] + start, n), target, mpi_op, owner)
                    if async_op:
                        requests.append(comm.Ireduce(*args))
                    else:
                        comm.Reduce(*args)
    if recv is None:
        return None

    def finish() -> None:
        if op is ReduceOp.AVG:
            recv.work.div_(size)
        recv.finish()
    return complete(requests, finish, async_op, keep=[send], operation="reduce_scatter",
                    comm=comm, record=record)


def gather(input: torch.Tensor, comm: MPI.Intracomm, root: int = 0,
           counts: Optional[Sequence[int]] = None) -> Optional[torch.Tensor]:
    """Concatenate every rank's flattened ``input`` on rank ``root`` only; others get ``None``.

    ``counts`` (every rank's element count, the same list on all ranks) saves a small exchange
    of sizes when the caller knows them.
    """
    if not isinstance(input, torch.Tensor):
        _refuse("gather", comm, input)
    rank = comm.Get_rank()
    if counts is None:
        counts = all_gather_array(np.array([input.numel()], dtype=np.int64), comm)
        counts = counts.reshape(-1).tolist()
    counts = _check_counts(counts, comm, sum(int(c) for c in counts), "gather")
    if input.numel() != counts[rank]:
        raise ValueError(f"gather: rank {rank} sends {input.numel()} elements, counts say "
                         f"{counts[rank]}")
    displs = _displacements(counts)
    send = Staged(input)
    recv = None
    if rank == root:
        recv = Staged(torch.empty(sum(counts), dtype=input.dtype, device=input.device),
                      copy_in=False)
    if debug_enabled():
        check_collective(comm, "gather", counts=counts, dtype=input.dtype, root=root)
    record = trace.collective("gather", comm, input.nbytes)
    with watched("gather", comm, record):
        if sum(counts) <= chunk_elements():
            spec = [recv.buf()[0], (counts, displs), recv.datatype] if recv else None
            comm.Gatherv(send.buf(), spec, root)
        elif recv is None:  # too long for one call: point to point, chunk by chunk
            for start, n in chunks(counts[rank]):
                comm.Send(send.buf(start, n), root)
        else:
            recv.work[displs[rank]:displs[rank] + counts[rank]].copy_(send.work.reshape(-1))
            for source in range(comm.Get_size()):
                if source != root:
                    for start, n in chunks(counts[source]):
                        comm.Recv(recv.buf(displs[source] + start, n), source)
    return recv.finish() if recv else None


@_queueable
def all_reduce_coalesced(tensors: Sequence[torch.Tensor], comm: MPI.Intracomm,
                         op: ReduceOp = ReduceOp.SUM, async_op: bool = False) -> Optional[Work]:
    """:func:`all_reduce` of many tensors, in place.

    Blocking, the tensors stream through MPI a piece (:mod:`.chunking`) at a time, each byte
    copied while it is in cache: a tensor of a piece or more is reduced in its own memory (16-bit
    floats through a float32 piece); smaller ones are packed, a piece's worth at a time, into one
    reused staging buffer per dtype and device (one alone in its piece needs no packing when MPI
    can reduce it where it is). Nonblocking, each dtype and device travels in one flat buffer
    and one collective. Which calls are made depends only on the tensors' sizes and dtypes, so
    ranks holding equal shapes make the same calls.
    """
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        _refuse("all_reduce_coalesced", comm, *tensors)
    if not async_op:
        for indices in group_by_dtype_device(tensors).values():
            _stream_reduce([tensors[i] for i in indices], comm, op)
        return None
    works, unpack = [], []
    for indices, flat in pack_by_dtype_device(tensors, reduce_dtype).values():
        works.append(all_reduce(flat.buffer, comm, op, async_op=True))
        unpack.append((flat, [tensors[i] for i in indices]))

    def finish() -> None:
        for flat, targets in unpack:
            flat.copy_to(targets)
    return Work.all_of(works, finish)


def _stream_reduce(tensors: List[torch.Tensor], comm: MPI.Intracomm, op: ReduceOp) -> None:
    """The blocking :func:`all_reduce_coalesced` of tensors of one dtype and device."""
    first = tensors[0]
    work_dtype = reduce_dtype(first.dtype)
    piece = piece_elements(torch.empty((), dtype=work_dtype).element_size())
    converted = work_dtype != first.dtype and any(
        t.numel() >= piece and t.is_contiguous() for t in tensors)
    small = sum(t.numel() for t in tensors if t.numel() < piece)
    stage = torch.empty(piece if converted else min(piece, small), dtype=work_dtype,
                        device=first.device)
    packed: List[torch.Tensor] = []
    count = 0

    def through_stage(parts: List[torch.Tensor], n: int) -> None:
        if len(parts) == 1 and parts[0].dtype == work_dtype and parts[0].is_contiguous():
            all_reduce(parts[0], comm, op)
            return
        views = _unflatten_dense_tensors(stage[:n], parts)
        torch._foreach_copy_(views, parts)
        all_reduce(stage[:n], comm, op)
        torch._foreach_copy_(parts, views)

    for tensor in tensors:
        n = tensor.numel()
        if n < piece:
            if count + n > piece:
                through_stage(packed, count)
                packed, count = [], 0
            packed.append(tensor)
            count += n
        elif tensor.dtype == work_dtype or not tensor.is_contiguous():
            all_reduce(tensor, comm, op)   # in its own memory, a piece at a time
        else:
            flat = tensor.view(-1)
            for start, length in chunks(n, piece):
                through_stage([flat[start:start + length]], length)
    if packed:
        through_stage(packed, count)


def broadcast_coalesced(tensors: Sequence[torch.Tensor], comm: MPI.Intracomm, root: int = 0) -> None:
    """:func:`broadcast` of many tensors: one flat buffer and one collective per dtype and device."""
    for indices, flat in pack_by_dtype_device(tensors).values():
        broadcast(flat.buffer, comm, root)
        flat.copy_to([tensors[i] for i in indices])


@_queueable
def all_to_all_v(output: torch.Tensor, input: torch.Tensor, comm: MPI.Intracomm,
                 output_counts: Optional[Sequence[int]] = None,
                 input_counts: Optional[Sequence[int]] = None,
                 async_op: bool = False) -> Optional[Work]:
    """Send part ``r`` of ``input`` (flattened) to rank ``r`` and receive rank ``r``'s part for
    this rank into part ``r`` of ``output``. Parts have the given element counts (equal parts
    when ``None``). Messages longer than the chunk limit go point to point, chunk by chunk."""
    if not isinstance(output, torch.Tensor) or not isinstance(input, torch.Tensor):
        _refuse("all_to_all", comm, output, input)
    size, rank = comm.Get_size(), comm.Get_rank()
    if input.dtype != output.dtype:
        raise TypeError(f"all_to_all: input is {input.dtype}, output {output.dtype} (rank {rank})")
    counts = []
    for given, tensor, side in ((input_counts, input, "input"), (output_counts, output, "output")):
        if given is None or len(given) == 0:
            if tensor.numel() % size:
                raise ValueError(f"all_to_all: the {side}'s {tensor.numel()} elements do not "
                                 f"split evenly over {size} ranks (rank {rank})")
            given = [tensor.numel() // size] * size
        counts.append(_check_counts(given, comm, tensor.numel(), f"all_to_all {side}"))
    send_counts, recv_counts = counts
    send, recv = Staged(input), Staged(output, copy_in=False)
    if debug_enabled():
        check_collective(comm, "all_to_all", dtype=input.dtype)
    send_displs, recv_displs = _displacements(send_counts), _displacements(recv_counts)
    requests = []
    record = trace.collective("all_to_all", comm, input.nbytes, async_op)
    with watched("all_to_all", comm, record):
        if max(send_counts + recv_counts, default=0) <= chunk_elements() and \
                max(send_displs + recv_displs, default=0) <= chunk_elements():
            messages = ([send.buf()[0], (send_counts, send_displs), send.datatype],
                        [recv.buf()[0], (recv_counts, recv_displs), recv.datatype])
            if async_op:
                requests.append(comm.Ialltoallv(*messages))
            else:
                comm.Alltoallv(*messages)
        else:  # too long for one call: every pair exchanges its part, chunk by chunk
            for peer in range(size):
                for start, n in chunks(recv_counts[peer]):
                    requests.append(comm.Irecv(recv.buf(recv_displs[peer] + start, n), peer))
                for start, n in chunks(send_counts[peer]):
                    requests.append(comm.Isend(send.buf(send_displs[peer] + start, n), peer))
            if not async_op:
                MPI.Request.Waitall(requests)
                requests = []
    return complete(requests, recv.finish, async_op, keep=[send], operation="all_to_all",
                    comm=comm, record=record)


@_queueable
def scatter(output: torch.Tensor, input: Optional[torch.Tensor], comm: MPI.Intracomm,
            root: int = 0, async_op: bool = False) -> Optional[Work]:
    """Send part ``r`` of ``input`` (flattened, on rank ``root`` only) into ``output`` on rank
    ``r``; every part has ``output``'s element count."""
    if not isinstance(output, torch.Tensor) or not isinstance(input, (torch.Tensor, type(None))):
        _refuse("scatter", comm, output, input)
    size, rank = comm.Get_size(), comm.Get_rank()
    count = output.numel()
    if rank == root and (input is None or input.numel() != size * count):
        raise ValueError(f"scatter: the root needs {size} x {count} elements to send, got "
                         f"{None if input is None else input.numel()} (rank {rank})")
    send = Staged(input) if rank == root else None
    recv = Staged(output, copy_in=False)
    if debug_enabled():
        check_collective(comm, "scatter", count=count, dtype=output.dtype, root=root)
    requests = []
    record = trace.collective("scatter", comm, output.nbytes, async_op)
    with watched("scatter", comm, record):
        for start, n in chunks(count):
            sent = None
            if send is not None:   # part r, chunk [start, start + n), for every rank r
                sent = [send.buf()[0], ([n] * size, [r * count + start for r in range(size)]),
                        send.datatype]
            if async_op:
                requests.append(comm.Iscatterv(sent, recv.buf(start, n), root))
            else:
                comm.Scatterv(sent, recv.buf(start, n), root)
    return complete(requests, recv.finish, async_op, keep=[send], operation="scatter",
                    comm=comm, record=record)

