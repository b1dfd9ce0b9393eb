"""Distributed autograd over remote references: gradients go to the parameters' owners.

Inside ``with context() as context_id``, :meth:`RemoteRef.to_here` of a tensor that requires
grad returns a local leaf that requires grad and is recorded in the context (a frozen tensor's
copy does not require grad, as with PyTorch's RPC). :func:`backward` runs autograd locally and sends
each recorded reference's gradient into this rank's gradient slot on the owner with
``MPI.Accumulate`` (``MPI.SUM``, so several backward passes in one context add up; the first one
of a context replaces the slot's stale contents, so slots never need clearing).

Each rank has one gradient slot per owner, so a rank has at most one open context at a time (in
PyTorch it is one per thread).

A context belongs to the rank that opened it: its id is ``(world rank << 48) | counter``, unique
without any agreement between ranks, and it is known (and usable) only on that rank. A context's
gradients stay on the owners until the next context of the same rank overwrites them.
"""
from __future__ import annotations

import itertools
from contextlib import contextmanager
from typing import TYPE_CHECKING, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch

from tensorplay_hpc.comm.mpi import MPI
from tensorplay_hpc.distributed.rma.reference import register_fetch_hook

if TYPE_CHECKING:
    from tensorplay_hpc.distributed.rma import RemoteRef

__all__ = ["DistAutogradContext", "backward", "context", "get_gradients", "retrieve_context"]

_RANK_SHIFT = 48


class DistAutogradContext:
    """The remote references fetched in one context and which of them have gradients."""

    def __init__(self, context_id: int) -> None:
        self.context_id = context_id
        self.leaves: List[Tuple["RemoteRef", torch.Tensor]] = []
        self.with_gradient: Set["RemoteRef"] = set()

    def has_gradient(self, ref: "RemoteRef") -> bool:
        """Whether a backward pass of this context sent a gradient for ``ref``."""
        return ref in self.with_gradient


_contexts: Dict[int, DistAutogradContext] = {}
_counter = itertools.count(1)
_open: Optional[DistAutogradContext] = None


@contextmanager
def context() -> Iterator[int]:
    """Open a distributed autograd context on this rank and yield its id. Not collective."""
    global _open
    if _open is not None:
        raise RuntimeError(f"distributed autograd context {_open.context_id} is already "
                           f"open on world rank {MPI.COMM_WORLD.Get_rank()}; contexts do not nest")
    context_id = (MPI.COMM_WORLD.Get_rank() << _RANK_SHIFT) | next(_counter)
    ctx = _contexts[context_id] = DistAutogradContext(context_id)
    _open = ctx
    try:
        yield context_id
    finally:
        _open = None
        del _contexts[context_id]


def retrieve_context(context_id: int) -> DistAutogradContext:
    """The open context ``context_id`` of this rank.

    Raises:
        ValueError: no such context is open here.
    """
    try:
        return _contexts[context_id]
    except KeyError:
        raise ValueError(f"unknown distributed autograd context id {context_id} on world rank "
                         f"{MPI.COMM_WORLD.Get_rank()} (closed, or opened on rank "
                         f"{context_id >> _RANK_SHIFT})") from None


def record(ref: "RemoteRef", value: torch.Tensor) -> torch.Tensor:
    """Make ``value`` (just fetched from ``ref``) a leaf of the open context, if any and if
    ``ref`` requires grad. Registered as the remote references' fetch hook, so every
    ``to_here()`` passes through it."""
    if _open is not None and ref.requires_grad:
        value.requires_grad_(True)
        _open.leaves.append((ref, value))
    return value


register_fetch_hook(record)


def _check_roots(roots: List[torch.Tensor]) -> None:
    """Refuse roots that autograd cannot start from, as PyTorch's distributed autograd does."""
    for position, root in enumerate(roots):
        if not root.requires_grad:
            problem = "requires_grad not set on root"
        elif root.numel() != 1:
            problem = (f"root of shape {tuple(root.shape)} is not a scalar, all roots need to "
                       "be scalar")
        elif root.grad_fn is None:
            problem = "root does not have a valid gradient function (it is a leaf)"
        else:
            continue
        raise RuntimeError(f"distributed autograd backward: {problem} (root {position} of "
                           f"{len(roots)}, world rank {MPI.COMM_WORLD.Get_rank()})")


def backward(context_id: int, roots: Sequence[torch.Tensor], retain_graph: bool = False) -> None:
    """Backpropagate from scalar ``roots`` and accumulate the gradients of the references
    fetched in the context into their owners' memory. Not collective: owners take no part.

    Local tensors' ``.grad`` are left untouched, as in PyTorch's distributed autograd.

    Raises:
        ValueError: ``context_id`` is not an open context of this rank.
        RuntimeError: a root does not require grad, is not a scalar or is a leaf (PyTorch's
            checks and wording).
    """
    ctx = retrieve_context(context_id)
    roots = list(roots)
    _check_roots(roots)
    if not ctx.leaves:
        return
    grads = torch.autograd.grad(roots, [leaf for _, leaf in ctx.leaves], retain_graph=retain_graph,
                                allow_unused=True)
    summed: Dict["RemoteRef", torch.Tensor] = {}
    for (ref, _), grad in zip(ctx.leaves, grads):
        if grad is not None:
            summed[ref] = summed[ref] + grad if ref in summed else grad
    by_shared: Dict[object, Dict["RemoteRef", torch.Tensor]] = {}
    for ref, grad in summed.items():
        by_shared.setdefault(ref.shared, {})[ref] = grad
    for shared, gradients in by_shared.items():
        fresh = [ref for ref in gradients if ref not in ctx.with_gradient]
        shared.accumulate_gradients(gradients, fresh)
        ctx.with_gradient.update(gradients)


def get_gradients(context_id: int) -> Dict["RemoteRef", torch.Tensor]:
    """The context's accumulated gradients, fetched from the owners, by reference."""
    ctx = retrieve_context(context_id)
    by_shared: Dict[object, List["RemoteRef"]] = {}
    for ref in ctx.with_gradient:
        by_shared.setdefault(ref.shared, []).append(ref)
    out: Dict["RemoteRef", torch.Tensor] = {}
    for shared, refs in by_shared.items():
        out.update(shared.fetch_gradients(refs))
    return out
