"""Timing collective code: every rank starts together, the slowest rank's time counts."""
from __future__ import annotations

import math
import statistics
import time
from typing import Callable, List, Optional, Sequence

from tensorplay_hpc.comm.mpi import MPI

__all__ = ["MIN_SAMPLE_S", "compare", "interleaved", "median_seconds", "spread"]

MIN_SAMPLE_S = 0.02   # calls shorter than this are timed in batches, so barrier skew washes out


def _timed(fn: Callable[[], object], calls: int, comm: MPI.Intracomm) -> float:
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = (time.perf_counter() - start) / calls
    return comm.allreduce(elapsed, op=MPI.MAX)


def median_seconds(fn: Callable[[], object], repeat: int = 7, warmup: int = 2,
                   comm: Optional[MPI.Intracomm] = None) -> float:
    """Median seconds per call of ``fn`` over ``repeat`` samples, after ``warmup`` calls.

    Collective over ``comm`` (default world): each sample starts after a barrier and counts the
    slowest rank. Calls under 20 ms are repeated within a sample and averaged.
    """
    return compare([fn], repeat, warmup, comm)[0]


def compare(fns: Sequence[Callable[[], object]], repeat: int = 7, warmup: int = 2,
            comm: Optional[MPI.Intracomm] = None) -> List[float]:
    """:func:`median_seconds` of several functions, their samples interleaved so that a noisy
    machine slows all of them alike (see :func:`interleaved`). Collective."""
    return [statistics.median(times) for times in interleaved(fns, repeat, warmup, comm)]


def interleaved(fns: Sequence[Callable[[], object]], repeat: int = 7, warmup: int = 2,
                comm: Optional[MPI.Intracomm] = None) -> List[List[float]]:
    """``repeat`` samples of seconds per call of each function, after ``warmup`` calls: one
    round after another, each round timing every function once, starting with the next one in
    turn and, every other round, in reverse order, so that none always runs right after the
    same other one (a gloo call, say, whose threads linger): rotation alone keeps each
    function's predecessor. Collective over ``comm`` (default world); each sample is the slowest
    rank's."""
    comm = comm or MPI.COMM_WORLD
    batches = []
    for fn in fns:
        for _ in range(warmup):
            fn()
        calls = max(1, math.ceil(MIN_SAMPLE_S / max(_timed(fn, 1, comm), 1e-7)))
        batches.append(comm.allreduce(min(calls, 1000), op=MPI.MAX))
    samples: List[List[float]] = [[] for _ in fns]
    for round_ in range(repeat):
        order = [(round_ + i) % len(fns) for i in range(len(fns))]
        for k in reversed(order) if round_ % 2 else order:
            samples[k].append(_timed(fns[k], batches[k], comm))
    return samples


def spread(samples: Sequence[float]) -> float:
    """The samples' range relative to their median: ``(max - min) / median``."""
    return round((max(samples) - min(samples)) / statistics.median(samples), 3)
