"""Training on uneven inputs: ranks that ran out of data shadow the collectives of the others.

The same API as ``torch.distributed.algorithms.join`` (:class:`Join`, :class:`Joinable`,
:class:`JoinHook`), over MPI. Each iteration, every rank still training calls
:meth:`Join.notify_join_context` (through its first joinable) before its own collectives, which
adds 1 to an all-reduce of "ranks still training". A rank that has left its loop runs the same
all-reduce with 0 inside :meth:`Join.__exit__`; while the sum is positive it runs every joinable's
:meth:`JoinHook.main_hook` (which mirrors one iteration's collectives), and once it is 0 every
rank runs the :meth:`JoinHook.post_hook` s and leaves.

The context manager talks on a private duplicate of the joinables' process group (an mpi4py
intracommunicator), made when it is created and freed when it exits; joinables keep using their
own communicators for their hooks. Unlike PyTorch, joinables are switched back off on exit, so
calling them after the ``with`` block does not reach a freed communicator.
"""
from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from types import TracebackType
from typing import Any, List, NamedTuple, Optional, Type

import torch

from tensorplay_hpc import comm
from tensorplay_hpc.comm.mpi import MPI

__all__ = ["Join", "JoinHook", "Joinable"]

_SKEW_WARNING = 1000


class JoinHook:
    """What a joinable does for a rank that has run out of inputs.

    ``main_hook`` runs once per iteration that some other rank still trains; ``post_hook`` runs
    once when all ranks have joined. Override either.
    """

    def main_hook(self) -> None:
        """Shadow the collectives of one training iteration (forward, backward, step)."""

    def post_hook(self, is_last_joiner: bool) -> None:
        """Run after every rank joined; ``is_last_joiner`` is true on the ranks that joined last."""


class _JoinConfig(NamedTuple):
    enable: bool
    throw_on_early_termination: bool
    is_first_joinable: bool
    join: Optional["Join"]


_DISABLED = _JoinConfig(enable=False, throw_on_early_termination=False, is_first_joinable=False,
                        join=None)


class Joinable(ABC):
    """A class whose per-iteration collectives can be shadowed by ranks that have joined.

    Subclasses call ``Joinable.__init__`` in their constructor, call
    :meth:`Join.notify_join_context` before their per-iteration collectives, and provide
    :meth:`join_hook`, :attr:`join_device` and :attr:`join_process_group`.
    """

    @abstractmethod
    def __init__(self) -> None:
        super().__init__()
        self._join_config = _DISABLED

    @abstractmethod
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook that shadows this object's collectives; ``kwargs`` come from :class:`Join`."""

    @property
    @abstractmethod
    def join_device(self) -> torch.device:
        """The device of the tensors the join all-reduces use."""

    @property
    @abstractmethod
    def join_process_group(self) -> Optional[MPI.Intracomm]:
        """The process group (mpi4py intracommunicator; ``None`` is ``MPI.COMM_WORLD``)."""


def _same_group(a: MPI.Comm, b: MPI.Comm) -> bool:
    return MPI.Comm.Compare(a, b) in (MPI.IDENT, MPI.CONGRUENT)


class Join:
    """Context manager that lets ranks with fewer inputs keep the others' collectives matched.

    Creating it is collective over the joinables' process group.

    Args:
        joinables: the participating :class:`Joinable` s; their hooks run in this order, and the
            first one does the join all-reduces for all of them.
        enable: ``False`` turns the context manager into a no-op (inputs known to be even).
        throw_on_early_termination: raise ``RuntimeError`` on every rank as soon as one rank runs
            out of inputs, instead of shadowing.
        **kwargs: passed to every joinable's :meth:`Joinable.join_hook`.

    Raises:
        ValueError: no joinables, or joinables on different process groups.
        TypeError: an entry that is not a :class:`Joinable`.
    """

    def __init__(self, joinables: List[Joinable], enable: bool = True,
                 throw_on_early_termination: bool = False, **kwargs: Any) -> None:
        if len(joinables) == 0:
            raise ValueError("The join context manager requires at least one joinable")
        self._joinables = list(joinables)
        for position, joinable in enumerate(self._joinables):
            if not isinstance(joinable, Joinable):
                raise TypeError(f"Join: joinables[{position}] is a {type(joinable).__name__}, "
                                "which is not a Joinable (a subclass of tensorplay_hpc."
                                "distributed.algorithms.join.Joinable with join_hook, "
                                "join_device and join_process_group)")
        self._join_hooks = [joinable.join_hook(**kwargs) for joinable in self._joinables]
        self._enable = enable
        self._throw_on_early_termination = throw_on_early_termination
        parent = comm.resolve(self._joinables[0].join_process_group)
        for joinable in self._joinables[1:]:
            if not _same_group(parent, comm.resolve(joinable.join_process_group)):
                raise ValueError("Using join context manager with multiple process groups")
        self._device = self._joinables[0].join_device
        self._group = comm.ProcessGroup(parent, owner="Join")
        self._rank = self._group.rank
        self._pending: List[comm.Work] = []
        for position, joinable in enumerate(self._joinables):
            joinable._join_config = _JoinConfig(
                enable=enable, throw_on_early_termination=throw_on_early_termination,
                is_first_joinable=position == 0, join=self)

    def __enter__(self) -> "Join":
        return self

    def __exit__(self, type: Optional[Type[BaseException]], value: Optional[BaseException],
                 traceback: Optional[TracebackType]) -> None:
        """Shadow the other ranks' iterations until every rank has joined, then run the post
        hooks. Collective.

        Raises:
            RuntimeError: if ``throw_on_early_termination`` and this rank ran out of inputs first.
        """
        for joinable in self._joinables:
            joinable._join_config = _DISABLED
        if type is not None:
            return  # the exception propagates as it is
        if self._enable:
            self._shadow_until_all_joined()
        self._group.close()

    def _shadow_until_all_joined(self) -> None:
        self._wait_pending()
        is_last_joiner = True
        iterations = 0
        while self._all_reduce(0.0) > 0:
            if self._throw_on_early_termination:
                self._all_reduce(1.0)
                raise RuntimeError(f"Rank {self._rank} exhausted all inputs.")
            if iterations == _SKEW_WARNING:
                warnings.warn(
                    f"Detected uneven input skew of more than {_SKEW_WARNING}: rank {self._rank} "
                    f"has at least {_SKEW_WARNING} fewer inputs than other currently active "
                    "ranks, which can slow training down.", stacklevel=2)
            for hook in self._join_hooks:
                hook.main_hook()
            is_last_joiner = False
            iterations += 1
        for hook in self._join_hooks:
            hook.post_hook(is_last_joiner)

    def _all_reduce(self, value: float) -> float:
        tensor = torch.full((1,), value, device=self._device)
        comm.all_reduce(tensor, self._group.comm, async_op=True).wait()
        return tensor.item()

    def _wait_pending(self) -> None:
        for work in self._pending:
            work.wait()
        self._pending.clear()

    def _notify(self) -> comm.Work:
        self._wait_pending()
        ones = torch.ones(1, device=self._device)
        work = comm.all_reduce(ones, self._group.comm, async_op=True)
        self._pending.append(work)
        if self._throw_on_early_termination and self._all_reduce(0.0) > 0:
            self._wait_pending()
            raise RuntimeError("Detected at least one rank that exhausted inputs. "
                               "Throwing across all ranks.")
        return work

    @staticmethod
    def notify_join_context(joinable: Joinable) -> Optional[comm.Work]:
        """Tell the join context that this rank has not joined yet. Collective in effect.

        Call it from a joinable before its per-iteration collectives. Only the first joinable
        of the context communicates; for the others, and outside a context, this does nothing.

        Returns:
            The handle of the nonblocking all-reduce (for the first joinable), else ``None``.
            Waiting on it is optional: the context completes it.

        Raises:
            RuntimeError: if ``throw_on_early_termination`` and some rank has run out of inputs.
        """
        config = getattr(joinable, "_join_config", None)
        if config is None:
            raise RuntimeError(f"{type(joinable).__name__} must call Joinable.__init__ in its "
                               "constructor")
        if not config.enable or not config.is_first_joinable:
            return None
        return config.join._notify()
