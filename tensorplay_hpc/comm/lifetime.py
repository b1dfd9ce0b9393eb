"""The one rule for the library's MPI objects (private communicators and windows).

- Their owner frees them in ``close()``, which is collective: every rank of the group calls it,
  in the same order relative to its other collectives. Closing twice does nothing; using the
  owner after ``close()`` raises ``RuntimeError`` naming it and the rank.
- ``with owner:`` closes on a normal exit. Leaving with an error, the other ranks may never reach
  the collective free, so it is skipped rather than risk a hang.
- The garbage collector never frees one: ranks collect objects at different moments and a free
  can wait for the other ranks, so a free at collection time can deadlock against a collective
  running elsewhere. An object collected unclosed gives a ``ResourceWarning`` (shown with
  ``python -W default`` or ``-X dev``, as for unclosed files) and is freed by ``MPI_Finalize``
  at interpreter exit; its communicator's worker thread ends at once.

:func:`live` lists the objects not freed yet and :func:`open_objects` those whose owner has not
been collected, which is how the tests check that ``close()`` leaves nothing behind.
"""
from __future__ import annotations

import itertools
from typing import Dict, List

__all__ = ["Closeable", "leave_to_finalize", "live", "open_objects", "track", "untrack"]

_live: Dict[int, str] = {}
_tokens = itertools.count()
FINALIZE_NOTE = " (collected without close(): left to MPI_Finalize)"


def track(description: str) -> int:
    """Record a new library MPI object; returns the token that :func:`untrack` takes. Local."""
    token = next(_tokens)
    _live[token] = description
    return token


def untrack(token: int) -> None:
    """Record that the object of ``token`` was freed. Local."""
    _live.pop(token, None)


def leave_to_finalize(token: int) -> str:
    """Record that the object of ``token`` was collected unclosed and stays allocated until
    ``MPI_Finalize``; returns its description. Local."""
    description = _live.get(token, "")
    if description and not description.endswith(FINALIZE_NOTE):
        _live[token] = description + FINALIZE_NOTE
    return description


def live() -> List[str]:
    """Descriptions of the library's communicators and windows on this rank that are not freed
    yet, oldest first, those collected unclosed included. Local."""
    return list(_live.values())


def open_objects() -> List[str]:
    """:func:`live` without the objects collected unclosed (left to ``MPI_Finalize``): what
    owners alive now hold. Local."""
    return [entry for entry in _live.values() if not entry.endswith(FINALIZE_NOTE)]


class Closeable:
    """An owner of library MPI objects: ``close()`` frees them (collective), and ``with obj:``
    calls it on a normal exit only (see the module's rule)."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
