"""DistributedDataParallel over MPI: replicas of a module whose gradients are averaged in
buckets, overlapped with the backward pass (see :mod:`.reducer`).

Communication hooks (``register_comm_hook``) follow PyTorch's interface: ``hook(state, bucket)``
gets a :class:`~.reducer.GradBucket` (``buffer()``, ``parameters()``, ``gradients()``,
``index()``, ``is_last()``) and returns an object whose ``wait()`` gives the reduced flat tensor,
or a ``torch.futures.Future`` of it; see
:mod:`tensorplay_hpc.distributed.algorithms.ddp_comm_hooks` for the details and built-in hooks.
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator, List, Optional

import torch
from mpi4py import MPI

from tensorplay_hpc import comm

from .reducer import GradBucket, Reducer

__all__ = ["DistributedDataParallel"]

class DistributedDataParallel(torch.nn.Module):
    """Data parallelism over MPI, PyTorch's ``DistributedDataParallel`` for mpi4py groups.

    At construction, parameters and buffers are broadcast from rank 0 (one flat buffer per
    dtype). In each backward pass the gradients are averaged across the group, bucket by bucket,
    while the rest of the backward pass runs; they are in place when ``backward()`` returns.
    Collective: construct it, run forward and backward on every rank of the group.

    Args:
        module: the module to replicate (already on its device).
        process_group: the data-parallel group (``None`` is ``MPI.COMM_WORLD``).
        bucket_cap_mb: bucket size in MiB (the first bucket is at most 1 MiB).
        find_unused_parameters: let parameters go without a gradient in some iterations or on
            some ranks (they count as zeros; parameters unused on every rank keep their
            ``grad``). Without it, a parameter without a gradient on any rank raises the same
            ``RuntimeError`` on every rank when the backward pass ends.
        broadcast_buffers: broadcast buffers from rank 0 before each training forward pass.
        gradient_as_bucket_view: gradients are views into the bucket buffers (fewer copies).
        static_graph: the same parameters are used in every iteration (see
            :meth:`_set_static_graph`).

    Raises:
        ValueError: the ranks' models (names, shapes, dtypes, devices, ``requires_grad``) or
            arguments differ (names the ranks and the first difference), on every rank.
    """

    def __init__(self, module: torch.nn.Module, process_group: Optional[MPI.Comm] = None,
                 bucket_cap_mb: float = 25, find_unused_parameters: bool = False,
                 broadcast_buffers: bool = True, gradient_as_bucket_view: bool = False,
                 static_graph: bool = False) -> None:
        super().__init__()
        self.module = module
        self.process_group = comm.resolve(process_group)
        self._group = comm.ProcessGroup(self.process_group)
        named_params = list(module.named_parameters())
        named_buffers = list(module.named_buffers())
        named = named_params + named_buffers
        signature = comm.tensor_signature([n for n, _ in named], [t for _, t in named])
        comm.check_consistent(self._group.comm, "DistributedDataParallel: the model", [
            (name, described, f"requires_grad={tensor.requires_grad}")
            for (name, described), (_, tensor) in zip(signature, named)])
        comm.check_consistent(self._group.comm, "DistributedDataParallel: the arguments", [
            ("bucket_cap_mb", float(bucket_cap_mb)),
            ("find_unused_parameters", bool(find_unused_parameters)),
            ("broadcast_buffers", bool(broadcast_buffers)),
            ("gradient_as_bucket_view", bool(gradient_as_bucket_view)),
            ("static_graph", bool(static_graph))])
        self._buffers_to_sync = [b for _, b in named_buffers]
        with torch.no_grad():
            comm.broadcast_coalesced([p.detach() for _, p in named_params] + self._buffers_to_sync,
                                     self._group.comm, root=0)
        trained = [(name, p) for name, p in named_params if p.requires_grad]
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.require_backward_grad_sync = True
        self.static_graph = False
        self.reducer = Reducer([p for _, p in trained], [name for name, _ in trained],
                               self._group.comm, int(bucket_cap_mb * 2**20),
                               find_unused_parameters, gradient_as_bucket_view)
        if static_graph:
            self._set_static_graph()

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
        """Run the module; prepares the gradient reduction of the next backward pass."""
        training = torch.is_grad_enabled()
        sync = training and self.require_backward_grad_sync
        if sync and self.broadcast_buffers and self._buffers_to_sync:
            with torch.no_grad():
                comm.broadcast_coalesced(self._buffers_to_sync, self._group.comm, root=0)
        output = self.module(*inputs, **kwargs)
        if training:
            self.reducer.prepare(sync, output)
        return output

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

    def register_comm_hook(self, state: Any, hook: Callable[[Any, GradBucket], Any]) -> None:
        """Reduce each bucket with ``hook(state, bucket)`` instead of the built-in averaging.
        Call once, before the first backward pass, on every rank."""
        self.reducer.register_comm_hook(state, hook)

    @property
    def buckets(self) -> List[GradBucket]:
        """The gradient buckets, in reduction order."""
        return self.reducer.buckets
