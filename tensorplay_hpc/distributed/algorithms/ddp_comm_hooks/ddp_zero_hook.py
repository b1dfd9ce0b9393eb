"""The DDP communication hook that overlaps a ZeroRedundancyOptimizer's step with the backward
pass, as PyTorch's ``ddp_zero_hook.hook_with_zero_step``."""
from __future__ import annotations

from typing import Any, Callable

__all__ = ["hook_with_zero_step"]


def hook_with_zero_step(hook: Callable[[Any, Any], Any], ddp: Any,
                        zero: Any) -> Callable[[Any, Any], Any]:
    """Wrap the reduction ``hook`` so that each rank steps its shard of ``zero`` (a
    ``ZeroRedundancyOptimizer`` built with ``overlap_with_ddp=True``) as soon as the gradient
    buckets it owns are reduced, and the updated parameters reach every rank before
    ``backward()`` returns. Builds ``zero``'s partition from ``ddp``'s buckets, so call it once,
    on every rank, before the first backward pass; there are no warm-up iterations.

    Example::

        zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam,
                                       overlap_with_ddp=True, lr=1e-3)
        ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
        for batch in data:
            ddp(batch).sum().backward()   # the optimizer steps in here; no zero.step()
            zero.zero_grad()
    """
    return zero._overlap_with(ddp).hook(hook)
