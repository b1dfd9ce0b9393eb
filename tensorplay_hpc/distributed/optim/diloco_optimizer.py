"""DiLoCo: inner optimizer steps on every rank, and every few steps an outer optimizer step on a
kept global copy of the model, driven by the ranks' averaged model deltas (Douillard et al.
2023), with Streaming DiLoCo's fragments, overlapped syncs and 16-bit deltas."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from tensorplay_hpc import comm
from tensorplay_hpc.comm.agreement import fail_together
from tensorplay_hpc.comm.communicators import free, split
from tensorplay_hpc.comm.mpi import MPI

from .fragment_schedule import FragmentSchedule
from .wrapping_optimizer import WrappingOptimizer

__all__ = ["DiLoCoOptimizer"]

_DELTA_DTYPES = (None, torch.bfloat16, torch.float16)
# One fragment's part of one flat global buffer: (buffer index, parameter indices, start, end).
Part = Tuple[int, List[int], int, int]


class _Sync:
    """One fragment's sync: the deltas of each of its parts on their way through the
    allreduce, then their average."""

    def __init__(self, fragment: int, started: int) -> None:
        self.fragment = fragment
        self.started = started
        self.wire: List[torch.Tensor] = []      # what the allreduce sums (16-bit copies or not)
        self.works: List[Optional[comm.Work]] = []
        self.local: Optional[List[torch.Tensor]] = None   # the fragment when the sync started
        self.average: Optional[List[torch.Tensor]] = None  # the averaged deltas, once complete


class DiLoCoOptimizer(WrappingOptimizer, comm.Closeable):
    """DiLoCo over MPI: each :meth:`step` is a step of the inner optimizer; every
    ``sync_every`` inner steps (per fragment) the ranks average the delta ``global - local`` of
    the fragment's parameters, the outer optimizer steps the kept global copy with that average
    as its gradient, and the model continues from the new global parameters.

    Build both optimizers over the model's parameters (torchft's convention); the inner one is
    usually AdamW, the outer one Nesterov SGD (DiLoCo: ``lr=0.7, momentum=0.9, nesterov=True``).
    Constructing it is collective: rank 0's parameters are broadcast so that the replicas start
    equal, and the global copy is kept (one flat buffer per dtype and device, in pinned host
    memory for GPU parameters). :meth:`step` is collective, and so is :meth:`close`.

    Args:
        optim: the inner optimizer.
        outer_optimizer: the outer optimizer, over the same parameters.
        sync_every: inner steps between two syncs of a fragment.
        process_group: an mpi4py intracommunicator; ``None`` is ``MPI.COMM_WORLD``.
        fragments: contiguous groups of parameters (registration order, balanced by elements)
            synced on a staggered schedule: fragment ``f`` syncs after the inner steps ``s``
            with ``(s - f * sync_every // fragments) % sync_every == 0``.
        delta_dtype: ``torch.bfloat16`` or ``torch.float16`` to send the deltas in 16 bits,
            summed in that type; ``None`` sends them in the parameters' dtype.
        overlap_steps: the allreduce of a sync runs while this many further inner steps are
            taken, then the fragment becomes ``new_global + (local_now - local_at_sync)``;
            below ``sync_every // fragments``.
        node_local: the ranks of a node average their gradients at every step (data
            parallelism inside the node; the ranks of a node must hold gradients for the same
            parameters) and DiLoCo runs between the nodes. Needs the same number of ranks on
            every node.

    Attributes:
        bytes_synced: the bytes this rank has handed to the deltas' allreduces so far (16-bit
            where ``delta_dtype`` says so; with ``node_local`` its share, which crosses nodes;
            none on one rank).
        rank, world_size: this rank's place in ``process_group`` and its size.

    Raises:
        TypeError: ``optim`` or ``outer_optimizer`` is not a ``torch.optim.Optimizer``.
        ValueError: a bad setting, an outer optimizer over other parameters, unequal nodes with
            ``node_local``, or ranks whose settings or parameters (shapes, dtypes) differ; on
            every rank, naming the rank(s).

    Example::

        inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        opt = DiLoCoOptimizer(inner, outer, sync_every=64, fragments=2)
        for batch in data:
            opt.zero_grad()
            loss_fn(model(batch)).backward()
            opt.step()
        opt.close()
    """

    def __init__(self, optim: torch.optim.Optimizer, outer_optimizer: torch.optim.Optimizer,
                 sync_every: int, process_group: Optional[MPI.Intracomm] = None,
                 fragments: int = 1, delta_dtype: Optional[torch.dtype] = None,
                 overlap_steps: int = 0, node_local: bool = False) -> None:
        self.optim = optim
        self.outer_optimizer = outer_optimizer
        self.delta_dtype = delta_dtype
        self.node_local = bool(node_local)
        self.bytes_synced = 0
        self._group = comm.ProcessGroup(process_group, owner="DiLoCoOptimizer")
        self._subgroups: List[comm.ProcessGroup] = []
        self.rank, self.world_size = self._group.rank, self._group.size
        self._params: List[torch.Tensor] = []
        settings = [("sync_every", sync_every), ("fragments", fragments),
                    ("delta_dtype", str(delta_dtype)), ("overlap_steps", overlap_steps),
                    ("node_local", self.node_local)]
        try:
            with fail_together(self._group.comm, "DiLoCoOptimizer: the arguments",
                               catch=(TypeError, ValueError), own_errors=True, items=settings,
                               valid_items=self._signature):
                self._check_arguments(delta_dtype)
                try:
                    self.schedule = FragmentSchedule([p.numel() for p in self._params],
                                                     fragments, sync_every, overlap_steps)
                except ValueError as error:
                    raise ValueError(f"DiLoCoOptimizer: {error} (rank {self.rank})") from None
            layout = comm.NodeLayout(self._group.comm) if self.node_local else None
            if layout is not None and layout.node_size is None:   # alike on every rank
                raise ValueError(
                    "DiLoCoOptimizer(node_local=True) needs the same number of ranks on every "
                    f"node, got nodes {[list(ranks) for ranks in layout.nodes]} (rank "
                    f"{self.rank})")
        except Exception:
            self._group.close()   # every rank raises: free the duplicate now
            raise
        self._reducer, self._node = self._group, None
        if layout is not None:
            self._node = self._subgroup(layout.node)              # the ranks of my node
            self._reducer = self._subgroup(layout.node_rank)      # my peers on the other nodes
        with torch.no_grad():
            comm.broadcast_coalesced([p.detach() for p in self._params], self._group.comm, 0)
        self._buffers, self._where = self._global_copy()
        self._parts: List[List[Part]] = [self._fragment_parts(f) for f in range(fragments)]
        self._inner_steps = 0
        self._in_flight: List[_Sync] = []

    # -- construction ----------------------------------------------------------------------

    def _signature(self) -> List[Any]:
        return comm.tensor_signature([f"parameter {i}" for i in range(len(self._params))],
                                     self._params)

    def _check_arguments(self, delta_dtype: Optional[torch.dtype]) -> None:
        if not isinstance(self.optim, torch.optim.Optimizer) or not isinstance(
                self.outer_optimizer, torch.optim.Optimizer):
            raise TypeError("DiLoCoOptimizer: optim and outer_optimizer must be "
                            f"torch.optim.Optimizer instances (rank {self.rank})")
        self._params = [p for group in self.optim.param_groups for p in group["params"]]
        if delta_dtype not in _DELTA_DTYPES:
            raise ValueError(f"DiLoCoOptimizer: delta_dtype must be None, torch.bfloat16 or "
                             f"torch.float16, got {delta_dtype} (rank {self.rank})")
        outer = [p for group in self.outer_optimizer.param_groups for p in group["params"]]
        if {id(p) for p in outer} != {id(p) for p in self._params} or len(outer) != len(
                self._params):
            raise ValueError(
                "DiLoCoOptimizer: the outer optimizer must hold the same parameters as the "
                f"inner one, got {len(outer)} outer and {len(self._params)} inner parameters, "
                f"{len({id(p) for p in outer} ^ {id(p) for p in self._params})} of them in one "
                f"only (rank {self.rank})")

    def _subgroup(self, color: int) -> comm.ProcessGroup:
        """A private group of the ranks with the same ``color``. Collective."""
        made = split(self._group.comm, color, self.rank)
        try:
            group = comm.ProcessGroup(made, owner="DiLoCoOptimizer")
        finally:
            free(made)
        self._subgroups.append(group)
        return group

    def _global_copy(self) -> Tuple[List[comm.FlatBuffer], List[Tuple[int, int]]]:
        """One flat buffer per dtype and device holding the parameters (on the host, pinned,
        for GPU parameters), and where each parameter sits: ``(buffer, position)``."""
        buffers, where = [], [(0, 0)] * len(self._params)
        for b, ((dtype, device), indices) in enumerate(
                comm.group_by_dtype_device(self._params).items()):
            shapes = [self._params[i].shape for i in indices]
            total = sum(s.numel() for s in shapes)
            memory = torch.empty(total, dtype=dtype, pin_memory=device.type == "cuda")
            flat = comm.FlatBuffer(shapes, dtype, buffer=memory)
            flat.copy_from([self._params[i].detach() for i in indices])
            buffers.append(flat)
            for position, i in enumerate(indices):
                where[i] = (b, position)
        return buffers, where

    def _fragment_parts(self, fragment: int) -> List[Part]:
        """The slices of the global buffers that hold ``fragment``'s parameters: contiguous,
        since a fragment is a range of parameters and each buffer keeps their order."""
        start, end = self.schedule.bounds[fragment]
        per_buffer: Dict[int, List[int]] = {}
        for i in range(start, end):
            per_buffer.setdefault(self._where[i][0], []).append(i)
        parts = []
        for b, indices in sorted(per_buffer.items()):
            flat = self._buffers[b]
            first, last = self._where[indices[0]][1], self._where[indices[-1]][1]
            parts.append((b, indices, flat.offsets[first], flat.offsets[last] + flat.numels[last]))
        return parts

    # -- the torch.optim.Optimizer interface -----------------------------------------------

    def __repr__(self) -> str:
        return (f"DiLoCoOptimizer(sync_every={self.schedule.sync_every}, fragments="
                f"{self.schedule.fragments}, overlap_steps={self.schedule.overlap_steps}, "
                f"inner={self.optim!r}, outer={self.outer_optimizer!r})")

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Refused: the global copy, the fragments and the outer optimizer are fixed at
        construction. Build a new DiLoCoOptimizer over all the parameters instead."""
        raise NotImplementedError(
            "DiLoCoOptimizer.add_param_group: the parameters are fixed at construction (the "
            "global copy, the fragments and the outer optimizer cover them); build a new "
            f"DiLoCoOptimizer over all the parameters (rank {self.rank})")

    @property
    def inner_steps(self) -> int:
        """The inner steps taken so far (the schedule counts them from 1)."""
        return self._inner_steps

    def close(self) -> None:
        """Wait for a sync still in flight (its result is not applied), then free the private
        communicators; a later step raises ``RuntimeError``. Collective; closing again does
        nothing."""
        if not self._group.closed:
            for sync in self._in_flight:
                self._complete(sync)
        for group in self._subgroups:
            group.close()
        self._group.close()

    # -- stepping --------------------------------------------------------------------------

    def step(  # type: ignore[override]
            self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """One inner step (after averaging the gradients within the node, with
        ``node_local``), then the syncs due after it: the in-flight ones whose overlap is over
        are applied, and the fragments whose turn it is start theirs (and apply it at once
        without ``overlap_steps``). Collective."""
        self._group.check_open()
        if self._node is not None and closure is not None:
            user_closure = closure

            def closure() -> float:
                loss = user_closure()
                self._average_gradients()
                return loss
        elif self._node is not None:
            self._average_gradients()
        loss = self.optim.step(closure) if closure is not None else self.optim.step()
        self._inner_steps += 1
        due = [s for s in self._in_flight
               if s.started + self.schedule.overlap_steps == self._inner_steps]
        for sync in due:
            self._in_flight.remove(sync)
            self._apply(sync)
        for fragment in self.schedule.starting(self._inner_steps):
            sync = self._start(fragment)
            if self.schedule.overlap_steps:
                self._in_flight.append(sync)
            else:
                self._apply(sync)
        return loss

    def _average_gradients(self) -> None:
        """Average the gradients over the ranks of this node, one flat allreduce per dtype.
        Collective over the node."""
        if self._node.size > 1:
            grads = [p.grad for p in self._params if p.grad is not None]
            comm.all_reduce_coalesced(grads, self._node.comm, comm.ReduceOp.AVG)

    def _local(self, indices: List[int]) -> torch.Tensor:
        """The parameters ``indices`` flattened into one new host tensor."""
        return torch.cat([self._params[i].detach().reshape(-1) for i in indices]).cpu()

    def _start(self, fragment: int) -> _Sync:
        """Compute the fragment's deltas and start their allreduce (nonblocking with
        ``overlap_steps``). Collective over the reducing group."""
        sync = _Sync(fragment, self._inner_steps)
        overlap = bool(self.schedule.overlap_steps)
        local = [self._local(indices) for _, indices, _, _ in self._parts[fragment]]
        if overlap:
            sync.local = local
        for (b, _, start, end), mine in zip(self._parts[fragment], local):
            delta = self._buffers[b].buffer[start:end] - mine
            wire = delta.to(self.delta_dtype) if self.delta_dtype is not None else delta
            sync.wire.append(wire)
            sync.works.append(self._reduce(wire, overlap))
        return sync

    def _shard(self, count: int) -> Tuple[List[int], int]:
        """How a delta of ``count`` elements is split over the ranks of a node (each sends its
        share across nodes): the counts, and where this rank's share starts."""
        size, rank = self._node.size, self._node.rank
        counts = [count // size + (r < count % size) for r in range(size)]
        return counts, sum(counts[:rank])

    def _reduce(self, wire: torch.Tensor, overlap: bool) -> Optional[comm.Work]:
        """Start the sum of ``wire`` over the replicas: all ranks, or with ``node_local``, this
        rank's share of it over the same node rank of every node."""
        if self._node is not None:
            counts, start = self._shard(wire.numel())
            wire = wire[start:start + counts[self._node.rank]]
        if self._reducer.size > 1:
            self.bytes_synced += wire.nbytes
        return comm.all_reduce(wire, self._reducer.comm, comm.ReduceOp.SUM, async_op=overlap,
                               in_dtype=True)

    def _complete(self, sync: _Sync) -> List[torch.Tensor]:
        """Wait for the sync's allreduce and form the averaged deltas (once). Collective over
        the node with ``node_local`` (its ranks gather their shares)."""
        if sync.average is None:
            average = []
            for (b, _, _, _), wire, work in zip(self._parts[sync.fragment], sync.wire,
                                                sync.works):
                if work is not None:
                    work.wait()
                if self._node is not None and self._node.size > 1:
                    counts, _ = self._shard(wire.numel())
                    comm.all_gather_v(wire, counts, self._node.comm)
                delta = wire.to(self._buffers[b].buffer.dtype)
                average.append(delta.div_(self._reducer.size))
            sync.average, sync.wire, sync.works = average, [], []
        return sync.average

    def _apply(self, sync: _Sync) -> None:
        """The outer step of the sync's fragment: its parameters set to the global copy, their
        gradients to the averaged deltas (the other parameters' to ``None``), the outer
        optimizer stepped, the result kept as the global copy; with overlap, the inner steps
        taken meanwhile are added back. The inner gradients are restored afterwards."""
        average = self._complete(sync)
        parts = self._parts[sync.fragment]
        saved = [p.grad for p in self._params]
        try:
            with torch.no_grad():
                drift = [None] * len(parts)
                if sync.local is not None:
                    drift = [self._local(indices).sub_(before)
                             for (_, indices, _, _), before in zip(parts, sync.local)]
                for p in self._params:
                    p.grad = None
                for (_, indices, _, _), delta in zip(parts, average):
                    params = [self._params[i] for i in indices]
                    torch._foreach_copy_(params, self._global_views(indices))
                    for param, grad in zip(params, self._shaped(indices, delta)):
                        param.grad = grad.to(param.device)
                self.outer_optimizer.step()
                for (_, indices, _, _), moved in zip(parts, drift):
                    params = [self._params[i] for i in indices]
                    torch._foreach_copy_(self._global_views(indices), params)
                    if moved is not None:
                        torch._foreach_add_(params, [m.to(p.device) for m, p in
                                                     zip(self._shaped(indices, moved), params)])
        finally:
            for p, grad in zip(self._params, saved):
                p.grad = grad

    def _global_views(self, indices: Sequence[int]) -> List[torch.Tensor]:
        """The global copy's views of the parameters ``indices``."""
        return [self._buffers[self._where[i][0]].views[self._where[i][1]] for i in indices]

    def _shaped(self, indices: List[int], flat: torch.Tensor) -> List[torch.Tensor]:
        """Views of ``flat``, a fragment's part laid out like the global copy, shaped like the
        parameters ``indices``."""
        return comm.FlatBuffer([self._params[i].shape for i in indices], flat.dtype,
                               buffer=flat).views

    # -- checkpoints -----------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """The inner and outer optimizers' state dicts, the global copy (one tensor per
        parameter), the inner step count, the schedule and the syncs in flight (their
        averaged deltas and the fragment as it was when they started), so that a loaded
        optimizer continues exactly. With a sync in flight this waits for its allreduce, so it
        is collective then; its result is still applied at its own step. At a sync boundary
        (nothing in flight) the state is the same on every rank."""
        in_flight = []
        for sync in self._in_flight:
            in_flight.append({"fragment": sync.fragment, "started": sync.started,
                              "average": [t.clone() for t in self._complete(sync)],
                              "local": [t.clone() for t in sync.local or []]})
        return {"inner": self.optim.state_dict(), "outer": self.outer_optimizer.state_dict(),
                "global": [t.clone() for t in self._global_views(range(len(self._params)))],
                "inner_steps": self._inner_steps, "schedule": self.schedule.settings(),
                "in_flight": in_flight}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a :meth:`state_dict`, from a run at any world size when it was taken at a sync
        boundary (the global copy and the outer state are the same on every rank). The model's
        own parameters are not part of it: load them with the model. The caller's dict is left
        unchanged. Collective: a rank that refuses the dict makes every rank raise.

        Raises:
            ValueError: the dict was made with other ``sync_every``, ``fragments`` or
                ``overlap_steps``, or for other parameters (count or shapes).
        """
        with fail_together(self._group.comm, "DiLoCoOptimizer.load_state_dict",
                           catch=(KeyError, ValueError), own_errors=True,
                           items=[("schedule", sorted(self.schedule.settings().items()))]):
            self._check_loadable(state_dict)
        self.optim.load_state_dict(state_dict["inner"])
        self.outer_optimizer.load_state_dict(state_dict["outer"])
        with torch.no_grad():
            torch._foreach_copy_(self._global_views(range(len(self._params))),
                                 list(state_dict["global"]))
        self._inner_steps = int(state_dict["inner_steps"])
        self._in_flight = []
        for entry in state_dict["in_flight"]:
            sync = _Sync(int(entry["fragment"]), int(entry["started"]))
            sync.average = [t.clone() for t in entry["average"]]
            sync.local = [t.clone() for t in entry["local"]] or None
            self._in_flight.append(sync)

    def _check_loadable(self, state_dict: Dict[str, Any]) -> None:
        ours = self.schedule.settings()
        theirs = state_dict["schedule"]
        different = [f"{name}={theirs.get(name)} (this optimizer has {value})"
                     for name, value in ours.items() if theirs.get(name) != value]
        if different:
            raise ValueError("DiLoCoOptimizer.load_state_dict: the state was saved with "
                             f"{', '.join(different)} (rank {self.rank})")
        shapes = [tuple(t.shape) for t in state_dict["global"]]
        if shapes != [tuple(p.shape) for p in self._params]:
            raise ValueError("DiLoCoOptimizer.load_state_dict: the state's global copy holds "
                             f"{len(shapes)} parameters of other shapes than this optimizer's "
                             f"{len(self._params)} (rank {self.rank})")
