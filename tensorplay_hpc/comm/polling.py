"""Waiting by testing between sleeps instead of inside MPI: the waiting thread then leaves its
core, the interpreter lock and MPI's progress to busier threads (a background exchange, a
service thread, a barrier beside a computing thread)."""
from __future__ import annotations

import time
from typing import Callable, Optional

__all__ = ["LONGEST_PAUSE_S", "poll_until"]

LONGEST_PAUSE_S = 1e-3
"""The longest sleep between two tests, by default."""


def poll_until(test: Callable[[], bool], longest_pause: float = LONGEST_PAUSE_S,
               give_up: Optional[Callable[[], bool]] = None) -> bool:
    """Call ``test`` (a nonblocking MPI test, which also lets MPI progress) until it returns
    true, sleeping between calls from 10 us, doubling up to ``longest_pause`` seconds. Returns
    ``False`` instead once ``give_up`` returns true. Local."""
    pause = 1e-5
    while not test():
        if give_up is not None and give_up():
            return False
        time.sleep(pause)
        pause = min(2 * pause, longest_pause)
    return True
