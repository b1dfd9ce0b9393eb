"""Starting separate MPI jobs from a test: a clean environment and a bounded run."""
import os
import subprocess
import sys
from typing import List, Optional

import pytest
from mpi4py import MPI

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

only_in_single_rank_run = pytest.mark.skipif(
    MPI.COMM_WORLD.Get_size() > 1, reason="starts its own MPI jobs: run once, in the 1-rank pass")


def clean_environment(env: Optional[dict] = None) -> dict:
    """``env`` (default: this process's) without the variables that tie a process to the MPI
    job it runs in, so that a new mpiexec starts a job of its own."""
    return {k: v for k, v in (os.environ if env is None else env).items()
            if not k.startswith(("OMPI_", "PMIX_", "OPAL_", "ORTE_", "HYDRA_", "PMI_"))}


def mpiexec(ranks: int, args: List[str], timeout: float = 300, env: Optional[dict] = None,
            **options) -> subprocess.CompletedProcess:
    """Run ``python ARGS`` on ``ranks`` ranks; the output is captured, the run bounded.
    ``options`` go to ``subprocess.run``."""
    command = ["mpiexec", "--oversubscribe", "--mca", "mpi_yield_when_idle", "1",
               "-n", str(ranks), sys.executable, *args]
    env = clean_environment(env)
    env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    return subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, **options)
