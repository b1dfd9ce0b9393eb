"""Agreeing on failure: a rank that fails raises, and so does every other rank of the group,
instead of waiting in the next collective for a rank that left.

:func:`fail_together` is the one way the library does it: a block runs on each rank, then the
ranks agree on its outcome."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Sequence, Tuple, Type, Union

import numpy as np

from .consistency import Item, check_consistent
from .mpi import MPI
from .small_collectives import all_gather_object, all_reduce_array, quiet_barrier

__all__ = ["agree", "fail_together", "quiet_barrier"]

Catch = Union[Type[BaseException], Tuple[Type[BaseException], ...]]


def agree(comm: MPI.Intracomm, error: Optional[BaseException], what: str,
          exc_type: Type[Exception] = RuntimeError, quiet: bool = False) -> None:
    """Raise ``exc_type`` on every rank if ``error`` is set on any. Collective: one allreduce
    of a flag; only after a failure, an allgather of the messages. The message names each
    failing rank and its error. ``quiet``: first wait for every rank with
    :func:`quiet_barrier`."""
    if quiet:
        quiet_barrier(comm)
    failures = all_reduce_array(np.array([error is not None], dtype=np.int32), comm)
    if not failures[0]:
        return
    message = None if error is None else f"{type(error).__name__}: {error}"
    failed = [(rank, m) for rank, m in enumerate(all_gather_object(message, comm))
              if m is not None]
    detail = "; ".join(f"rank {rank}: {m}" for rank, m in failed)
    raised = exc_type(f"{what} failed on {len(failed)} of {comm.Get_size()} ranks: {detail}")
    if error is not None:
        raise raised from error
    raise raised


@contextmanager
def fail_together(comm: MPI.Intracomm, what: str, exc_type: Type[Exception] = RuntimeError, *,
                  catch: Catch = Exception, quiet: bool = False,
                  items: Optional[Sequence[Item]] = None,
                  valid_items: Optional[Callable[[], Sequence[Item]]] = None,
                  own_errors: bool = False) -> Iterator[None]:
    """Run the ``with`` block on this rank, then have every rank of ``comm`` end it alike.
    Collective at the end of the block; an exception that is not a ``catch`` passes through
    at once, on this rank only (use :func:`~.abort.abort_on_exception` for those).

    Plainly (no ``items`` nor ``valid_items``): where the block raised on any rank, every rank
    raises ``exc_type`` naming each failing rank and its error (:func:`agree`; ``quiet``
    waits in :func:`quiet_barrier` first).

    Comparing (``items``, then the outcome, then, where the block succeeded, ``valid_items()``):
    one allgather of a digest (:func:`~.consistency.check_consistent`). A difference, in the
    items or in the outcome (an error on some ranks only, or different errors), is a
    ``ValueError`` on every rank naming the ranks and the first item that differs; an error
    alike on every rank is raised again as it was, so callers keep PyTorch's error types.
    ``own_errors`` (comparing): where the block raised on every rank, each raises its own, even
    where they differ (for arguments meant to differ by rank, such as ``device_ids=[rank]``;
    one allreduce of a flag more).
    """
    error: Optional[BaseException] = None
    try:
        yield
    except catch as failure:
        error = failure
    if items is None and valid_items is None:
        agree(comm, error, what, exc_type, quiet)
        return
    if own_errors:
        failed = all_reduce_array(np.array([error is not None], dtype=np.int32), comm, MPI.MIN)
        if failed[0]:
            raise error
    outcome = "ok" if error is None else f"{type(error).__name__}: {error}"
    after = valid_items() if error is None and valid_items is not None else ()
    check_consistent(comm, what, [*(items or ()), ("outcome", outcome), *after])
    if error is not None:
        raise error
