"""A thread that lets MPI make progress on a rank that is busy computing.

With Open MPI on one node, windows from ``Win.Allocate`` live in shared memory (``osc/sm``) and
other ranks' passive-target operations complete without the owner calling MPI; RDMA networks
(``osc/ucx``, ``osc/rdma`` over InfiniBand) behave the same. Transports that emulate one-sided
operations with messages (Open MPI's ``osc/pt2pt`` over TCP, MPICH's default ``ch3`` without
``MPICH_ASYNC_PROGRESS=1``) only serve them while the owner is inside MPI; there the owner needs
this thread, which enters MPI every ``interval`` seconds or, where MPI lacks
``MPI_THREAD_MULTIPLE`` (Open MPI 4.1's ``osc/pt2pt`` refuses it), to call :func:`poll` now
and then from its own loop.
"""
from __future__ import annotations

import threading

from tensorplay_hpc.comm.mpi import MPI


def poll() -> None:
    """Enter MPI once, so that it serves pending one-sided operations. Local."""
    MPI.COMM_SELF.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)


class ProgressThread:
    """Calls ``MPI.COMM_SELF.Iprobe`` every ``interval`` seconds until :meth:`stop`. Local.

    Raises:
        RuntimeError: MPI was not initialized with ``MPI_THREAD_MULTIPLE``.
    """

    def __init__(self, interval: float = 1e-3) -> None:
        level = MPI.Query_thread()
        if level < MPI.THREAD_MULTIPLE:
            raise RuntimeError(
                f"a progress thread needs MPI_THREAD_MULTIPLE, but MPI runs at thread level "
                f"{level} on world rank {MPI.COMM_WORLD.Get_rank()} (set "
                "mpi4py.rc.thread_level = 'multiple' before importing MPI)")
        self.interval = interval
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mpi-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self.interval):
            poll()

    def stop(self) -> None:
        """End the thread and wait for it."""
        self._stopped.set()
        self._thread.join()
