"""A thread that lets MPI make progress on a rank that is busy computing.

With Open MPI on one node, windows live in shared memory (``osc/sm``) and other ranks'
passive-target operations complete without the owner calling MPI; RDMA networks (``osc/ucx``,
``osc/rdma`` over InfiniBand) behave the same. Elsewhere the owner must enter MPI now and then:
Open MPI's ``osc/pt2pt`` over TCP emulates one-sided operations with messages, and the MPICH
lineage (MPICH, Intel MPI, Cray MPICH, MVAPICH) grants locks and applies accumulates in the
target's progress engine, in shared memory too
(:func:`tensorplay_hpc.comm.library.target_progress_needed`). There the owner runs this
thread, which enters MPI every ``interval`` seconds, or, where MPI lacks
``MPI_THREAD_MULTIPLE``, calls :func:`poll` now and then from its own loop.
"""
from __future__ import annotations

import threading
from typing import Optional

from tensorplay_hpc.comm.mpi import MPI

from .thread_failure import end_job

__all__ = ["ProgressThread", "poll"]


def poll(communicator: Optional[MPI.Comm] = None) -> None:
    """Enter MPI once, so that it serves pending one-sided operations on the windows of
    ``communicator`` (default ``MPI.COMM_WORLD``: MPICH makes progress per communicator, and
    the windows of every group share world's). Local."""
    (communicator or MPI.COMM_WORLD).Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)


class ProgressThread:
    """Calls :func:`poll` on ``communicator`` (the windows' own) every ``interval`` seconds
    until :meth:`stop`. Local.

    Raises:
        RuntimeError: MPI was not initialized with ``MPI_THREAD_MULTIPLE``.
    """

    def __init__(self, interval: float = 1e-3,
                 communicator: Optional[MPI.Comm] = None) -> None:
        level = MPI.Query_thread()
        if level < MPI.THREAD_MULTIPLE:
            raise RuntimeError(
                f"a progress thread needs MPI_THREAD_MULTIPLE, but MPI runs at thread level "
                f"{level} on world rank {MPI.COMM_WORLD.Get_rank()} (set "
                "mpi4py.rc.thread_level = 'multiple' before importing MPI)")
        self.interval = interval
        self._communicator = communicator
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mpi-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stopped.wait(self.interval):
                poll(self._communicator)
        except BaseException:  # the one-sided operations waiting on this rank never complete
            end_job("the one-sided progress thread")

    def stop(self) -> None:
        """End the thread and wait for it."""
        self._stopped.set()
        self._thread.join()
