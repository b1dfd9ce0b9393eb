"""The lock of a served window's memory, in one process: the order it grants in, and waits that
end with an error once the lock can never be given back (its holder was lost)."""
import threading
import time

import pytest

from tensorplay_hpc.distributed.rma.locks import LockManager


def test_waiting_requests_are_granted_in_order_when_the_holder_releases():
    locks, granted = LockManager(), []
    locks.request("a", True, lambda: granted.append("a"))
    locks.request("b", False, lambda: granted.append("b"))
    locks.request("c", False, lambda: granted.append("c"))
    assert granted == ["a"]
    locks.release("a")
    assert granted == ["a", "b", "c"]   # both shared requests fit together
    with pytest.raises(RuntimeError, match="'a' released a window lock it does not hold"):
        locks.release("a")


def test_break_all_ends_the_waits_for_a_lock_that_is_never_released():
    """A lost rank holds the lock: a thread waiting in ``acquire`` raises the error given to
    ``break_all``, and so does every later ``acquire``."""
    locks = LockManager()
    locks.request("lost rank", True, lambda: None)
    outcome = []

    def wait():
        try:
            locks.acquire("owner", exclusive=False)
            outcome.append("granted")
        except RuntimeError as error:
            outcome.append(str(error))

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.2)
    assert outcome == [] and waiter.is_alive()
    locks.break_all(RuntimeError("the holder was lost"))
    waiter.join(timeout=5)
    assert outcome == ["the holder was lost"]
    with pytest.raises(RuntimeError, match="the holder was lost"):
        locks.acquire("owner", exclusive=True)
