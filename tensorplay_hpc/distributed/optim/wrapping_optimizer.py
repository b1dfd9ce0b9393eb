"""An optimizer that wraps another: the base of PostLocalSGDOptimizer and DiLoCoOptimizer."""
from __future__ import annotations

from typing import Any, Dict, List

import torch

__all__ = ["WrappingOptimizer"]


class WrappingOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose parameters, state and defaults are those of the
    optimizer it wraps, ``self.optim`` (set by the subclass; nothing is copied), so that
    schedulers and ``zero_grad`` act on the wrapped one."""

    optim: torch.optim.Optimizer

    @property
    def param_groups(self) -> List[Dict[str, Any]]:  # type: ignore[override]
        return self.optim.param_groups

    @property
    def state(self):  # type: ignore[override]
        return self.optim.state

    @property
    def defaults(self) -> Dict[str, Any]:  # type: ignore[override]
        return self.optim.defaults
