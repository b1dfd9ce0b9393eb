"""The lock of one rank's served window memory: exclusive or shared, granted in request order.

Requests come from the rank's service thread (for other ranks) and from its own application
thread; a request that cannot be granted waits in a queue, and its grant callback runs once it
is granted, never before. Waiting requests are granted first come, first served (a shared
request behind a waiting exclusive one waits too, so writers are not starved).
"""
from __future__ import annotations

import threading
from collections import Counter, deque
from typing import Callable, Deque, Hashable, List, Optional, Set, Tuple

__all__ = ["Grant", "LockManager"]

Grant = Callable[[], None]


class LockManager:
    """Exclusive/shared lock with grant callbacks. Thread-safe; callbacks run outside its
    mutex, in the thread that made the grant possible."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._exclusive: Optional[Hashable] = None
        self._shared: Counter = Counter()
        self._waiting: Deque[Tuple[Hashable, bool, Grant]] = deque()
        self._sleepers: Set[threading.Event] = set()   # threads in acquire()
        self._broken: Optional[BaseException] = None

    def _grantable(self, exclusive: bool) -> bool:
        if self._exclusive is not None:
            return False
        return not exclusive or not self._shared

    def _take(self, holder: Hashable, exclusive: bool) -> None:
        if exclusive:
            self._exclusive = holder
        else:
            self._shared[holder] += 1

    def request(self, holder: Hashable, exclusive: bool, grant: Grant) -> None:
        """Ask for the lock for ``holder``; ``grant()`` runs when it is held (at once if free)."""
        with self._mutex:
            now = not self._waiting and self._grantable(exclusive)
            if now:
                self._take(holder, exclusive)
            else:
                self._waiting.append((holder, exclusive, grant))
        if now:
            grant()

    def release(self, holder: Hashable) -> None:
        """Give back ``holder``'s lock, and grant the waiting requests that fit now."""
        granted: List[Grant] = []
        with self._mutex:
            if self._exclusive == holder:
                self._exclusive = None
            elif self._shared[holder] > 0:
                self._shared[holder] -= 1
                if not self._shared[holder]:
                    del self._shared[holder]
            else:
                raise RuntimeError(f"{holder!r} released a window lock it does not hold")
            while self._waiting and self._grantable(self._waiting[0][1]):
                waiter, exclusive, grant = self._waiting.popleft()
                self._take(waiter, exclusive)
                granted.append(grant)
        for grant in granted:
            grant()

    def acquire(self, holder: Hashable, exclusive: bool) -> None:
        """Block the calling thread until ``holder`` holds the lock.

        Raises:
            BaseException: the error given to :meth:`break_all`, if it was called.
        """
        event = threading.Event()
        self._sleepers.add(event)
        try:
            if self._broken is None:
                self.request(holder, exclusive, event.set)
                event.wait()
        finally:
            self._sleepers.discard(event)
        if self._broken is not None:
            raise self._broken

    def break_all(self, error: BaseException) -> None:
        """Make every :meth:`acquire`, waiting or to come, raise ``error`` instead: the lock
        will never be given back (its holder was lost)."""
        self._broken = error
        for event in list(self._sleepers):
            event.set()
