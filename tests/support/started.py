"""A test fixture object that is started and stopped, and used as a context manager."""
from __future__ import annotations

from typing import TypeVar

Self = TypeVar("Self", bound="Started")


class Started:
    """``with X(...) as x`` calls ``x.start()`` (stopping again if that fails part-way) and
    ``x.stop()`` on leaving. Subclasses define both."""

    def start(self: Self) -> Self:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self: Self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
