"""Every environment variable the package reads, with its default and meaning: the one table
that ``tensorplay-hpc env`` prints and docs/environment.md shows."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

from tensorplay_hpc.comm.capabilities import TRANSPORT_ENV
from tensorplay_hpc.comm.chunking import CHUNK_ENV, MPI_COUNT_LIMIT, PIECE_BYTES, PIECE_ENV
from tensorplay_hpc.comm.consistency import DEBUG_ENV
from tensorplay_hpc.comm.cuda import CUDA_AWARE_ENV
from tensorplay_hpc.comm.trace import TRACE_ENV
from tensorplay_hpc.comm.watchdog import TIMEOUT_ENV
from tensorplay_hpc.comm.worker import NONBLOCKING_ENV
from tensorplay_hpc.distributed.optim.distributed_optimizer import DIRECT_ENV
from tensorplay_hpc.checkpoint.locking import LOCKING_ENV
from tensorplay_hpc.checkpoint.striping import (ALIGN_ENV, DEFAULT_BOUNDARY, STRIPE_COUNT_ENV,
                                               STRIPE_SIZE_ENV)
from tensorplay_hpc.checkpoint.writer import DEFAULT_WRITE, WRITE_ENV

__all__ = ["SETTINGS", "Setting", "current", "unknown"]


@dataclass(frozen=True)
class Setting:
    """An environment variable: its name, what it is when unset, and what it does."""

    name: str
    default: str
    meaning: str


SETTINGS: Tuple[Setting, ...] = (
    Setting(TIMEOUT_ENV, "off",
            "seconds a collective may wait before the job is aborted with a report of the "
            "ranks not arrived; unset or 0: no watchdog"),
    Setting(TRACE_ENV, "off",
            "a folder: every collective and one-sided operation is traced there as Chrome "
            "trace JSON, one file per rank (and trace.json for all ranks from the training job "
            "or trace.write())"),
    Setting(DEBUG_ENV, "0",
            "1: every collective first checks that all ranks entered it with the same sizes, "
            "dtype and root (slow)"),
    Setting(CUDA_AWARE_ENV, "detected",
            "1 or 0: whether GPU memory goes straight to MPI, instead of the detection"),
    Setting(TRANSPORT_ENV, "auto",
            "auto, shared, mpi or served: the transport of remote tensors (rma.share, "
            "DistributedOptimizer)"),
    Setting(DIRECT_ENV, "1",
            "0: DistributedOptimizer fetches and puts back even where windows are in shared "
            "memory"),
    Setting(NONBLOCKING_ENV, "thread",
            "thread or requests: how collectives started nonblocking run (blocking, in order, "
            "on a thread per communicator; or as MPI's nonblocking calls, as below "
            "MPI_THREAD_MULTIPLE)"),
    Setting(CHUNK_ENV, str(MPI_COUNT_LIMIT),
            "the most elements handed to one MPI call; longer messages are split"),
    Setting(PIECE_ENV, str(PIECE_BYTES),
            "bytes per piece of a large blocking allreduce"),
    Setting(ALIGN_ENV, f"stripe size, else {DEFAULT_BOUNDARY}",
            "bytes: checkpoint datasets of at least this size start on a multiple of it "
            "(default: the stripe size asked for, else the file system's, else 4 MiB)"),
    Setting(STRIPE_COUNT_ENV, "file system's",
            "stripes of a new checkpoint file (lfs setstripe -c, ROMIO striping_factor)"),
    Setting(STRIPE_SIZE_ENV, "file system's",
            "bytes per stripe of a new checkpoint file (lfs setstripe -S, ROMIO striping_unit)"),
    Setting(WRITE_ENV, DEFAULT_WRITE,
            "independent or collective: how blocking checkpoint saves write (Write_at by each "
            "rank, or Write_at_all with ROMIO's collective buffering)"),
    Setting(LOCKING_ENV, "auto",
            "on, off or auto: HDF5 file locking of checkpoint files (auto: "
            "HDF5_USE_FILE_LOCKING if set, else on where the file system takes flock)"),
    Setting("TENSORPLAY_HPC_ROOT", "submit folder",
            "jobs/*.sbatch: the repository, when the job is submitted from elsewhere"),
)


def current() -> List[Tuple[Setting, Optional[str]]]:
    """Each setting with its value in this process's environment (``None`` when unset)."""
    return [(setting, os.environ.get(setting.name)) for setting in SETTINGS]


def unknown() -> List[str]:
    """``TENSORPLAY_HPC_*`` variables that are set but are no setting (a typo, most likely)."""
    known = {setting.name for setting in SETTINGS}
    return sorted(name for name in os.environ
                  if name.startswith("TENSORPLAY_HPC_") and name not in known)
