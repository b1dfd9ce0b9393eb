"""Distributed optimizers: ZeroRedundancyOptimizer, PostLocalSGDOptimizer, DistributedOptimizer,
DiLoCoOptimizer."""
import importlib

_EXPORTS = {
    "ZeroRedundancyOptimizer": "zero_redundancy_optimizer",
    "PostLocalSGDOptimizer": "post_localSGD_optimizer",
    "DistributedOptimizer": "distributed_optimizer",
    "DiLoCoOptimizer": "diloco_optimizer",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    # Imported on first use, so each optimizer loads only what it needs.
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
