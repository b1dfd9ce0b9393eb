"""DistributedDataParallel over MPI: replicas of a module whose gradients are averaged in
buckets, overlapped with the backward pass (see :mod:`.reducer`).

Communication hooks (``register_comm_hook``) follow PyTorch's interface: ``hook(state, bucket)``
gets a :class:`~tensorplay_hpc.distributed.algorithms.ddp_comm_hooks.grad_bucket.GradBucket`
(``buffer()``, ``parameters()``, ``gradients()``, ``index()``, ``is_last()``) and returns an
object whose ``wait()`` gives the reduced flat tensor, or a ``torch.futures.Future`` of it; see
:mod:`tensorplay_hpc.distributed.algorithms.ddp_comm_hooks` for the details and built-in hooks.

Uneven inputs: the module is a :class:`~tensorplay_hpc.distributed.algorithms.join.Joinable`.
Inside ``with ddp.join():`` (or ``Join([ddp, optimizer])``) a rank that ran out of inputs
shadows the others' iterations as PyTorch's DDP does: each forward pass of a rank still training
all-reduces whether its backward pass synchronizes (which also counts the ranks still training),
and a joined rank answers it, then the buffer broadcast (from the highest rank still training),
every bucket's reduction with zero gradients and the end-of-pass agreement. When all have
joined, the parameters (and buffers) of the highest rank among the last to join are broadcast.
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator, List, Optional

import torch
from tensorplay_hpc.comm.mpi import MPI
from torch.utils._pytree import tree_map

from tensorplay_hpc import comm
from tensorplay_hpc.comm import trace
from tensorplay_hpc.comm.agreement import fail_together
from tensorplay_hpc.distributed.algorithms.ddp_comm_hooks.grad_bucket import GradBucket
from tensorplay_hpc.distributed.algorithms.join import Join, Joinable, JoinHook

from .arguments import Arguments, check_arguments
from .reducer import Reducer

__all__ = ["DistributedDataParallel"]


class _DDPJoinHook(JoinHook):
    """On a rank out of inputs: shadows DDP's collectives of each iteration the others train,
    then syncs the final model."""

    def __init__(self, ddp: "DistributedDataParallel", divide_by_initial_world_size: bool) -> None:
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        self.ddp._shadow_iteration()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.ddp._sync_final_model(is_last_joiner)


class DistributedDataParallel(torch.nn.Module, Joinable, comm.Closeable):
    """Data parallelism over MPI, PyTorch's ``DistributedDataParallel`` for mpi4py groups.

    At construction, parameters and buffers are broadcast from rank 0 (one flat buffer per
    dtype). In each backward pass the gradients are averaged across the group, bucket by bucket,
    while the rest of the backward pass runs; they are in place when ``backward()`` returns.
    Collective: construct it, run forward and backward on every rank of the group. As in
    PyTorch, only a backward pass from the output of this module's own forward pass is
    averaged: one through ``ddp.module(...)`` (or a second one through the same graph) keeps
    its gradients local, on the ranks that run it.

    The arguments are PyTorch's, with its names, order and defaults:

    Args:
        module: the module to replicate (already on its device).
        device_ids: ``None`` for a CPU or multi-device module; for a module on one GPU, ``None``
            or that one device (inputs are then moved to it in ``forward``).
        output_device: ``None``, or with ``device_ids`` a device index (outputs are not moved,
            as in PyTorch for a single device).
        dim: kept for compatibility (PyTorch uses it only for several devices per process).
        broadcast_buffers: deprecated in PyTorch (a ``FutureWarning``): ``False`` syncs buffers
            neither at construction nor before each forward pass.
        init_sync: broadcast rank 0's parameters and buffers at construction (the model and
            argument checks run anyway).
        process_group: the data-parallel group (``None`` is ``MPI.COMM_WORLD``).
        bucket_cap_mb: bucket size in MiB (``None`` is 25; the first bucket is at most 1 MiB).
        find_unused_parameters: let parameters go without a gradient in some iterations or on
            some ranks (they count as zeros; parameters unused on every rank keep their
            ``grad``). Without it, a parameter without a gradient on any rank raises the same
            ``RuntimeError`` on every rank when the backward pass ends.
        check_reduction: deprecated, no effect (a ``FutureWarning`` when true), as in PyTorch.
        gradient_as_bucket_view: gradients are views into the bucket buffers (fewer copies).
        static_graph: the same parameters are used in every iteration (see
            :meth:`_set_static_graph`).
        delay_all_reduce_named_params: not supported here (``NotImplementedError``).
        param_to_hook_all_reduce: not supported here (``NotImplementedError``).
        mixed_precision: not supported here (``NotImplementedError``).
        device_mesh: not supported here (``NotImplementedError``).
        bucket_cap_mb_list: not supported here (``NotImplementedError``).
        skip_all_reduce_unused_params: only ``False`` (``True`` is ``NotImplementedError``).
        batched_grad_copy: accepted; the gradients are copied into the buckets as they arrive
            either way.
        forward_sync_buffers: broadcast buffers from rank 0 before each training forward pass
            (``None``: ``broadcast_buffers``, else true); buffers are synced at construction.

    Raises:
        TypeError, ValueError, RuntimeError, NotImplementedError: an argument that is wrong or
            cannot apply here (the message names it); see :func:`.arguments.check_arguments`.
        ValueError: the ranks' models (names, shapes, dtypes, devices, ``requires_grad``) or
            arguments differ, or only some ranks hit one of the errors above (names the ranks
            and the first difference), on every rank.
    """

    def __init__(self, module: torch.nn.Module, device_ids: Optional[List[Any]] = None,
                 output_device: Optional[Any] = None, dim: int = 0,
                 broadcast_buffers: Optional[bool] = None, init_sync: bool = True,
                 process_group: Optional[MPI.Intracomm] = None,
                 bucket_cap_mb: Optional[float] = None, find_unused_parameters: bool = False,
                 check_reduction: bool = False, gradient_as_bucket_view: bool = False,
                 static_graph: bool = False, delay_all_reduce_named_params: Any = None,
                 param_to_hook_all_reduce: Any = None, mixed_precision: Any = None,
                 device_mesh: Any = None, skip_all_reduce_unused_params: bool = False,
                 bucket_cap_mb_list: Optional[List[int]] = None, batched_grad_copy: bool = False,
                 forward_sync_buffers: Optional[bool] = None) -> None:
        super().__init__()
        Joinable.__init__(self)
        self.process_group = comm.resolve(process_group)
        self._group = comm.ProcessGroup(self.process_group, owner="DistributedDataParallel")
        settings = None
        try:
            # Where every rank refuses the arguments, each raises its own error, as PyTorch's
            # DDP does: an argument such as device_ids=[rank] is meant to differ by rank.
            with fail_together(
                    self._group.comm, "DistributedDataParallel: the arguments",
                    catch=(TypeError, ValueError, RuntimeError, NotImplementedError),
                    own_errors=True, valid_items=lambda: [
                        ("bucket_cap_mb", settings.bucket_cap_mb),
                        ("find_unused_parameters", find_unused_parameters),
                        ("broadcast_buffers", settings.forward_sync_buffers),
                        ("gradient_as_bucket_view", gradient_as_bucket_view),
                        ("static_graph", static_graph),
                        ("init_sync", init_sync)]):
                settings = check_arguments(Arguments(
                    module=module, device_ids=device_ids, output_device=output_device, dim=dim,
                    broadcast_buffers=broadcast_buffers, init_sync=init_sync,
                    process_group=process_group, bucket_cap_mb=bucket_cap_mb,
                    find_unused_parameters=find_unused_parameters,
                    check_reduction=check_reduction,
                    gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph,
                    delay_all_reduce_named_params=delay_all_reduce_named_params,
                    param_to_hook_all_reduce=param_to_hook_all_reduce,
                    mixed_precision=mixed_precision, device_mesh=device_mesh,
                    skip_all_reduce_unused_params=skip_all_reduce_unused_params,
                    bucket_cap_mb_list=bucket_cap_mb_list, batched_grad_copy=batched_grad_copy,
                    forward_sync_buffers=forward_sync_buffers))
        except Exception:
            self._group.close()   # every rank raises: free the duplicate now
            raise
        self.module = module
        named_params = list(module.named_parameters())
        named_buffers = list(module.named_buffers())
        named = named_params + named_buffers
        signature = comm.tensor_signature([n for n, _ in named], [t for _, t in named])
        comm.check_consistent(self._group.comm, "DistributedDataParallel: the model", [
            (name, described, f"requires_grad={tensor.requires_grad}")
            for (name, described), (_, tensor) in zip(signature, named)])
        self.device_ids = settings.device_ids
        self.output_device = settings.output_device
        self.dim = dim
        self.device = settings.device
        self.device_type = settings.device.type
        self.is_multi_device_module = settings.is_multi_device_module
        self.forward_sync_buffers = settings.forward_sync_buffers
        self.bucket_bytes_cap = int(settings.bucket_cap_mb * 2**20)
        self.mixed_precision = None
        self.batched_grad_copy = batched_grad_copy
        self._buffers_to_sync = [b for _, b in named_buffers]
        if init_sync:
            initial = [p.detach() for _, p in named_params]
            if settings.init_sync_buffers:
                initial += self._buffers_to_sync
            with torch.no_grad(), trace.caller("DDP initial broadcast"):
                comm.broadcast_coalesced(initial, self._group.comm, root=0)
        trained = [(name, p) for name, p in named_params if p.requires_grad]
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.require_backward_grad_sync = True
        self.static_graph = False
        self._divide_by_initial_world_size = True
        self.reducer = Reducer([p for _, p in trained], [name for name, _ in trained],
                               self._group.comm, self.bucket_bytes_cap,
                               find_unused_parameters, gradient_as_bucket_view)
        if static_graph:
            self._set_static_graph()

    @property
    def broadcast_buffers(self) -> bool:
        """Whether buffers are broadcast before each training forward pass (PyTorch's alias of
        ``forward_sync_buffers``)."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    def _set_static_graph(self) -> None:
        """Declare that the same parameters are used in every iteration, as PyTorch's method of
        this name: the first backward pass learns which parameters have no gradient on each
        rank, and later passes skip them without searching the graph (``find_unused_parameters``
        is then not needed). Call it before training, on every rank; ``static_graph=True``
        calls it. ZeroRedundancyOptimizer's ``overlap_with_ddp`` warms up one iteration longer
        with it, as in PyTorch."""
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.",
                          stacklevel=2)
            return
        self.static_graph = True
        self.reducer.set_static_graph()
        if self.find_unused_parameters:
            warnings.warn(
                "You passed find_unused_parameters=true to DistributedDataParallel, "
                "`_set_static_graph` will detect unused parameters automatically, so you do not "
                "need to set find_unused_parameters=true, just be sure these unused parameters "
                "will not change during training loop while calling `_set_static_graph`.",
                stacklevel=2)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the module; prepares the gradient reduction of the next backward pass. Inside a
        join context, tells the ranks that have joined what to shadow."""
        self._group.check_open()
        training = torch.is_grad_enabled()
        sync = training and self.require_backward_grad_sync
        Join.notify_join_context(self)
        divisor = None
        if self._join_config.enable:
            syncing = self._count_syncing(sync)
            if not self._divide_by_initial_world_size and sync:
                divisor = syncing
        if sync and self.forward_sync_buffers and self._buffers_to_sync:
            root = self._common_rank(True) if self._join_config.enable else 0
            self._broadcast_buffers(root)
        if self.device_ids:
            device = torch.device(self.device_type, self.device_ids[0])
            inputs, kwargs = tree_map(
                lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, (inputs, kwargs))
        output = self.module(*inputs, **kwargs)
        if training:
            self.reducer.prepare(sync, output, divisor)
        return output

    def _count_syncing(self, sync: bool) -> int:
        """How many ranks synchronize gradients in this iteration (ranks that have joined
        count 0). Collective: one allreduce of one number."""
        flag = torch.tensor([1 if sync else 0], dtype=torch.int64)
        comm.all_reduce(flag, self._group.comm)
        return int(flag.item())

    def _common_rank(self, candidate: bool) -> int:
        """The highest rank among the candidates. Collective."""
        rank = torch.tensor([self._group.rank if candidate else -1], dtype=torch.int64)
        comm.all_reduce(rank, self._group.comm, comm.ReduceOp.MAX)
        return int(rank.item())

    def _broadcast_buffers(self, root: int) -> None:
        with torch.no_grad():
            comm.broadcast_coalesced(self._buffers_to_sync, self._group.comm, root=root)

    def _shadow_iteration(self) -> None:
        """On a rank that has joined: the collectives of one iteration of the ranks still
        training (forward and, when they synchronize, backward). Collective."""
        if self._count_syncing(False) == 0:
            return
        if self.forward_sync_buffers and self._buffers_to_sync:
            self._broadcast_buffers(self._common_rank(False))
        self.reducer.shadow_pass()

    def _sync_final_model(self, is_last_joiner: bool) -> None:
        """Broadcast the parameters (and, with ``forward_sync_buffers``, the buffers) of the
        highest rank among the last to join. Collective."""
        root = self._common_rank(is_last_joiner)
        tensors = [p.detach() for p in self.module.parameters()]
        if self.forward_sync_buffers:
            tensors += self._buffers_to_sync
        with torch.no_grad():
            comm.broadcast_coalesced(tensors, self._group.comm, root=root)

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """A context manager for training with uneven inputs, as PyTorch's ``DDP.join``.

        Args:
            divide_by_initial_world_size: divide the summed gradients by the group size even
                when some ranks have joined (each sample weighs the same); ``False`` divides
                by the number of ranks still training (the built-in reduction only; a
                communication hook divides as it does).
            enable: ``False`` makes it a no-op (inputs known to be even).
            throw_on_early_termination: raise ``RuntimeError`` on every rank as soon as one
                runs out of inputs.

        Creating it is collective over the group.
        """
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook that shadows this module's collectives on a rank that has joined; reads
        ``divide_by_initial_world_size`` (default ``True``) from ``kwargs``."""
        return _DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        """The device of the module's parameters."""
        return self.device

    @property
    def join_process_group(self) -> MPI.Intracomm:
        """The data-parallel group."""
        return self.process_group

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes of forward passes run inside accumulate gradients locally; the first
        synchronized backward pass afterwards averages the accumulated sums."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def close(self) -> None:
        """Free the private communicator and remove the gradient hooks; a later forward pass
        raises ``RuntimeError``. Collective over the process group; closing again does
        nothing. The wrapped module is left as it is."""
        self.reducer.close()
        self._group.close()

    def register_comm_hook(self, state: Any, hook: Callable[[Any, GradBucket], Any]) -> None:
        """Reduce each bucket with ``hook(state, bucket)`` instead of the built-in averaging.
        Call once, before the first backward pass, on every rank."""
        self.reducer.register_comm_hook(state, hook)

    @property
    def buckets(self) -> List[GradBucket]:
        """The gradient buckets, in reduction order."""
        return self.reducer.buckets
