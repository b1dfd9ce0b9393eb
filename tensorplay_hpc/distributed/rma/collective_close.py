"""The context-manager rule of objects whose ``close()`` frees MPI windows collectively."""
from __future__ import annotations


class ClosesCollectively:
    """``with obj:`` calls ``obj.close()`` (collective) on a normal exit. Leaving with an error,
    other ranks may never reach the collective free, so it is skipped rather than risk a hang;
    the windows then stay allocated until MPI is finalized."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
