"""Python's cycle collector, paused while a save or load runs. Saving or loading a model of many
small tensors makes and drops hundreds of thousands of small objects, each allocation counting
towards the collector's next pass over every live object; with 50,000 parameters those passes
took a quarter of a save and a load. Objects freed by reference counting are freed as usual;
cycles made meanwhile wait for the next pass after the save or load."""
from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator

__all__ = ["paused"]


@contextmanager
def paused() -> Iterator[None]:
    """Run the block with the cycle collector off (as it was, afterwards). Not collective."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
