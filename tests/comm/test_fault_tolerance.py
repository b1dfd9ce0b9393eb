"""Recovery from a lost rank in the comm layer (ULFM): what says whether it works, the typed
error, and a 3-rank job under Open MPI 5 with fault tolerance on in which one rank dies."""
import re
import time

import pytest
from mpi4py import MPI

import ulfm_lane
from launch import SUPPORT, only_in_single_rank_run
from tensorplay_hpc.comm import capabilities, fault_tolerance, library


def test_failures_of_a_lost_rank_are_told_apart():
    for code in (MPI.ERR_PROC_FAILED, MPI.ERR_REVOKED):
        assert fault_tolerance.is_process_failure(MPI.Exception(code))
    assert not fault_tolerance.is_process_failure(MPI.Exception(MPI.ERR_TRUNCATE))
    assert not fault_tolerance.is_process_failure(RuntimeError("not MPI"))


def test_rank_lost_names_the_ranks_and_the_collective():
    error = fault_tolerance.RankLost([3, 5], "all_reduce", "MPI_ERR_PROC_FAILED: Process Failure")
    assert error.ranks == (3, 5)
    assert str(error) == (f"world ranks [3, 5] lost, seen by world rank {MPI.COMM_WORLD.Get_rank()}"
                          " in all_reduce: MPI_ERR_PROC_FAILED: Process Failure")


def test_recovery_is_off_unless_enabled_and_says_why_it_cannot_work():
    assert not fault_tolerance.enabled()
    reason = capabilities.recovery_unavailable()
    if library.version_text().startswith("Open MPI v4."):
        assert reason.startswith("the MPI library (open-mpi 4.") and "no ULFM" in reason
    elif library.family() != "open-mpi":
        assert reason.startswith("recovery is supported with Open MPI 5 only")
    elif not library.launched_with_fault_tolerance():
        assert "--with-ft ulfm" in reason


@only_in_single_rank_run
@pytest.mark.skipif(ulfm_lane.missing() is not None, reason=str(ulfm_lane.missing()))
@pytest.mark.timeout(120)
def test_survivors_see_rank_lost_and_shrink(tmp_path):
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        job = ulfm_lane.start(3, [str(SUPPORT / "rank_lost_job.py")], out, err)
        code = ulfm_lane.wait(job, 100)
    output = (tmp_path / "out").read_text()
    assert code == 0, output + (tmp_path / "err").read_text()
    for rank in (0, 1):
        lost = re.search(rf"^\[{rank}\] lost (\[2\]|\[\]) in (\S+)", output, re.M)
        assert lost, output    # [] where another survivor's revocation came first
        assert f"[{rank}] shrunk to 2 without [2]" in output
        assert f"[{rank}] sum 1" in output
    assert "no failure seen" not in output


@only_in_single_rank_run
@pytest.mark.skipif(ulfm_lane.missing() is not None, reason=str(ulfm_lane.missing()))
@pytest.mark.timeout(120)
def test_a_hung_rank_is_found_by_the_heartbeat(tmp_path):
    """The last rank stops (SIGSTOP), alive but silent: with the heartbeat on, suspecting a rank
    after 2 s of silence (counted from its last heartbeat, up to a period of 0.5 s before the
    stop), the survivors see ``RankLost`` 1.5 to 10 s after it stopped, then shrink. The stopped
    process stays until it is killed, as a hung node's would: the test kills the job once the
    survivors are done."""
    out_path = tmp_path / "out"
    with open(out_path, "w") as out, open(tmp_path / "err", "w") as err:
        job = ulfm_lane.start(3, [str(SUPPORT / "rank_lost_job.py"), "hang"], out, err,
                              heartbeat=True)
        try:
            deadline = time.monotonic() + 100
            while out_path.read_text().count(" sum ") < 2 and time.monotonic() < deadline \
                    and job.poll() is None:
                time.sleep(0.2)
        finally:
            ulfm_lane.end(job)
    output = out_path.read_text()
    stopped = float(re.search(r"^\[2\] leaving at (\S+)", output, re.M).group(1))
    for rank in (0, 1):
        lost = re.search(rf"^\[{rank}\] lost (\[2\]|\[\]) in \S+ at (\S+)", output, re.M)
        assert lost, output + (tmp_path / "err").read_text()
        assert 1.5 <= float(lost.group(2)) - stopped < 10.0, output
        assert f"[{rank}] shrunk to 2 without [2]" in output
        assert f"[{rank}] sum 1" in output


@only_in_single_rank_run
@pytest.mark.skipif(ulfm_lane.missing() is not None, reason=str(ulfm_lane.missing()))
@pytest.mark.timeout(120)
def test_a_lost_owner_ends_the_one_sided_steps_on_its_parameters(simulated_nodes, tmp_path):
    """The owner of a DistributedOptimizer's parameters (world rank 3, on the second of 2
    simulated nodes) dies while 3 trainers step them: its windows do not survive it, so a
    trainer's one-sided progress thread sees the loss and aborts the job, saying why, within
    seconds, instead of leaving the trainers waiting for a rank that will never answer.
    (Open MPI 5 reports status 86 for the abort under ``--with-ft ulfm`` on one node but 0 across
    nodes, so the test reads the output.)"""
    out_path = tmp_path / "out"
    with open(out_path, "w") as out, open(tmp_path / "err", "w") as err:
        job = ulfm_lane.start(4, [str(SUPPORT / "one_sided_lost_job.py")], out, err,
                              nodes=simulated_nodes)
        code = ulfm_lane.wait(job, 90)
    ended = time.time()
    output, errors = out_path.read_text(), (tmp_path / "err").read_text()
    assert code != ulfm_lane.STILL_RUNNING, output + errors
    assert "[3] transport mpi" in output, output + errors
    left = float(re.search(r"^\[3\] leaving at (\S+)", output, re.M).group(1))
    assert ended - left < 30, output + errors
    assert re.search(r"^\[rank [012]\] the one-sided progress thread: a rank of the job was "
                     r"lost \(MPI_ERR_PROC_FAILED", errors, re.M), output + errors
    assert "with no failure" not in output
