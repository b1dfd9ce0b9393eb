"""Starting separate MPI jobs (and Slurm jobs) from a test: a clean environment, a bounded run.

Such tests start jobs of their own size, so they run only in the 1-rank pass of the suite.
"""
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pytest
from mpi4py import MPI

from simulated_nodes import SimulatedNodes

SUPPORT = Path(__file__).resolve().parent
"""This folder: the helpers and the job scripts that tests launch."""
REPO = SUPPORT.parents[1]
MPIEXEC = shlex.split(os.environ.get("TENSORPLAY_MPIEXEC", "mpiexec"))
"""The launch of the running lane (``scripts/env.sh`` sets ``TENSORPLAY_MPIEXEC``)."""
ONLY_UNDER_ONE_RANK = "launches its own jobs: runs only when the tests run on one rank"


def single_rank() -> bool:
    """Whether this test process is the only rank (nested launches run only then)."""
    return MPI.COMM_WORLD.Get_size() == 1


only_in_single_rank_run = pytest.mark.skipif(not single_rank(), reason=ONLY_UNDER_ONE_RANK)


def clean_env(base: Optional[Dict[str, str]] = None, **extra: str) -> Dict[str, str]:
    """``base`` (default: this process's environment) without the variables of the MPI or Slurm
    job running the tests, so that a nested ``mpiexec`` or ``srun`` starts a job of its own, and
    without the torch.distributed address that the tests' gloo group left here."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if not k.startswith(("OMPI_", "PMIX_", "OPAL_", "ORTE_", "HYDRA_", "PMI_", "SLURM_"))
           and k not in ("MASTER_ADDR", "MASTER_PORT")}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONUNBUFFERED="1", **extra)
    return env


def mpiexec_prefix(nodes: Optional[SimulatedNodes] = None) -> List[str]:
    """``mpiexec`` with this suite's options, on one node, or placing ranks on the simulated
    ``nodes`` (entered through their launcher, in the repository root: give the jobs absolute
    paths in a folder every node sees, such as ``tmp_path``)."""
    if nodes is None:
        return list(MPIEXEC)
    return [*nodes.enter(wd=str(REPO)), *MPIEXEC, *nodes.mpiexec_flags()]


def mpiexec_command(ranks: int, args: List[str], nodes: Optional[SimulatedNodes] = None,
                    flags: Sequence[str] = ()) -> List[str]:
    """``mpiexec [FLAGS] -n RANKS python ARGS`` (see :func:`mpiexec_prefix`)."""
    return [*mpiexec_prefix(nodes), *flags, "-n", str(ranks), sys.executable, *args]


def mpiexec(ranks: int, args: List[str], timeout: float = 300, env: Optional[dict] = None,
            nodes: Optional[SimulatedNodes] = None, flags: Sequence[str] = (),
            **options) -> subprocess.CompletedProcess:
    """Run ``python ARGS`` on ``ranks`` ranks (across ``nodes`` when given); the output is
    captured, the run bounded. ``options`` go to ``subprocess.run``."""
    command = mpiexec_command(ranks, args, nodes, flags)
    return subprocess.run(command, env=clean_env(env), cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, **options)
