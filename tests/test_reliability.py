"""No hangs: mismatches across ranks are errors on every rank, a stalled collective is reported
and aborted by the watchdog, an exception on one rank ends the job."""
import os
import time

import pytest
import torch

from launch import mpiexec, only_in_single_rank_run
from tensorplay_hpc import comm
from tensorplay_hpc.comm.consistency import DEBUG_ENV, check_consistent, tensor_signature

JOB = os.path.join(os.path.dirname(__file__), "fault_job.py")


@pytest.fixture
def group():
    pg = comm.ProcessGroup()
    yield pg
    pg.close()


def test_consistent_ranks_pass(group):
    items = tensor_signature(["w", "b"], [torch.zeros(3, 4), torch.zeros(4)])
    check_consistent(group.comm, "model", items)
    assert items == [("w", ((3, 4), "float32", "cpu")), ("b", ((4,), "float32", "cpu"))]


@pytest.mark.mpi(min_size=2)
def test_mismatch_is_the_same_error_on_every_rank(group):
    shape = (3, 5) if group.rank == 1 else (3, 4)
    items = tensor_signature(["w", "b"], [torch.zeros(shape), torch.zeros(4)])
    with pytest.raises(ValueError) as raised:
        check_consistent(group.comm, "model", items)
    message = str(raised.value)
    assert message.startswith("model: ranks [1] differ from rank 0")
    assert "rank 0 has ('w', ((3, 4), 'float32', 'cpu')), rank 1 has ('w', ((3, 5)" in message
    assert group.comm.allgather(message) == [message] * group.size


@pytest.mark.mpi(min_size=2)
def test_debug_mode_catches_mismatched_collective(group, monkeypatch):
    monkeypatch.setenv(DEBUG_ENV, "1")
    t = torch.ones(5 if group.rank == group.size - 1 else 4)
    with pytest.raises(ValueError, match=f"collective all_reduce: ranks \\[{group.size - 1}\\]"):
        comm.all_reduce(t, group.comm)


@only_in_single_rank_run
@pytest.mark.timeout(120)
def test_watchdog_reports_missing_rank_and_aborts():
    env = dict(os.environ, TENSORPLAY_HPC_COLLECTIVE_TIMEOUT="3")
    start = time.monotonic()
    run = mpiexec(3, [JOB, "stall"], timeout=90, env=env)
    elapsed = time.monotonic() - start
    assert run.returncode != 0
    assert elapsed < 60
    assert "collective timeout: all_reduce (collective #2)" in run.stderr
    assert "ranks not arrived: [2]" in run.stderr
    assert "not reached" not in run.stdout


@only_in_single_rank_run
@pytest.mark.timeout(120)
def test_exception_on_one_rank_aborts_the_job():
    start = time.monotonic()
    run = mpiexec(2, [JOB, "raise"], timeout=90)
    assert run.returncode != 0
    assert time.monotonic() - start < 30
    assert "[rank 1] uncaught exception, aborting the job" in run.stderr
    assert "deliberate failure on the last rank" in run.stderr


@pytest.mark.mpi(min_size=2)
def test_optimizers_and_averagers_built_differently_fail_on_every_rank(world):
    from tensorplay_hpc.distributed.algorithms.model_averaging import averagers
    from tensorplay_hpc.distributed.algorithms.model_averaging.hierarchical_model_averager import (
        HierarchicalModelAverager)
    from tensorplay_hpc.distributed.optim import ZeroRedundancyOptimizer
    odd = world.Get_rank() == 1
    with pytest.raises(ValueError, match=r"ZeroRedundancyOptimizer: ranks \[1\].*parameter 0"):
        ZeroRedundancyOptimizer([torch.nn.Parameter(torch.zeros(3 if odd else 2))],
                                torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"ZeroRedundancyOptimizer: ranks \[1\].*lr"):
        ZeroRedundancyOptimizer([torch.nn.Parameter(torch.zeros(2))], torch.optim.SGD,
                                lr=0.2 if odd else 0.1)
    with pytest.raises(ValueError, match=r"ZeroRedundancyOptimizer: ranks \[1\].*Adam"):
        ZeroRedundancyOptimizer([torch.nn.Parameter(torch.zeros(2))],
                                torch.optim.Adam if odd else torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"PeriodicModelAverager: ranks \[1\].*period"):
        averagers.PeriodicModelAverager(period=3 if odd else 2)
    size = world.Get_size()
    with pytest.raises(ValueError, match=r"HierarchicalModelAverager: ranks \[1\]"):
        HierarchicalModelAverager({2: 1, 4: size} if odd else {3: 1, 4: size})
