"""Timing collective code: every rank starts together, the slowest rank's time counts."""
from __future__ import annotations

import statistics
import time
from typing import Callable, Optional

from mpi4py import MPI


def median_seconds(fn: Callable[[], object], repeat: int = 7, warmup: int = 2,
                   comm: Optional[MPI.Intracomm] = None) -> float:
    """Median over ``repeat`` runs of ``fn`` after ``warmup`` untimed runs. Collective: each run
    starts after a barrier and is the maximum over the ranks of ``comm`` (default world)."""
    comm = comm or MPI.COMM_WORLD
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        comm.Barrier()
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        times.append(comm.allreduce(elapsed, op=MPI.MAX))
    return statistics.median(times)
