"""Post-local SGD: a local optimizer step, then model averaging by an averager."""
from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, Optional

import torch

from tensorplay_hpc.distributed.algorithms.model_averaging.averagers import ModelAverager

from .wrapping_optimizer import WrappingOptimizer

__all__ = ["PostLocalSGDOptimizer"]

NO_STEP_WARNING = ("Loaded state dict does not contain a step counter for an averager. "
                   "Setting step counter to 0.")


class PostLocalSGDOptimizer(WrappingOptimizer):
    """Wraps a local ``torch.optim.Optimizer`` and runs post-local SGD: every :meth:`step` is a
    local step followed by ``averager.average_parameters`` on the optimizer's param groups (the
    averager decides whether this step averages).

    Collective: :meth:`step` must be called on every rank of the averager's group.

    Args:
        optim: the local optimizer.
        averager: a model averager, e.g.
            ``averagers.PeriodicModelAverager`` or ``HierarchicalModelAverager``.

    Example::

        local = torch.optim.SGD(model.parameters(), lr=0.01)
        averager = averagers.PeriodicModelAverager(period=4, warmup_steps=100)
        opt = PostLocalSGDOptimizer(local, averager)
        for batch in data:
            opt.zero_grad()
            loss_fn(model(batch)).backward()
            opt.step()
    """

    def __init__(self, optim: torch.optim.Optimizer, averager: ModelAverager) -> None:
        # The wrapped optimizer owns the parameters and state; nothing is copied here.
        self.optim = optim
        self.averager = averager

    def __repr__(self) -> str:
        return repr(self.optim)

    def state_dict(self) -> Dict[str, Any]:
        """The local optimizer's state dict plus ``"step"``, the averager's step counter, so that
        a reloaded run does not redo the warm-up."""
        state_dict = self.optim.state_dict()
        state_dict["step"] = self.averager.step
        return state_dict

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load the local optimizer's state and restore the averager's step counter (0 with a
        warning when ``state_dict`` has no ``"step"``). The caller's dict is left unchanged."""
        self.optim.load_state_dict({k: v for k, v in state_dict.items() if k != "step"})
        if "step" in state_dict:
            self.averager.step = int(state_dict["step"])
        else:
            warnings.warn(NO_STEP_WARNING, stacklevel=2)
            self.averager.step = 0

    def step(  # type: ignore[override]
            self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """A local optimizer step, then the averager's averaging step. Collective."""
        loss = self.optim.step(closure) if closure is not None else self.optim.step()
        self.averager.average_parameters(self.param_groups)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)
