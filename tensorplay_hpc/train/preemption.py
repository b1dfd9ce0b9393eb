"""Preemption: a signal (SIGTERM, or SIGUSR1 that Slurm's ``--signal`` sends before the time
limit) asks the job to stop; the ranks agree on it, checkpoint and exit with
:data:`EXIT_PREEMPTED`, which a batch script turns into a requeue."""
from __future__ import annotations

import signal
from types import FrameType
from typing import TYPE_CHECKING, Dict, Optional

if TYPE_CHECKING:
    from tensorplay_hpc.comm.mpi import MPI

__all__ = ["EXIT_PREEMPTED", "Preemption", "SIGNALS"]

EXIT_PREEMPTED = 85
"""Exit status of a run that stopped on a signal after writing its checkpoint: resume it."""

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    """Catches :data:`SIGNALS` and lets the ranks agree, once per step, whether to stop.

    Use as a context manager (the previous handlers come back on exit), or :meth:`install` it
    for the rest of the process.
    """

    def __init__(self) -> None:
        self.signal: Optional[int] = None
        self._previous: Dict[int, object] = {}

    def _handle(self, number: int, frame: Optional[FrameType]) -> None:
        self.signal = number

    def install(self) -> "Preemption":
        """Catch :data:`SIGNALS` from now on."""
        for number in SIGNALS:
            self._previous[number] = signal.signal(number, self._handle)
        return self

    def restore(self) -> None:
        """Give the signals back to their previous handlers."""
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

    def __enter__(self) -> "Preemption":
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def agree(self, loss: float, communicator: "MPI.Intracomm") -> tuple[float, bool]:
        """Average a step's loss over the ranks and agree whether any rank was signalled, in one
        tiny allreduce. Collective: every rank calls it once per step, so all stop at the same
        step. Returns ``(mean loss, stop)``."""
        import torch  # here, not above: the handlers go in before the slow imports

        from tensorplay_hpc import comm

        values = torch.tensor([loss, float(self.signal is not None)], dtype=torch.float64)
        comm.all_reduce(values, communicator, comm.ReduceOp.SUM)
        return values[0].item() / communicator.Get_size(), values[1].item() > 0

    @property
    def name(self) -> str:
        """The signal received here, e.g. ``"SIGUSR1"`` (``"a signal on another rank"`` if none)."""
        return signal.Signals(self.signal).name if self.signal else "a signal on another rank"
