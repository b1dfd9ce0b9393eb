"""No hangs: mismatches across ranks are errors on every rank, a stalled collective is reported
and aborted by the watchdog, an exception on one rank ends the job."""
import os
import re
import time
from typing import Tuple

import pytest
import torch
from mpi4py import MPI

from launch import SUPPORT, mpiexec, only_in_single_rank_run
from tensorplay_hpc import comm
from tensorplay_hpc.comm import watchdog
from tensorplay_hpc.comm.agreement import fail_together
from tensorplay_hpc.comm.consistency import DEBUG_ENV, check_consistent, tensor_signature

JOB = str(SUPPORT / "fault_job.py")


@pytest.fixture
def group():
    pg = comm.ProcessGroup()
    yield pg
    pg.close()


def test_consistent_ranks_pass(group):
    items = tensor_signature(["w", "b"], [torch.zeros(3, 4), torch.zeros(4)])
    check_consistent(group.comm, "model", items)
    assert items == [("w", ((3, 4), "float32", "cpu")), ("b", ((4,), "float32", "cpu"))]


def test_quiet_agreement_waits_for_the_last_rank_and_shares_its_error(group):
    """A background thread's waits: no rank leaves a quiet barrier, nor a quiet agreement,
    before the last rank has arrived (each rank arrives 50 ms after the one before), and a
    failure on the last rank is raised everywhere."""
    world, last = group.comm, group.size - 1
    for agreement in (False, True):
        world.Barrier()
        time.sleep(0.05 * group.rank)
        arrived = time.time()     # one clock for all ranks: simulated nodes share the machine
        if agreement:
            error = ValueError("disk full") if group.rank == last else None
            with pytest.raises(RuntimeError) as raised:
                comm.agree(world, error, "saving", quiet=True)
            assert str(raised.value) == (f"saving failed on 1 of {group.size} ranks: "
                                         f"rank {last}: ValueError: disk full")
        else:
            comm.quiet_barrier(world)
        left = time.time()
        assert left >= world.bcast(arrived, root=last)
    comm.agree(world, None, "saving", quiet=True)     # nothing failed: returns on every rank


@pytest.mark.mpi(min_size=2)
def test_fail_together_raises_one_rank_s_failure_on_every_rank(group):
    last = group.size - 1
    with pytest.raises(KeyError) as raised:
        with fail_together(group.comm, "writing", KeyError):
            if group.rank == last:
                raise ValueError("disk full")
    assert raised.value.args == (f"writing failed on 1 of {group.size} ranks: rank {last}: "
                                 "ValueError: disk full",)
    assert isinstance(raised.value.__cause__, ValueError) == (group.rank == last)
    done = []
    with fail_together(group.comm, "writing"):
        done.append(group.rank)
    assert done == [group.rank]


@pytest.mark.mpi(min_size=2)
def test_fail_together_comparing_outcomes_and_items(group):
    last = group.size - 1
    with pytest.raises(TypeError, match="^bad type$"):     # alike everywhere: raised as it was
        with fail_together(group.comm, "loading", items=[("n", 1)]):
            raise TypeError("bad type")
    with pytest.raises(ValueError, match=rf"^loading: ranks \[{last}\] differ from rank 0 .*"
                                         r"rank 0 has \('outcome', 'ok'\), rank "):
        with fail_together(group.comm, "loading", valid_items=lambda: [("n", 1)]):
            if group.rank == last:
                raise TypeError("bad type")
    with pytest.raises(ValueError, match=rf"ranks \[{last}\] differ .* rank 0 has \('n', 1\)"):
        with fail_together(group.comm, "loading", valid_items=lambda: [
                ("n", 2 if group.rank == last else 1)]):
            pass
    with pytest.raises(IndexError, match=f"^rank {group.rank}$"):   # each its own error
        with fail_together(group.comm, "loading", own_errors=True, items=[]):
            raise IndexError(f"rank {group.rank}")


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
def test_debug_mode_catches_mismatched_collective(group, setting):
    setting(DEBUG_ENV, "1")
    t = torch.ones(5 if group.rank == group.size - 1 else 4)
    with pytest.raises(ValueError, match=f"collective all_reduce: ranks \\[{group.size - 1}\\]"):
        comm.all_reduce(t, group.comm)


def _stall(ranks: int, limit: int, nodes=None, **env: str) -> Tuple[str, float]:
    """Run the stalling job: its report, and the seconds from rank 0 entering the stalled
    collective to the end of the job."""
    run = mpiexec(ranks, [JOB, "stall"], timeout=150, nodes=nodes,
                  env=dict(os.environ, TENSORPLAY_HPC_COLLECTIVE_TIMEOUT=str(limit), **env))
    ended = time.time()
    assert run.returncode != 0, run.stdout + run.stderr
    assert "not reached" not in run.stdout
    entered = re.search(r"entering the stalled collective at ([0-9.]+)", run.stdout)
    assert entered, run.stdout + run.stderr
    return run.stderr, ended - float(entered.group(1))


@only_in_single_rank_run
@pytest.mark.timeout(180)
def test_watchdog_reports_missing_rank_and_aborts():
    report, elapsed = _stall(3, limit=3)
    assert "collective timeout: all_reduce (collective #2)" in report
    assert "ranks not arrived: [2]." in report
    assert "not answering" not in report
    assert 3 <= elapsed < 3 + 10


@only_in_single_rank_run
@pytest.mark.timeout(180)
def test_watchdog_names_a_late_rank_on_another_node(simulated_nodes):
    report, elapsed = _stall(4, limit=5, nodes=simulated_nodes)   # rank 3 is on n2
    assert "collective timeout: all_reduce (collective #2) on communicator MPI_COMM_WORLD" in report
    assert re.search(r"of 4 ranks has waited \d+ s \(limit 5 s\); ranks not arrived: \[3\]\.",
                     report), report
    assert "not answering" not in report
    assert 5 <= elapsed < 5 + 10


@only_in_single_rank_run
@pytest.mark.timeout(180)
def test_watchdog_below_thread_multiple_aborts_and_says_why(simulated_nodes):
    report, elapsed = _stall(4, limit=5, nodes=simulated_nodes,
                             MPI4PY_RC_THREAD_LEVEL="serialized")
    assert "collective timeout: all_reduce (collective #2)" in report
    assert ("(limit 5 s); the ranks not arrived cannot be named at thread level "
            "MPI_THREAD_SERIALIZED (the watchdog needs MPI_THREAD_MULTIPLE to ask them). "
            "Aborting the job.") in report
    assert 5 <= elapsed < 5 + 10


@pytest.mark.scale   # every rank asked at once
@pytest.mark.mpi(min_size=2)
@pytest.mark.skipif(MPI.Query_thread() < MPI.THREAD_MULTIPLE, reason="needs MPI_THREAD_MULTIPLE")
def test_watchdog_asks_every_rank_for_its_count(world, setting):
    setting(watchdog.TIMEOUT_ENV, "60")
    watched_comm = world.Dup()
    counter = watchdog.register(watched_comm, "test")
    size = world.Get_size()
    for _ in range(2):
        comm.all_reduce(torch.ones(2), watched_comm)
    if world.Get_rank() == 0:   # the others are inside collective #3, waiting for rank 0
        expected, deadline = [2] + [3] * (size - 1), time.monotonic() + 30
        counts = counter.counts(time.monotonic() + 5)
        while counts != expected and time.monotonic() < deadline:
            time.sleep(0.1)
            counts = counter.counts(time.monotonic() + 5)
        assert counts == expected
    total = torch.ones(2)
    comm.all_reduce(total, watched_comm)
    assert total.tolist() == [size, size] and counter.count == 3
    watchdog.unregister(watched_comm)
    assert counter.queries is None
    with watchdog.watched("all_reduce", watched_comm):    # counted there no more
        pass
    assert counter.count == 3
    watched_comm.Free()


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
    with pytest.raises(ValueError, match=r"ZeroRedundancyOptimizer.*: ranks \[1\].*parameter 0"):
        ZeroRedundancyOptimizer([torch.nn.Parameter(torch.zeros(3 if odd else 2))],
                                torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"ZeroRedundancyOptimizer.*: ranks \[1\].*lr"):
        ZeroRedundancyOptimizer([torch.nn.Parameter(torch.zeros(2))], torch.optim.SGD,
                                lr=0.2 if odd else 0.1)
    with pytest.raises(ValueError, match=r"ZeroRedundancyOptimizer.*: ranks \[1\].*Adam"):
        ZeroRedundancyOptimizer([torch.nn.Parameter(torch.zeros(2))],
                                torch.optim.Adam if odd else torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"PeriodicModelAverager: ranks \[1\].*period"):
        averagers.PeriodicModelAverager(period=3 if odd else 2)
    size = world.Get_size()
    with pytest.raises(ValueError, match=r"HierarchicalModelAverager: ranks \[1\]"):
        HierarchicalModelAverager({2: 1, 4: size} if odd else {3: 1, 4: size})
