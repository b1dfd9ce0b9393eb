"""A fault on one rank of a training loop ends the whole job promptly (2 ranks, watchdog at 5 s):
an uncaught exception in a ZeroRedundancyOptimizer or a DistributedDataParallel loop, a
communication hook that raises, a collective checkpoint saved on rank 0 only. The job script
installs nothing itself (no ``abort_on_exception``)."""
import os
import re
import time

import pytest

from launch import mpiexec, only_in_single_rank_run

JOB = os.path.join(os.path.dirname(__file__), "training_fault_job.py")


@only_in_single_rank_run
@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["zero", "ddp", "hook"])
def test_failure_on_one_rank_ends_the_job(mode):
    run = mpiexec(2, [JOB, mode], timeout=60,
                  env=dict(os.environ, TENSORPLAY_HPC_COLLECTIVE_TIMEOUT="5"))
    ended = time.time()
    failed = re.search(r"failing at ([0-9.]+)", run.stdout)
    assert failed, run.stdout + run.stderr
    assert run.returncode != 0
    assert ended - float(failed.group(1)) < 15, run.stderr
    assert "[rank 1] uncaught exception, aborting the job" in run.stderr
    assert f"RuntimeError: deliberate failure in the {mode} loop" in run.stderr
    assert "not reached" not in run.stdout


@only_in_single_rank_run
@pytest.mark.timeout(90)
def test_checkpoint_saved_on_rank_0_only_is_aborted_naming_the_missing_rank(tmp_path):
    """PyTorch's ``if rank == 0: torch.save(...)`` then a barrier, moved to the collective
    ``checkpoint.save``: the watchdog reports the save waiting for rank 1, and nothing is
    written."""
    run = mpiexec(2, [JOB, "save", str(tmp_path)], timeout=60,
                  env=dict(os.environ, TENSORPLAY_HPC_COLLECTIVE_TIMEOUT="5"))
    ended = time.time()
    failed = re.search(r"failing at ([0-9.]+)", run.stdout)
    assert failed, run.stdout + run.stderr
    assert run.returncode != 0
    assert ended - float(failed.group(1)) < 15, run.stderr
    assert re.search(r"\[rank 0\] collective timeout: .* has waited \d+ s \(limit 5 s\); ranks "
                     r"not arrived: \[1\]\. Aborting the job", run.stderr), run.stderr
    assert re.search(r"\[rank 0\]   \w+ .* for checkpoint\.save \[MainThread\]: running for",
                     run.stderr)
    assert list(tmp_path.iterdir()) == []
