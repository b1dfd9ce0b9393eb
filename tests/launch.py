"""Starting separate MPI jobs from a test: a clean environment and a bounded run."""
import os
import subprocess
import sys
from typing import List

import pytest
from mpi4py import MPI

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

only_in_single_rank_run = pytest.mark.skipif(
    MPI.COMM_WORLD.Get_size() > 1, reason="starts its own MPI jobs: run once, in the 1-rank pass")


def clean_environment() -> dict:
    """This process's environment without the variables that tie it to the running MPI job."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("OMPI_", "PMIX_", "OPAL_", "ORTE_", "HYDRA_", "PMI_"))}


def mpiexec(ranks: int, args: List[str], timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """Run ``python ARGS`` on ``ranks`` ranks; the output is captured, the run bounded."""
    command = ["mpiexec", "--oversubscribe", "--mca", "mpi_yield_when_idle", "1",
               "-n", str(ranks), sys.executable, *args]
    env = clean_environment()
    env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    return subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, **kwargs)
