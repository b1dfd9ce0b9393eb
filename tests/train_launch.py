"""Helpers of the tests that launch ``tensorplay-hpc train`` and the job scripts as programs."""
from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Dict, List

from mpi4py import MPI

REPO = Path(__file__).resolve().parents[1]

TINY = ["--layers", "1", "--width", "32", "--heads", "2", "--context", "16", "--batch-size", "8",
        "--eval-every", "0", "--eval-batches", "1", "--no-progress", "--threads", "1"]
"""A model and batch small enough that a step takes milliseconds."""

MPIEXEC = ["mpiexec", "--oversubscribe", "--mca", "mpi_yield_when_idle", "1"]

ONLY_UNDER_ONE_RANK = (
    "launches its own MPI job: runs only when the tests themselves run on one rank")


def single_rank() -> bool:
    """Whether this test process is the only rank (nested launches run only then)."""
    return MPI.COMM_WORLD.Get_size() == 1


def clean_env(**extra: str) -> Dict[str, str]:
    """This environment without the variables of the MPI job running the tests, so that a nested
    ``mpiexec`` or ``srun`` starts a job of its own."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PMI_", "SLURM_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONUNBUFFERED="1", **extra)
    return env


def train_command(ranks: int, *options: str) -> List[str]:
    """``mpiexec -n RANKS python -m tensorplay_hpc train TINY OPTIONS``."""
    return [*MPIEXEC, "-n", str(ranks), "python", "-m", "tensorplay_hpc", "train", *TINY, *options]


def losses(run_dir: Path) -> List[str]:
    """The loss column of a run's metrics.csv, as written (exact text)."""
    with open(run_dir / "metrics.csv", newline="") as f:
        return [row["loss"] for row in csv.DictReader(f)]


def restarts(run_dir: Path) -> List[int]:
    """The steps of metrics.csv marked as the first after a restart."""
    with open(run_dir / "metrics.csv", newline="") as f:
        return [int(row["step"]) for row in csv.DictReader(f) if row["restart"] == "1"]
