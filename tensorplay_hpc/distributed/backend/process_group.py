"""The ``mpi4py`` process group: torch.distributed's collectives on an MPI communicator.

c10d hands a backend's process group the tensors and an options object for each operation;
this class answers each through the comm layer (flat buffers, 16-bit floats, messages over
MPI's count limit, GPU memory to a CUDA-aware MPI or staged, the watchdog and the trace) and
returns a :class:`~.work.BackendWork`. An operation with ``asyncOp`` set starts nonblocking MPI
calls; one without completes before it returns. Every collective must be called by every rank
of the group, in the same order, as with any torch.distributed backend.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup as _C10dProcessGroup

from tensorplay_hpc.comm import collectives, fault_tolerance, small_collectives
from tensorplay_hpc.comm.dtypes import ReduceOp
from tensorplay_hpc.comm.group import ProcessGroup
from tensorplay_hpc.comm.mpi import MPI
from tensorplay_hpc.comm.point_to_point import receive, send
from tensorplay_hpc.comm.work import Work

from .work import BackendWork

__all__ = ["BACKEND_NAME", "MPIProcessGroup", "UnsupportedOperation"]

BACKEND_NAME = "mpi4py"
"""The name the backend is registered under: ``dist.init_process_group("mpi4py")``."""

_REDUCTIONS = {   # keyed by the value of c10d's RedOpType: a lookup costs no enum hashing
    kind.value: ours for kind, ours in (
        (dist.ReduceOp.SUM, ReduceOp.SUM),
        (dist.ReduceOp.AVG, ReduceOp.AVG),
        (dist.ReduceOp.PRODUCT, ReduceOp.PRODUCT),
        (dist.ReduceOp.MIN, ReduceOp.MIN),
        (dist.ReduceOp.MAX, ReduceOp.MAX),
    )
}


class UnsupportedOperation(RuntimeError):
    """An operation or reduction the ``mpi4py`` backend does not offer."""


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors one after another in one contiguous buffer."""
    return torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.empty(0)


class MPIProcessGroup(_C10dProcessGroup):
    """A torch.distributed process group over ``group``'s private communicator, which it
    frees at ``shutdown()`` (``dist.destroy_process_group``). ``name`` is the group name c10d
    chose."""

    def __init__(self, group: ProcessGroup, name: str) -> None:
        super().__init__(group.rank, group.size)
        self._group = group
        self._name = name
        self._coalesced: Optional[List[BackendWork]] = None

    # --- identity -------------------------------------------------------------------------

    @property
    def comm(self) -> MPI.Intracomm:
        """The communicator the group's operations run on (the library's own)."""
        return self._group.comm

    @property
    def group_name(self) -> str:
        return self._name

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    def shutdown(self) -> None:
        """Free the communicator. Collective (``destroy_process_group`` calls it on every
        rank), but after a lost rank: a revoked communicator is left to ``MPI_Finalize``."""
        if not self._group.closed and not fault_tolerance.is_revoked(self._group.comm):
            self._group.close()

    def abort(self) -> None:
        MPI.COMM_WORLD.Abort(1)

    # --- helpers --------------------------------------------------------------------------

    def _reduction(self, op: dist.ReduceOp, what: str) -> ReduceOp:
        try:   # c10d passes a ReduceOp holding its RedOpType
            return _REDUCTIONS[op.op.value]
        except (AttributeError, KeyError):
            kind = getattr(op, "op", op)
            raise UnsupportedOperation(
                f"{what}: the {BACKEND_NAME} backend has no {kind} reduction (it offers SUM, "
                f"AVG, PRODUCT, MIN and MAX; rank {self.rank()})") from None

    def _issue(self, outputs: List[torch.Tensor], asynchronous: bool,
               collective: Callable[..., Optional[Work]], *args: object,
               then: Optional[Callable[[], None]] = None, **kwargs: object) -> BackendWork:
        """``collective(*args, **kwargs)``, a comm-layer call, started with ``asynchronous``
        and wrapped in a handle; ``then`` runs once it has completed (copying results out of a
        flat buffer)."""
        pending = collective(*args, async_op=asynchronous, **kwargs)
        if asynchronous:
            pending = Work.all_of([pending] if pending is not None else [], then)
        else:   # a blocking call has completed
            if then is not None:
                then()
            pending = None
        work = BackendWork(pending, outputs)
        if self._coalesced is not None:
            self._coalesced.append(work)
        return work

    def _single(self, what: str, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        if len(tensors) != 1:
            raise ValueError(f"{what}: the {BACKEND_NAME} backend takes one tensor per call, "
                             f"got {len(tensors)} (rank {self.rank()})")
        return tensors[0]

    # --- coalescing (dist._coalescing_manager) ----------------------------------------------

    def _start_coalescing(self, device: torch.device) -> None:
        self._coalesced = []

    def _end_coalescing(self, device: torch.device) -> BackendWork:
        works, self._coalesced = self._coalesced or [], None
        return _joined(works, [t for work in works for t in work.outputs])

    # --- reductions -----------------------------------------------------------------------

    def allreduce(self, tensors: List[torch.Tensor], opts: dist.AllreduceOptions) -> BackendWork:
        op = self._reduction(opts.reduceOp, "allreduce")
        tensor = self._single("allreduce", tensors)
        return self._issue(tensors, opts.asyncOp, collectives.all_reduce, tensor, self.comm, op)

    def allreduce_coalesced(self, tensors: List[torch.Tensor],
                            opts: dist.AllreduceCoalescedOptions) -> BackendWork:
        op = self._reduction(opts.reduceOp, "allreduce_coalesced")
        return self._issue(tensors, opts.asyncOp, collectives.all_reduce_coalesced, tensors,
                           self.comm, op)

    def reduce(self, tensors: List[torch.Tensor], opts: dist.ReduceOptions) -> BackendWork:
        op = self._reduction(opts.reduceOp, "reduce")
        tensor = self._single("reduce", tensors)
        return self._issue(tensors, opts.asyncOp, collectives.reduce, tensor, self.comm,
                           opts.rootRank, op)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor,
                             opts: dist.ReduceScatterOptions) -> BackendWork:
        op = self._reduction(opts.reduceOp, "reduce_scatter_tensor")
        return self._issue([output], opts.asyncOp, collectives.reduce_scatter, output, input,
                           self.comm, op=op)

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter(self, outputs: List[torch.Tensor], input_lists: List[List[torch.Tensor]],
                       opts: dist.ReduceScatterOptions) -> BackendWork:
        output = self._single("reduce_scatter", outputs)
        inputs = self._single("reduce_scatter", input_lists)
        counts = [t.numel() for t in inputs]
        op = self._reduction(opts.reduceOp, "reduce_scatter")
        flat = _flat(inputs)
        return self._issue(outputs, opts.asyncOp, collectives.reduce_scatter, output, flat,
                           self.comm, counts=counts, op=op)

    def reduce_scatter_tensor_coalesced(self, outputs: List[torch.Tensor],
                                        inputs: List[torch.Tensor],
                                        opts: dist.ReduceScatterOptions) -> BackendWork:
        return _each(self._reduce_scatter_base, outputs, inputs, opts)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    # --- gathers and broadcasts -----------------------------------------------------------

    def broadcast(self, tensors: List[torch.Tensor], opts: dist.BroadcastOptions) -> BackendWork:
        tensor = self._single("broadcast", tensors)
        return self._issue(tensors, opts.asyncOp, collectives.broadcast, tensor, self.comm,
                           opts.rootRank)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor,
                        opts: dist.AllgatherOptions) -> BackendWork:
        return self._issue([output], opts.asyncOp, collectives.all_gather, output, input, self.comm)

    all_gather_single = _allgather_base

    def allgather(self, output_lists: List[List[torch.Tensor]], inputs: List[torch.Tensor],
                  opts: dist.AllgatherOptions) -> BackendWork:
        outputs = self._single("allgather", output_lists)
        input = self._single("allgather", inputs)
        if len(outputs) != self.size():
            raise ValueError(f"allgather: {len(outputs)} output tensors for a group of "
                             f"{self.size()} ranks (rank {self.rank()})")
        counts = [t.numel() for t in outputs]
        flat = torch.empty(sum(counts), dtype=input.dtype, device=input.device)
        return self._issue(output_lists, opts.asyncOp, collectives.all_gather_v, flat, counts,
                           self.comm, input, then=lambda: _unpack(flat, outputs))

    def allgather_coalesced(self, output_lists: List[List[torch.Tensor]],
                            inputs: List[torch.Tensor], opts: dist.AllgatherOptions) -> BackendWork:
        return _each(lambda o, i, options: self.allgather([o], [i], options), output_lists,
                     inputs, opts)

    def allgather_into_tensor_coalesced(self, outputs: List[torch.Tensor],
                                        inputs: List[torch.Tensor],
                                        opts: dist.AllgatherOptions) -> BackendWork:
        return _each(self._allgather_base, outputs, inputs, opts)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def gather(self, output_lists: List[List[torch.Tensor]], inputs: List[torch.Tensor],
               opts: dist.GatherOptions) -> BackendWork:
        input = self._single("gather", inputs)
        root = opts.rootRank
        outputs = output_lists[0] if output_lists else []
        if self.rank() == root and len(outputs) != self.size():
            raise ValueError(f"gather: the root has {len(outputs)} output tensors for a group "
                             f"of {self.size()} ranks (rank {self.rank()})")
        counts = [input.numel()] * self.size()
        gathered = collectives.gather(input, self.comm, root, counts=counts)
        if gathered is not None:
            _unpack(gathered, outputs)
        return BackendWork(None, outputs)

    def scatter(self, outputs: List[torch.Tensor], input_lists: List[List[torch.Tensor]],
                opts: dist.ScatterOptions) -> BackendWork:
        output = self._single("scatter", outputs)
        root = opts.rootRank
        flat = None
        if self.rank() == root:
            inputs = self._single("scatter", input_lists)
            if len(inputs) != self.size():
                raise ValueError(f"scatter: the root has {len(inputs)} input tensors for a "
                                 f"group of {self.size()} ranks (rank {self.rank()})")
            flat = _flat(inputs)
        return self._issue(outputs, opts.asyncOp, collectives.scatter, output, flat, self.comm,
                           root)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: List[int], input_split_sizes: List[int],
                      opts: dist.AllToAllOptions) -> BackendWork:
        row_out = output[0].numel() if output.dim() else 1
        row_in = input[0].numel() if input.dim() else 1
        out_counts = [s * row_out for s in output_split_sizes] or None
        in_counts = [s * row_in for s in input_split_sizes] or None
        return self._issue([output], opts.asyncOp, collectives.all_to_all_v, output, input,
                           self.comm, out_counts, in_counts)

    all_to_all_single = alltoall_base

    def alltoall(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                 opts: dist.AllToAllOptions) -> BackendWork:
        flat_in = _flat(inputs)
        flat_out = torch.empty(sum(t.numel() for t in outputs), dtype=flat_in.dtype,
                               device=flat_in.device)
        return self._issue(outputs, opts.asyncOp, collectives.all_to_all_v, flat_out, flat_in,
                           self.comm, [t.numel() for t in outputs],
                           [t.numel() for t in inputs], then=lambda: _unpack(flat_out, outputs))

    # --- synchronization and point to point ---------------------------------------------------

    def barrier(self, opts: dist.BarrierOptions = None) -> BackendWork:
        """Blocking whatever ``opts`` asks: a barrier's handle has nothing left to wait for."""
        small_collectives.barrier(self.comm)
        return BackendWork(None, [])

    def monitored_barrier(self, *args: object, **kwargs: object) -> None:
        raise UnsupportedOperation(
            f"monitored_barrier: the {BACKEND_NAME} backend has none (PyTorch offers it on "
            f"gloo only); set TENSORPLAY_HPC_COLLECTIVE_TIMEOUT to have the watchdog name a "
            f"rank that does not arrive (rank {self.rank()})")

    def send(self, tensors: List[torch.Tensor], dst: int, tag: int) -> BackendWork:
        tensor = self._single("send", tensors)
        return BackendWork(send(tensor, self.comm, dst, tag), tensors)

    def recv(self, tensors: List[torch.Tensor], src: int, tag: int) -> BackendWork:
        tensor = self._single("recv", tensors)
        return BackendWork(receive(tensor, self.comm, src, tag), tensors, source=src)

    def recv_anysource(self, tensors: List[torch.Tensor], tag: int) -> BackendWork:
        tensor = self._single("recv", tensors)
        pending = receive(tensor, self.comm, None, tag)
        return BackendWork(pending, tensors, source=pending.source)

    # -------------------------------------------------------------------------------------

    def __repr__(self) -> str:
        return f"MPIProcessGroup(name={self._name!r}, rank={self.rank()}, size={self.size()})"


def _joined(works: List[BackendWork], outputs: list) -> BackendWork:
    """One handle on several operations: complete when each is."""
    return BackendWork(Work([], lambda: [work.wait() for work in works]), outputs)


def _each(operation: Callable[..., BackendWork], outputs: list, inputs: list,
          opts: object) -> BackendWork:
    """``operation(output, input, opts)`` for each pair, as one handle."""
    return _joined([operation(o, i, opts) for o, i in zip(outputs, inputs)], outputs)


def _unpack(flat: torch.Tensor, outputs: Sequence[torch.Tensor]) -> None:
    """Copy consecutive pieces of ``flat`` into ``outputs``."""
    start = 0
    for tensor in outputs:
        n = tensor.numel()
        tensor.copy_(flat[start:start + n].view(tensor.shape))
        start += n
