"""Model averagers: objects that decide at which steps parameters are averaged, and over which
group. Each averager talks on its own private duplicate of the process group."""
from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from typing import Optional

from tensorplay_hpc.comm.mpi import MPI

from tensorplay_hpc import comm

from .utils import Params, average_on_communicator

__all__ = ["ModelAverager", "PeriodicModelAverager"]

PERIOD_ONE_WARNING = (
    "With a period of 1 there is no need for model averaging: all-reducing the parameters at "
    "every step costs at least as much as all-reducing the gradients in "
    "DistributedDataParallel's backward pass, so use DistributedDataParallel alone.")


class ModelAverager(comm.Closeable, ABC):
    """Base class of the averagers. Collective: construct it on every rank of ``process_group``.

    ``with averager:`` closes it at the end of the block (see :meth:`close`).

    Args:
        process_group: the group that averages (``None`` is ``MPI.COMM_WORLD``). A rank where it
            is ``MPI.COMM_NULL`` counts steps but never averages.

    Attributes:
        step: the number of :meth:`average_parameters` calls so far (saved in checkpoints by
            :class:`~tensorplay_hpc.distributed.optim.PostLocalSGDOptimizer`).
    """

    def __init__(self, process_group: Optional[MPI.Comm] = None) -> None:
        self.process_group = comm.resolve(process_group)
        self._group: Optional[comm.ProcessGroup] = (
            comm.ProcessGroup(self.process_group, owner=type(self).__name__)
            if comm.is_member(self.process_group) else None)
        self._closed = False
        self.step = 0
        self._buffers: dict = {}   # flat buffers reused from one averaging to the next

    @property
    def _communicator(self) -> MPI.Comm:
        """The private duplicate, or ``MPI.COMM_NULL`` on a rank outside the group."""
        return self._group.comm if self._group is not None else MPI.COMM_NULL

    def _check_consistent(self, **settings: object) -> None:
        """Check that every rank of the group built this averager alike. Collective."""
        if self._group is not None:
            comm.check_consistent(self._group.comm, type(self).__name__,
                                  sorted((k, repr(v)) for k, v in settings.items()))

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed: close() freed its "
                               f"communicators (world rank {MPI.COMM_WORLD.Get_rank()})")

    @abstractmethod
    def average_parameters(self, params: Params) -> None:
        """Average ``params`` if this step calls for it, then advance :attr:`step`.

        Raises:
            RuntimeError: the averager is closed.
            ValueError: on every rank of the averaging group, if the ranks do not have
                gradients on the same parameters.
        """

    def close(self) -> None:
        """Free the private communicators; later averaging raises ``RuntimeError``.
        Collective over the process group; closing again does nothing."""
        if self._group is not None:
            self._group.close()
        self._closed = True


class PeriodicModelAverager(ModelAverager):
    """Averages parameters every ``period`` steps once ``warmup_steps`` steps have passed: at
    the steps ``s`` with ``s >= warmup_steps`` and ``(s - warmup_steps) % period == 0``.

    Used for post-local SGD, usually after a DistributedDataParallel warm-up (see
    :mod:`~tensorplay_hpc.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook`).
    Collective: construct it and call :meth:`average_parameters` on every rank of the group.

    Args:
        period: steps between averagings (at least 1; 1 warns, as DDP alone is cheaper).
        warmup_steps: steps before the first averaging.
        process_group: the group that averages (``None`` is ``MPI.COMM_WORLD``).

    Raises:
        ValueError: ``period < 1`` or ``warmup_steps < 0``.
    """

    def __init__(self, period: int, warmup_steps: int = 0,
                 process_group: Optional[MPI.Comm] = None) -> None:
        if warmup_steps < 0:
            raise ValueError(f"Arg ``warmup_steps`` must be a non-negative number, got "
                             f"{warmup_steps} (world rank {MPI.COMM_WORLD.Get_rank()}).")
        if period < 1:
            raise ValueError(f"Arg ``period`` must be a positive value, got {period} "
                             f"(world rank {MPI.COMM_WORLD.Get_rank()}).")
        if period == 1:
            warnings.warn(PERIOD_ONE_WARNING, stacklevel=2)
        super().__init__(process_group)
        self.period = period
        self.warmup_steps = warmup_steps
        self._check_consistent(period=period, warmup_steps=warmup_steps)

    def average_parameters(self, params: Params) -> None:
        """Average the parameters (or optimizer param groups) that have gradients, if this step
        is an averaging step; advance the step counter either way. Collective."""
        self._check_open()
        if self.step >= self.warmup_steps and (self.step - self.warmup_steps) % self.period == 0:
            average_on_communicator(params, self._communicator, self._buffers)
        self.step += 1
