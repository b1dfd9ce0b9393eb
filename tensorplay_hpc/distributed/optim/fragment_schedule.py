"""Streaming DiLoCo's fragments: which parameters each fragment holds and after which inner
steps it syncs."""
from __future__ import annotations

import itertools
from typing import List, Sequence, Tuple

__all__ = ["FragmentSchedule", "balanced_cuts"]


def balanced_cuts(numels: Sequence[int], parts: int) -> List[Tuple[int, int]]:
    """Cut the indices of ``numels`` into ``parts`` contiguous, non-empty ranges ``(start, end)``
    whose element counts are close to equal: each cut is the boundary nearest to ``f / parts`` of
    the elements (the earlier boundary on a tie). Local and deterministic.

    Raises:
        ValueError: ``parts`` is not between 1 and ``len(numels)``.
    """
    count = len(numels)
    if not 1 <= parts <= count:
        raise ValueError(f"cannot cut {count} parameters into {parts} non-empty fragments")
    ends = list(itertools.accumulate(numels))   # elements up to and including each index
    total = ends[-1] if ends else 0
    cuts, start = [], 0
    for f in range(1, parts):
        target = total * f / parts
        # the first f fragments end after index end - 1; leave one index per later fragment
        end = min(range(start + 1, count - (parts - f) + 1),
                  key=lambda e: (abs(ends[e - 1] - target), e))
        cuts.append((start, end))
        start = end
    cuts.append((start, count))
    return cuts


class FragmentSchedule:
    """Parameters (in registration order) cut into ``fragments`` contiguous groups balanced by
    element count; fragment ``f`` starts a sync after the inner steps ``s >= 1`` (counted from 1)
    with ``(s - offset(f)) % sync_every == 0``, ``offset(f) = f * sync_every // fragments``, and
    applies it ``overlap_steps`` inner steps later. Local.

    Raises:
        ValueError: ``sync_every < 1``, ``fragments`` not between 1 and the number of
            parameters, or ``overlap_steps`` negative or, when positive, not below
            ``sync_every // fragments``.
    """

    def __init__(self, numels: Sequence[int], fragments: int, sync_every: int,
                 overlap_steps: int) -> None:
        if sync_every < 1:
            raise ValueError(f"sync_every must be at least 1, got {sync_every}")
        if fragments < 1 or fragments > len(numels):
            raise ValueError(f"fragments must be between 1 and the number of parameters "
                             f"({len(numels)}), got {fragments}")
        if overlap_steps < 0 or (overlap_steps and overlap_steps >= sync_every // fragments):
            raise ValueError(
                f"overlap_steps must be at least 0 and below sync_every // fragments = "
                f"{sync_every // fragments} (a fragment's sync must land before the next "
                f"fragment's starts), got {overlap_steps}")
        self.sync_every = sync_every
        self.fragments = fragments
        self.overlap_steps = overlap_steps
        self.bounds: List[Tuple[int, int]] = balanced_cuts(numels, fragments)

    def offset(self, fragment: int) -> int:
        """The inner step, modulo ``sync_every``, after which ``fragment`` starts its syncs."""
        return fragment * self.sync_every // self.fragments

    def starting(self, step: int) -> List[int]:
        """The fragments whose sync starts after inner step ``step``, in ascending order."""
        return [f for f in range(self.fragments)
                if step >= 1 and (step - self.offset(f)) % self.sync_every == 0]

    def settings(self) -> dict:
        """What a state dict must match to continue this schedule."""
        return {"sync_every": self.sync_every, "fragments": self.fragments,
                "overlap_steps": self.overlap_steps}
