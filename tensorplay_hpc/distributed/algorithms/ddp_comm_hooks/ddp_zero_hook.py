"""The DDP communication hooks that overlap a ZeroRedundancyOptimizer's step with the backward
pass, as PyTorch's ``ddp_zero_hook`` (see :mod:`tensorplay_hpc.distributed.optim.ddp_overlap`).

Both build ``zero``'s partition from ``ddp``'s buckets, so make the hook once, on every rank,
before the first backward pass, and register it with ``ddp.register_comm_hook``. As in PyTorch,
the first two backward passes (three with ``static_graph``) only average the gradients; the
optimizer steps from the next one on, and ``zero.step()`` is not called. Unlike PyTorch, the
hooks run over MPI on any communicator (PyTorch refuses the gloo backend) and wrap any
``torch.optim`` class.

Example::

    zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam,
                                   overlap_with_ddp=True, lr=1e-3)
    ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
    for batch in data:
        zero.zero_grad()
        ddp(batch).sum().backward()   # the optimizer steps in here after the warm-up
"""
from __future__ import annotations

from typing import Any, Callable

__all__ = ["hook_with_zero2_step", "hook_with_zero_step", "hook_with_zero_step_interleaved"]

Hook = Callable[[Any, Any], Any]


def hook_with_zero_step(hook: Hook, ddp: Any, zero: Any, shard_buckets: bool = False) -> Hook:
    """Wrap the reduction ``hook`` so that ``zero`` (a ``ZeroRedundancyOptimizer`` built with
    ``overlap_with_ddp=True``) steps in ``ddp``'s backward pass: when the last bucket's hook
    runs, each rank waits for every bucket's reduction in turn, steps the parameters it owns
    and sends them to every rank; they are in place everywhere when ``backward()`` returns.
    Suits communication that is slow next to computation.

    Args:
        hook: the reduction, such as ``allreduce_hook``; its result's ``wait()`` gives the
            averaged flat gradients.
        ddp: the ``DistributedDataParallel`` model whose buckets ``zero`` follows.
        zero: the optimizer of ``ddp.parameters()``.
        shard_buckets: split buckets between ranks so that each owns about the same number of
            elements; ``False`` gives whole buckets, bucket ``b`` to rank ``b % world_size``.

    Raises:
        ValueError: ``zero`` was built without ``overlap_with_ddp=True``.
        RuntimeError: ``zero`` is already overlapped with a model.
    """
    return zero.overlap_with(ddp, shard_buckets).hook_stepping_after_last(hook)


def hook_with_zero_step_interleaved(hook: Hook, ddp: Any, zero: Any,
                                    shard_buckets: bool = False) -> Hook:
    """Like :func:`hook_with_zero_step`, but each bucket is stepped and sent as soon as its
    reduction has completed, while the backward pass goes on. Suits communication that is fast
    next to computation. Same arguments and errors."""
    return zero.overlap_with(ddp, shard_buckets).interleaved_hook(hook)


def hook_with_zero2_step(ddp: Any, zero: Any, shard_buckets: bool = True) -> Hook:
    """ZeRO-2 (not in PyTorch): the gradients are sharded as well as the optimizer state. Each
    bucket's gradients are reduced only to the ranks owning its parameters (a blocking reduce
    per owner's part, run on DDP's communication thread while the backward pass goes on; in
    the hook itself, holding up the backward pass, where MPI is below
    ``MPI_THREAD_MULTIPLE``); each owner steps its part as soon as it has arrived and sends the
    parameters to every rank (nonblocking broadcasts). No reduction hook is wrapped: the hook
    is the reduction.

    After ``backward()`` returns the parameters are updated everywhere and their ``.grad`` is
    ``None`` (the step consumed the gradients), and DDP has freed its bucket buffers, so no
    rank keeps full-size gradients between steps. The bytes moved equal an allreduce's (a
    reduce and a broadcast per part). The warm-up passes only average, as with
    :func:`hook_with_zero_step`, and leave averaged gradients in ``.grad``.

    Args:
        ddp: the ``DistributedDataParallel`` model whose buckets ``zero`` follows.
        zero: a ``ZeroRedundancyOptimizer`` of ``ddp.parameters()`` built with
            ``overlap_with_ddp=True``.
        shard_buckets: split buckets between ranks so that each owns about the same number of
            elements (the default here: every rank then holds about ``1 / world_size`` of the
            gradients at any time); ``False`` gives whole buckets, bucket ``b`` to rank
            ``b % world_size``.

    Raises:
        ValueError: ``zero`` was built without ``overlap_with_ddp=True``.
        RuntimeError: ``zero`` is already overlapped with a model.

    Example::

        zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW,
                                       overlap_with_ddp=True, lr=1e-3)
        ddp.register_comm_hook(None, hook_with_zero2_step(ddp, zero))
    """
    return zero.overlap_with(ddp, shard_buckets).owners_hook()
