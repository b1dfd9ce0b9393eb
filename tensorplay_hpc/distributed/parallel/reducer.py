"""Gradient buckets and their reduction, overlapped with the backward pass.

Each parameter has a post-accumulate-grad hook. When it fires, the gradient is copied into its
slot of a flat bucket buffer (nothing to copy when it already lives there); when every slot of a
bucket is filled, the bucket's reduction starts while the backward pass goes on. Buckets start
strictly in index order, so every rank issues the same collectives in the same order whatever
order its gradients arrive in. A callback queued on the autograd engine waits for all buckets when
the backward pass ends and writes the averaged gradients back.

Without ``gradient_as_bucket_view`` and without a communication hook no bucket buffer is needed:
the built-in reduction averages a bucket's gradients where they are
(:func:`tensorplay_hpc.comm.all_reduce_coalesced`: a gradient of a piece or more in its own
memory, smaller ones through a piece-sized staging buffer), which saves copying every gradient
into the buckets and back.

What goes wrong on one rank only (a parameter without a gradient there, a gradient arriving twice)
must not leave the other ranks waiting: the missing gradients count as zeros, so every bucket is
still reduced, and the callback then runs one small allreduce of a few bytes (a "problem" flag
and which parameters were used) over the group. When any rank flags a problem, every rank raises
the same ``RuntimeError``, naming the ranks and the parameters. The same allreduce tells
``find_unused_parameters`` which parameters were used on some rank.

The built-in reduction runs on the communicator's worker thread (:mod:`tensorplay_hpc.comm.worker`):
it waits without spinning until every rank has the bucket, then runs blocking allreduces in
cache-sized pieces (:mod:`tensorplay_hpc.comm.chunking`). Open MPI's nonblocking allreduce
advances only inside MPI calls and, in place or below 4 ranks, uses a binomial tree; measured
on 2 ranks it was 3-4x slower than the blocking one in pieces. Communication hooks return their
own handles (usually a ``comm.Work`` of collectives queued to the same worker).
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch
from tensorplay_hpc.comm.mpi import MPI
from torch.utils._pytree import tree_leaves

from tensorplay_hpc import comm
from tensorplay_hpc.comm import trace, worker
from tensorplay_hpc.comm.small_collectives import BACKGROUND_PAUSE_S
from tensorplay_hpc.distributed.algorithms.ddp_comm_hooks.default_hooks import BucketWork
from tensorplay_hpc.distributed.algorithms.ddp_comm_hooks.grad_bucket import (
    CommHook, GradBucket, HookResult, result_done, result_tensor)

from .gradient_places import GradientPlaces, InBuckets, InPlace

__all__ = ["FIRST_BUCKET_BYTES", "Reducer", "assign_buckets", "reachable_parameters"]

FIRST_BUCKET_BYTES = 1 << 20   # a small first bucket starts communication early, as in PyTorch

def assign_buckets(params: Sequence[torch.Tensor], cap_bytes: int) -> List[List[int]]:
    """Parameter indices per bucket: reverse parameter order (roughly the order gradients
    arrive in), one dtype and device per bucket, each closed once it holds ``cap_bytes`` (the
    first one at ``min(cap_bytes, 1 MiB)``)."""
    buckets: List[List[int]] = []
    open_buckets: Dict[Tuple[torch.dtype, torch.device], List] = {}
    for index in reversed(range(len(params))):
        param = params[index]
        entry = open_buckets.setdefault((param.dtype, param.device), [[], 0])
        entry[0].append(index)
        entry[1] += param.numel() * param.element_size()
        limit = min(cap_bytes, FIRST_BUCKET_BYTES) if not buckets else cap_bytes
        if entry[1] >= limit:
            buckets.append(entry[0])
            del open_buckets[(param.dtype, param.device)]
    buckets.extend(indices for indices, _ in open_buckets.values())
    return buckets


def reachable_parameters(outputs: Any) -> Set[int]:
    """``id``s of the leaf tensors the autograd graph of ``outputs`` reaches."""
    found: Set[int] = set()
    stack = []
    for leaf in tree_leaves(outputs):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            if leaf.grad_fn is None:
                found.add(id(leaf))
            else:
                stack.append(leaf.grad_fn)
    seen = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            found.add(id(variable))
        stack.extend(child for child, _ in node.next_functions)
    return found


def _on_grad(reducer_ref: "weakref.ref[Reducer]", index: int, param: torch.Tensor) -> None:
    reducer = reducer_ref()
    if reducer is not None:
        reducer.gradient_ready(index)


def _remove(handles: Iterable[Any]) -> None:
    for handle in handles:
        handle.remove()


class Reducer:
    """Buckets the gradients of ``params`` and averages them over ``communicator``.

    Args:
        params: the parameters that require gradients, in module order.
        names: their names, for error messages.
        communicator: the private communicator of the data-parallel group.
        bucket_cap_bytes: the size at which a bucket closes.
        find_unused_parameters: parameters without a gradient count as zero gradients, and
            those unused on every rank keep their ``grad``.
        gradient_as_bucket_view: leave ``param.grad`` as a view of the bucket buffer, which saves
            the copy back (and the copy in, when gradients accumulate into it).
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], names: Sequence[str],
                 communicator: MPI.Intracomm, bucket_cap_bytes: int,
                 find_unused_parameters: bool, gradient_as_bucket_view: bool) -> None:
        self.params = list(params)
        self.names = list(names)
        self.comm = communicator
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = False
        # Learnt in the first synchronized pass of a static graph: the parameters without a
        # gradient on this rank, and which parameters had one on some rank.
        self._static_unused: Optional[List[int]] = None
        self._static_used: Optional[List[bool]] = None
        layout = assign_buckets(self.params, bucket_cap_bytes)
        self._bucket_indices = layout
        self.buckets = [GradBucket(b, [self.params[i] for i in indices], b == len(layout) - 1)
                        for b, indices in enumerate(layout)]
        self._slot: List[Tuple[int, int]] = [(0, 0)] * len(self.params)
        for b, indices in enumerate(layout):
            for position, index in enumerate(indices):
                self._slot[index] = (b, position)
        self._hook: Optional[CommHook] = None
        self._hook_state: Any = None
        self.divisor: Optional[int] = None   # None: the group size
        self._places: GradientPlaces = (
            InBuckets(self.params, self.buckets, self._slot, as_view=True)
            if gradient_as_bucket_view else
            InPlace(self.params, self.buckets, self._slot, self._bucket_indices))
        self._unused: Sequence[int] = ()
        self._used = [False] * len(self.params)   # locally, since the last synchronized pass
        self._reset()
        reducer_ref = weakref.ref(self)
        handles = [p.register_post_accumulate_grad_hook(
            lambda param, index=i: _on_grad(reducer_ref, index, param))
            for i, p in enumerate(self.params)]
        # MPI from a second thread needs MPI_THREAD_MULTIPLE (mpi4py's default); without it the
        # buckets are reduced in the hooks, blocking.
        self._threaded = worker.available()
        self._release = weakref.finalize(self, _remove, handles)

    def close(self) -> None:
        """Remove the gradient hooks. Local."""
        self._release()

    def _reset(self) -> None:
        # Gradients are reduced only in a backward pass that follows a synchronizing forward
        # pass through DDP (prepare() sets it): a backward pass through the bare module, or a
        # second one through the same graph, keeps its gradients local, as in PyTorch.
        self.sync = False
        self._ready = [False] * len(self.params)
        self._late: List[int] = []   # parameters whose gradient came when already ready
        self._pending = [len(bucket.parameters()) for bucket in self.buckets]
        self._next_bucket = 0
        self._results: List[HookResult] = []
        self._tested = 0
        self._started = False

    def set_static_graph(self) -> None:
        """The same parameters get gradients in every iteration: the first synchronized backward
        pass learns which have none on this rank (they count as zeros, as with
        ``find_unused_parameters``, without searching the graph), and later passes treat
        exactly those as unused."""
        self.static_graph = True
        self._static_unused = None
        self._static_used = None

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        if self._hook is not None:
            raise RuntimeError("register_comm_hook can only be called once "
                               f"(world rank {MPI.COMM_WORLD.Get_rank()})")
        self._hook, self._hook_state = hook, state
        if isinstance(self._places, InPlace):   # a hook is given the bucket buffers
            self._places = InBuckets(self.params, self.buckets, self._slot, as_view=False)

    def prepare(self, sync: bool, outputs: Any, divisor: Optional[int] = None) -> None:
        """Set up the next backward pass after a forward pass that produced ``outputs``;
        the built-in reduction divides the summed gradients by ``divisor`` (``None``: the group
        size)."""
        if self._started:
            waiting = [self.names[i] for i, ready in enumerate(self._ready) if not ready]
            raise RuntimeError(
                "DistributedDataParallel: the previous backward pass did not finish reducing "
                f"gradients on rank {self.comm.Get_rank()}; parameters still waiting: {waiting}")
        self.sync = sync
        self.divisor = divisor
        self._unused = ()
        if sync and self.static_graph:
            self._unused = self._static_unused or ()
        elif sync and self.find_unused_parameters:
            reached = reachable_parameters(outputs)
            self._unused = [i for i, p in enumerate(self.params) if id(p) not in reached]

    def gradient_ready(self, index: int) -> None:
        """The post-accumulate-grad hook of parameter ``index``."""
        self._used[index] = True
        if not self.sync:
            return
        if not self._started:
            self._started = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
            for unused in self._unused:
                self._mark_ready(unused)
        if self._ready[index]:
            self._late.append(index)   # reported when the pass ends, on every rank
            return
        self._mark_ready(index, own=True)
        self._progress()

    def _late_gradients(self) -> List[str]:
        """What the gradients of parameters that were already ready mean."""
        kinds: Dict[str, List[str]] = {}
        for index in self._late:
            if index in self._unused and self.static_graph:
                kind = ("parameters received a gradient but had none in the first iteration "
                        "(static_graph=True needs the same parameters used in every iteration)")
            elif index in self._unused:
                kind = ("parameters received a gradient although the forward pass's output does "
                        "not depend on them")
            else:
                kind = "parameters received a gradient twice in one backward pass"
            kinds.setdefault(kind, []).append(self.names[index])
        return [f"{kind}: {names}" for kind, names in kinds.items()]

    def _mark_ready(self, index: int, own: bool = False) -> None:
        """Make parameter ``index``'s gradient (zeros if it has none) ready for its bucket's
        reduction; ``own``: the gradient was computed in this pass (its hook fired)."""
        b, _ = self._slot[index]
        self._places.place(index, own)
        self._ready[index] = True
        self._pending[b] -= 1
        while (self._next_bucket < len(self.buckets)
               and self._pending[self._next_bucket] == 0):
            self._results.append(self._start(self.buckets[self._next_bucket]))
            self._next_bucket += 1

    def _start(self, bucket: GradBucket,
               gradients: Optional[List[torch.Tensor]] = None) -> HookResult:
        """Start ``bucket``'s reduction: its hook's, else the built-in one of ``gradients``
        (by default what the gradients' places give for the bucket)."""
        with trace.caller(f"DDP bucket {bucket.index()}"):
            if self._hook is not None:
                return self._hook(self._hook_state, bucket)
            return self.submit(self._places.inputs(bucket) if gradients is None else gradients,
                               self._reduce)

    def submit(self, tensor: Any, reduce: Callable[[Any], None]) -> HookResult:
        """Run ``reduce(tensor)``, blocking collectives, on the worker of the group's
        communicator after the calls already queued there (right here without workers); return
        a hook result for it. For hooks whose collectives are faster blocking. Local."""
        return BucketWork(tensor, comm.in_background(self.comm, functools.partial(reduce, tensor)))

    def _reduce(self, tensors: List[torch.Tensor]) -> None:
        """The built-in reduction of one bucket (its buffer, or its gradients where they are),
        in place."""
        if self._threaded:
            # A blocking collective would spin while late ranks finish their backward pass,
            # taking the core their backward pass (and ours) needs: wait for them quietly first.
            comm.quiet_barrier(self.comm, BACKGROUND_PAUSE_S)
        if self.divisor is None:
            # Each piece is divided right after its sum, while it is still in the cache.
            comm.all_reduce_coalesced(tensors, self.comm, comm.ReduceOp.AVG)
        else:
            comm.all_reduce_coalesced(tensors, self.comm, comm.ReduceOp.SUM)
            torch._foreach_div_(tensors, self.divisor)

    def shadow_pass(self) -> None:
        """On a rank that has run out of inputs: the collectives of one synchronized backward
        pass, every bucket reduced with zero gradients (through the communication hook if one
        is registered), then the end-of-pass agreement; the parameters' gradients are left as
        they are. Raises the other ranks' error if their pass failed. Collective."""
        results = [self._start(bucket, zeros) for bucket, zeros in self._places.shadow()]
        for result in results:
            result_tensor(result)
        failed, _ = self.agree_on_pass(False, [False] * len(self.params))
        if failed:
            comm.agree(self.comm, None, "DistributedDataParallel's backward pass")

    def _progress(self) -> None:
        while self._tested < len(self._results) and result_done(self._results[self._tested]):
            self._tested += 1

    def _finalize(self) -> None:
        """Runs when the backward pass ends: completes every bucket, agrees with the other ranks
        that nothing went wrong anywhere, writes gradients back. Collective."""
        try:
            missing = [i for i, ready in enumerate(self._ready) if not ready]
            learning = self.static_graph and self._static_unused is None
            problems = self._late_gradients()
            if missing and not (self.find_unused_parameters or learning):
                problems.append(
                    f"parameters received no gradient in the backward pass: "
                    f"{[self.names[i] for i in missing]}; if they are not used in producing the "
                    "loss on some ranks or in some iterations, pass find_unused_parameters=True "
                    "(their gradients were averaged as zeros meanwhile)")
            for index in missing:   # zeros keep the collectives matched on every rank
                self._mark_ready(index)
            consumed = set()
            for bucket, result in zip(self.buckets, self._results):
                self._places.reduced(bucket, result, result_tensor(result), consumed)
            failed, used = self.agree_on_pass(bool(problems))
            if learning:
                self._static_unused, self._static_used = missing, used
            if self.static_graph:
                self._write_back(self._static_used, consumed)
            else:
                self._write_back(used if self.find_unused_parameters else None, consumed)
        finally:
            self._used = [False] * len(self.params)
            self._places.reset()
            self._reset()
        if failed:
            error = RuntimeError("; ".join(problems)) if problems else None
            comm.agree(self.comm, error, "DistributedDataParallel's backward pass")

    def agree_on_pass(self, problem: bool = False,
                       used: Optional[Sequence[bool]] = None) -> Tuple[bool, List[bool]]:
        """Whether any rank had a ``problem`` in this pass, and which parameters had a gradient
        on some rank (``used`` here, by default those used since the last synchronized pass).
        Collective: one allreduce of ``1 + len(params)`` bytes."""
        used = self._used if used is None else used
        flags = torch.tensor([problem, *used], dtype=torch.bool)
        with trace.caller("DDP end of backward"):
            comm.all_reduce(flags, self.comm, comm.ReduceOp.MAX)
        values = flags.tolist()
        return values[0], values[1:]

    def _write_back(self, used: Optional[List[bool]], consumed: Set[int]) -> None:
        """Give the parameters their averaged gradients; those of the ``consumed`` buckets
        (their hook used the gradients itself) get none, and those buckets free their
        buffers."""
        targets: List[torch.Tensor] = []
        sources: List[torch.Tensor] = []
        for index, param in enumerate(self.params):
            if self._slot[index][0] in consumed:
                param.grad = None
            elif used is None or used[index]:   # unused everywhere: kept as is, like PyTorch
                self._places.write_back(index, targets, sources)
        if targets:
            torch._foreach_copy_(targets, sources)
        for b in consumed:
            self.buckets[b].release()
