"""Checking the ``optimizer_class`` argument that the distributed optimizers wrap."""
from __future__ import annotations

from typing import Any, Type

from torch.optim import Optimizer

__all__ = ["check_optimizer_class"]


def check_optimizer_class(optimizer_class: Any, owner: str) -> Type[Optimizer]:
    """Return ``optimizer_class`` if it is a ``torch.optim.Optimizer`` subclass; otherwise raise
    ``TypeError`` naming what was given (a name, a function, an instance...). Local: every rank
    checks its own argument, and fails the same way when all ranks pass the same thing."""
    if isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer):
        return optimizer_class
    if isinstance(optimizer_class, Optimizer):
        given = f"an instance of {type(optimizer_class).__name__}; pass the class itself"
    elif isinstance(optimizer_class, str):
        given = (f"the string {optimizer_class!r}; pass the class, e.g. torch.optim.SGD, "
                 f"not its name")
    elif isinstance(optimizer_class, type):
        given = f"the class {optimizer_class.__qualname__}, which is not an Optimizer subclass"
    else:
        given = f"{optimizer_class!r} of type {type(optimizer_class).__name__}"
    raise TypeError(f"{owner}: optimizer_class must be a torch.optim.Optimizer subclass, "
                    f"got {given}")
