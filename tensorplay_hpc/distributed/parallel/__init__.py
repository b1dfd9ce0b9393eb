"""Data parallelism over MPI."""
import importlib

__all__ = ["DistributedDataParallel"]


def __getattr__(name: str):
    if name == "DistributedDataParallel":
        return importlib.import_module(f"{__name__}.distributed").DistributedDataParallel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
