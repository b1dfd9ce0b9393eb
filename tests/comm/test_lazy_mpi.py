"""MPI starts at first communication, not at import: importing the package's public modules and
running ``tensorplay-hpc --version`` or ``--help`` leave ``mpi4py.MPI`` unimported (so
``MPI_Init`` is not called, as on a login node or in a package manager's import check)."""
import subprocess
import sys

import pytest

import tensorplay_hpc
from launch import REPO, clean_env, only_in_single_rank_run

PUBLIC_MODULES = (
    "tensorplay_hpc", "tensorplay_hpc.distributed.optim", "tensorplay_hpc.distributed.parallel",
    "tensorplay_hpc.distributed.algorithms.model_averaging.averagers",
    "tensorplay_hpc.distributed.rma", "tensorplay_hpc.distributed.autograd",
    "tensorplay_hpc.checkpoint", "tensorplay_hpc.comm", "tensorplay_hpc.distributed.backend",
)

# Run in a fresh interpreter: the test process itself has MPI started.
IMPORTS = """
import importlib, os, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
    assert "mpi4py.MPI" not in sys.modules, name
assert "MPICH_MAX_THREAD_SAFETY" not in os.environ
import torch.distributed as dist
assert dist.is_backend_available("mpi4py")   # registered by importing tensorplay_hpc.distributed
print("not started")
"""

MAIN = """
import runpy, sys
sys.argv[0] = "tensorplay-hpc"
try:
    runpy.run_module("tensorplay_hpc", run_name="__main__")
finally:
    assert "mpi4py.MPI" not in sys.modules
"""

FIRST_USE = """
import os, sys
from tensorplay_hpc.comm.mpi import MPI, is_loaded
assert not is_loaded()
size = MPI.COMM_WORLD.Get_size()
print(sys.modules["mpi4py.MPI"].Is_initialized(), os.environ["MPICH_MAX_THREAD_SAFETY"])
"""


def _python(code, *args, **env):
    environment = clean_env(**env)
    environment.pop("MPICH_MAX_THREAD_SAFETY", None)
    environment.update(env)
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=environment,
                          capture_output=True, text=True, timeout=120)


@only_in_single_rank_run
def test_importing_the_public_modules_does_not_start_mpi():
    result = _python(IMPORTS, *PUBLIC_MODULES)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "not started"


@only_in_single_rank_run
@pytest.mark.parametrize("option,printed", [("--version", f"tensorplay-hpc {tensorplay_hpc.__version__}"),
                                            ("--help", "usage: tensorplay-hpc")])
def test_version_and_help_do_not_start_mpi(option, printed):
    result = _python(MAIN, option)
    assert result.returncode == 0, result.stderr
    assert printed in result.stdout


@only_in_single_rank_run
def test_mpi_starts_at_first_use_with_the_thread_safety_mpich_needs():
    result = _python(FIRST_USE)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "multiple"]
    result = _python(FIRST_USE, MPICH_MAX_THREAD_SAFETY="funneled")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "funneled"]   # the user's choice stands
