"""``tensorplay-hpc train --recover`` (ULFM, Open MPI 5 launched with ``--with-ft ulfm``): rank 0
of a 4-rank post-local SGD job (DistributedDataParallel, its hook and a model averager) is
killed with SIGKILL in a chosen step; the survivors roll back to the newest step all of them
committed (every second step, ``--recover-every 2``), with their model and optimizer state bit
for bit as it was then, and finish every step on 3 ranks. The same for rank 1 of a 3-rank ZeRO
job with the hierarchical hook, killed in a validation, whose optimizer shard comes back from
the copy on its partner (rank 2); for rank 1 of a 3-rank DDP job with PowerSGD, whose error
feedback joins its partner's; for rank 1 of a 4-rank hybrid sharding job on one node; for rank 1
of a 3-rank DiLoCo job with a sync in flight; for rank 1 of a 3-rank FSDP2 job; for a whole
simulated node of a 4-rank ZeRO or hybrid sharding job; for a second rank lost during the
recovery or as the groups are rebuilt; for a rank killed before its copies of the last
commit left it (the survivors go back one commit further); and for one killed at a commit that
some survivors complete (they go back two of their commits). Where recovery cannot work (a rank
and its partner lost together, hybrid sharding's nodes left uneven), every survivor says why
and exits with status 86.
The first five jobs run side by side. All are launched with the ``openmpi5`` lane's mpiexec
from the 1-rank pass of whichever lane runs the tests."""
import re
import subprocess
import time
from typing import List, Optional

import pytest
import torch

import lanes
import ulfm_lane
from launch import SUPPORT, only_in_single_rank_run
from tensorplay_hpc.train.config import TrainConfig
from tensorplay_hpc.train.history import History
from tensorplay_hpc.train.recovery import EXIT_UNRECOVERABLE, shard_bytes, shard_from_bytes, refusal

JOB = str(SUPPORT / "recovery_job.py")
TINY = ["--inner", "adam", "--batch-size", "12", "--layers", "1", "--width", "32", "--heads",
        "2", "--context", "32", "--eval-every", "0", "--eval-batches", "1",
        "--checkpoint-every", "0", "--no-progress", "--log-every", "0", "--threads", "1",
        "--recover"]
CASES = {   # case: (ranks, ranks killed, steps done before the kill, steps between commits,
            #        steps, options, killed in)
    "postlocal": (4, [0], 5, 2, 8, ["--optimizer", "postlocal", "--warmup-steps", "2",
                                    "--average-period", "2"], "step"),
    "zero": (3, [1], 2, 1, 4, ["--optimizer", "zero", "--eval-every", "2", "--comm-hook",
                               "hierarchical"], "validation"),
    # PowerSGD compresses from its third step (its warm-up is 2 steps at the least)
    "powersgd": (3, [1], 4, 1, 6, ["--optimizer", "ddp", "--comm-hook", "powersgd",
                                  "--warmup-steps", "2"], "step"),
    # 2 replicas of 2 shards on one node: rank 1's rows are on rank 3 too; 3 shards after
    "hsdp": (4, [1], 2, 1, 4, ["--optimizer", "hsdp"], "step"),
    # rolled back to a sync in flight (started after step 2, applied in step 3)
    "diloco": (3, [1], 2, 1, 6, ["--optimizer", "diloco", "--sync-every", "2",
                                "--overlap-steps", "1"], "step"),
}


def _lines(output: str, what: str, value: str = r"\w+") -> dict:
    """``{(world rank, step): digest}`` of the lines ``[world rank R] WHAT STEP DIGEST`` (the
    digest matching ``value``)."""
    return {(int(r), int(s)): d for r, s, d in
            re.findall(rf"^\[world rank (\d+)\] {what} (\d+) ({value})$", output, re.M)}


def _start(folder, ranks: int, killed: List[int], done: int, every: int, steps: int,
           options: List[str], during: str, nodes=None, then: List[int] = (),
           then_in: str = "recovery") -> subprocess.Popen:
    """The recovery job in ``folder`` (its output in the files ``out`` and ``err`` there);
    ``then``: ranks killed in the recovery from the first loss (``then_in`` ``"recovery"``:
    after the first shrink; ``"rebuild"``: as the groups are rebuilt)."""
    folder.mkdir(exist_ok=True)
    later = (">>" if then_in == "rebuild" else ">") + ",".join(map(str, then))
    spec = ",".join(map(str, killed)) + (later if then else "")
    with open(folder / "out", "w") as out, open(folder / "err", "w") as err:
        return ulfm_lane.start(ranks, [JOB, spec, f"{done}/{during}",
                                       "--recover-every", str(every), "--steps", str(steps),
                                       "--run-dir", str(folder / "run"), *TINY, *options],
                               out, err, nodes)


def _output(folder) -> str:
    return (folder / "out").read_text() + (folder / "err").read_text()


@only_in_single_rank_run
@pytest.mark.skipif(ulfm_lane.missing() is not None, reason=str(ulfm_lane.missing()))
@pytest.mark.timeout(240)
def test_a_killed_rank_is_survived(tmp_path):
    jobs = {case: _start(tmp_path / case, *settings) for case, settings in CASES.items()}
    deadline = time.monotonic() + 220    # one for all: the jobs run side by side
    codes = {case: ulfm_lane.wait(job, deadline - time.monotonic()) for case, job in jobs.items()}
    for case, settings in CASES.items():
        _recovered(tmp_path / case, _output(tmp_path / case), codes[case], *settings[:5])

    # PowerSGD: what compression still owes, the mean of the ranks' error feedback, is the same
    # on the 2 survivors as it was on 3 ranks, the killed rank's error taken from its partner.
    ranks, killed, step = CASES["powersgd"][:3]
    output = _output(tmp_path / "powersgd")
    committed = _lines(output, "committed errors", r"\S+")
    restored = _lines(output, "restored errors", r"\S+")
    assert {s for _, s in restored} == {step}, output[-5000:]
    owed_before = sum(float(committed[r, step]) for r in range(ranks)) / ranks
    owed_after = sum(float(e) for e in restored.values()) / len(restored)
    assert owed_before != 0
    # float32 errors scaled by 2/3, whose sum cancels: rounding shows at about 1e-5 of it
    # (leaving out the killed rank's error, or the scaling, is off by a third)
    assert owed_after == pytest.approx(owed_before, rel=1e-4)


@only_in_single_rank_run
@pytest.mark.skipif(ulfm_lane.missing() is not None, reason=str(ulfm_lane.missing()))
@pytest.mark.timeout(180)
@pytest.mark.parametrize("optimizer", ["zero", "hsdp"])
def test_a_lost_node_is_survived(simulated_nodes, tmp_path, optimizer):
    """Both ranks of the second of 2 simulated nodes killed in one step of a 4-rank job: ZeRO's
    shards come back from the copies on the first node (their partners, world ranks 0 and 1);
    hybrid sharding's replica on the first node holds them too, and the survivors shard it
    again over their one node. The 2 survivors finish the run (and end without MPI_Finalize,
    which would wait for the lost node). Their final checkpoint resumes on 3 ranks of one node
    with the same state, bit for bit."""
    settings = (4, [2, 3], 2, 1, 4, ["--optimizer", optimizer], "step")
    code = ulfm_lane.wait(_start(tmp_path, *settings, nodes=simulated_nodes), 150)
    output = _output(tmp_path)
    _recovered(tmp_path, output, code, *settings[:5])
    _resumes_alike(tmp_path, output, optimizer)


@only_in_single_rank_run
@pytest.mark.skipif(ulfm_lane.missing() is not None, reason=str(ulfm_lane.missing()))
@pytest.mark.timeout(180)
def test_a_rank_of_fsdp2_is_survived(tmp_path):
    """World rank 1 of a 3-rank FSDP2 job (ZeRO-3 over the mpi4py backend) killed in a step:
    the survivors start torch.distributed again over their communicator, put every parameter
    and optimizer state together from their rows and rank 1's rows on its partner, shard them
    anew over 2 ranks and go on with the whole state of the step rank 1 last committed, bit for
    bit. Their final checkpoint resumes on 3 ranks with the same state."""
    settings = (3, [1], 2, 1, 4, ["--optimizer", "fsdp"], "step")
    code = ulfm_lane.wait(_start(tmp_path, *settings), 150)
    output = _output(tmp_path)
    _recovered(tmp_path, output, code, *settings[:5])
    _resumes_alike(tmp_path, output, "fsdp")


@only_in_single_rank_run
@pytest.mark.skipif(ulfm_lane.missing() is not None, reason=str(ulfm_lane.missing()))
@pytest.mark.timeout(180)
def test_hybrid_sharding_refuses_nodes_left_uneven(simulated_nodes, tmp_path):
    """World rank 3 of a 4-rank hybrid sharding job over 2 simulated nodes killed: the
    survivors' nodes would hold 2 ranks and 1, which a (replicate, shard) mesh cannot take; every
    survivor says so and exits with status 86."""
    code = ulfm_lane.wait(_start(tmp_path, 4, [3], 2, 1, 4, ["--optimizer", "hsdp"], "step",
                                 nodes=simulated_nodes), 150)
    output = _output(tmp_path)
    assert code == EXIT_UNRECOVERABLE, output[-5000:]
    for rank in (0, 1, 2):
        assert (f"world rank {rank}: --recover: cannot go on after losing world ranks [3]: "
                f"--optimizer hsdp needs as many ranks on every node, and the survivors' nodes "
                f"hold 2, 1 (a whole node lost is survived); exiting with status "
                f"{EXIT_UNRECOVERABLE}") in output, output[-5000:]


@only_in_single_rank_run
@pytest.mark.skipif(ulfm_lane.missing() is not None, reason=str(ulfm_lane.missing()))
@pytest.mark.timeout(120)
def test_hybrid_sharding_with_every_copy_of_a_shard_lost_ends_the_job(tmp_path):
    """World ranks 1 and 3 of a 4-rank hybrid sharding job on one node (replicas {0, 1} and
    {2, 3}) killed in one step: both held the second shard, which hybrid sharding copies to no
    partner (its replicas are the copies); both survivors say so and exit with status 86."""
    job = _start(tmp_path, 4, [1, 3], 2, 1, 4, ["--optimizer", "hsdp"], "step")
    code = ulfm_lane.wait(job, 100)
    output = _output(tmp_path)
    assert code == EXIT_UNRECOVERABLE, output[-5000:]
    for rank in (0, 2):
        assert re.search(rf"world rank {rank}: --recover: cannot go on after losing ranks: "
                         r"[\w.]+weight: rows \d+ to \d+ of the whole value are missing: every "
                         rf"rank that held them was lost; exiting with status {EXIT_UNRECOVERABLE}",
                         output), output[-5000:]


def _resumes_alike(folder, output: str, optimizer: str) -> None:
    """The final checkpoint (step 4) of the run in ``folder`` resumes on 3 ranks with the
    state, bit for bit, that the run's world rank 0 had at step 4."""
    again = folder / "resumed"
    again.mkdir()
    with open(again / "out", "w") as out, open(again / "err", "w") as err:
        code = ulfm_lane.wait(ulfm_lane.start(3, [JOB, "-1", "0", "--optimizer", optimizer,
                                                  "--steps", "5", "--resume", "--run-dir",
                                                  str(folder / "run"), *TINY], out, err), 120)
    resumed = _output(again)
    assert code == 0, resumed[-5000:]
    assert re.search(r"resumed from \S+step-0000004\.h5 at step 4", resumed), resumed[-5000:]
    assert _lines(resumed, "committed")[0, 4] == _lines(output, "committed")[0, 4]
    assert "done: 5 steps" in resumed


@only_in_single_rank_run
@pytest.mark.skipif(ulfm_lane.missing() is not None, reason=str(ulfm_lane.missing()))
@pytest.mark.timeout(120)
def test_a_rank_lost_during_the_recovery_is_survived(tmp_path):
    """World rank 3 of a 4-rank ZeRO job killed in a step, then rank 1 once the survivors have
    shrunk their communicator: they shrink again and go on with 2 ranks, the shards of ranks 1
    and 3 back from their partners' copies (ranks 2 and 0)."""
    settings = (4, [3], 2, 1, 4, ["--optimizer", "zero"], "step")
    code = ulfm_lane.wait(_start(tmp_path, *settings, then=[1]), 100)
    _recovered(tmp_path, _output(tmp_path), code, 4, [1, 3], *settings[2:5])


@only_in_single_rank_run
@pytest.mark.skipif(ulfm_lane.missing() is not None, reason=str(ulfm_lane.missing()))
@pytest.mark.timeout(120)
def test_copies_still_travelling_are_not_relied_on(tmp_path):
    """World rank 1 of a 3-rank ZeRO job killed in step 3 before its copies of step 2 left it:
    its partner (rank 2) never holds them, so the survivors go back one commit further, to
    step 1, with the state they had then."""
    settings = (3, [1], 2, 1, 4, ["--optimizer", "zero"], "copies")
    code = ulfm_lane.wait(_start(tmp_path, *settings), 100)
    _recovered(tmp_path, _output(tmp_path), code, *settings[:5], at=1)


@only_in_single_rank_run
@pytest.mark.skipif(ulfm_lane.missing() is not None, reason=str(ulfm_lane.missing()))
@pytest.mark.timeout(120)
def test_survivors_a_commit_apart_go_back_to_the_third_kept_step(tmp_path):
    """World rank 1 of a 4-rank ZeRO job killed at its commit of step 3, its copies of step 2
    held back: rank 3, whose copies do not wait on rank 1, has committed step 3 too, while rank
    1's partner (rank 2) holds its copies of step 1 only. The survivors go back to step 1, the
    third step rank 3 keeps."""
    settings = (4, [1], 2, 1, 4, ["--optimizer", "zero"], "commit")
    code = ulfm_lane.wait(_start(tmp_path, *settings), 100)
    output = _output(tmp_path)
    before = output.partition("killing at")[0]
    assert "[world rank 3] kept 3\n" in before and "[world rank 2] kept 3\n" not in before, output
    _recovered(tmp_path, output, code, *settings[:5], at=1)


@only_in_single_rank_run
@pytest.mark.skipif(ulfm_lane.missing() is not None, reason=str(ulfm_lane.missing()))
@pytest.mark.timeout(120)
def test_a_rank_lost_while_the_groups_are_rebuilt_is_survived(tmp_path):
    """World rank 3 of a 4-rank ZeRO job killed in a step, then rank 1 as the survivors start
    rebuilding their groups: they shrink again and go on with 2 ranks from the same step."""
    settings = (4, [3], 2, 1, 4, ["--optimizer", "zero"], "step")
    code = ulfm_lane.wait(_start(tmp_path, *settings, then=[1], then_in="rebuild"), 100)
    output = _output(tmp_path)
    _recovered(tmp_path, output, code, 4, [1, 3], *settings[2:5])
    assert "killing in the rebuild" in output


@only_in_single_rank_run
@pytest.mark.skipif(ulfm_lane.missing() is not None, reason=str(ulfm_lane.missing()))
@pytest.mark.timeout(120)
def test_a_rank_and_its_partner_lost_together_end_the_job(tmp_path):
    """World ranks 1 and 2 of a 4-rank ZeRO job on one node killed in one step: rank 2 holds
    rank 1's copy, so that shard is gone; both survivors say so and exit with status 86."""
    job = _start(tmp_path, 4, [1, 2], 2, 1, 4, ["--optimizer", "zero"], "step")
    code = ulfm_lane.wait(job, 100)
    output = _output(tmp_path)
    assert code == EXIT_UNRECOVERABLE, output[-5000:]
    for rank in (0, 3):
        assert (f"world rank {rank}: --recover: cannot go on after losing ranks: world rank 1's "
                f"own state and its copy on world rank 2 were both lost; exiting with status "
                f"{EXIT_UNRECOVERABLE}") in output, output[-5000:]


def _recovered(folder, output: str, code: int, ranks: int, killed: List[int], done: int,
               every: int, steps: int, at: Optional[int] = None) -> None:
    """The job of ``folder`` lost the ranks ``killed`` in their step ``done + 1``, committing
    every ``every`` steps, and went on from the last commit to the end (or from step ``at``,
    where the last commit's copies had not arrived)."""
    assert code == 0, output[-5000:]
    survivors = [r for r in range(ranks) if r not in killed]
    committed, restored = _lines(output, "committed"), _lines(output, "restored")
    # No committed step is lost: every survivor rolls back to the step the killed ranks last
    # committed, with the state it had then, bit for bit (a ZeRO job's whole optimizer state
    # is in rank 0's digest, its shards put together from the survivors and the copies).
    for rank in killed:
        assert sorted(s for r, s in committed if r == rank) == list(range(0, done + 1, every))
    at = done - done % every if at is None else at
    assert set(restored) == {(r, at) for r in survivors}, output[-5000:]
    for rank in survivors:
        assert restored[rank, at] == committed[rank, at]
        later = min(s for r, s in committed if r == rank and s > at)
        assert later == at + every
        assert committed[rank, later] != committed[rank, at]   # the digest tells steps apart
    assert (f"--recover: world ranks {killed} lost; {len(survivors)} ranks go on from step {at}"
            in output)
    assert f"done: {steps} steps" in output
    metrics = (folder / "run" / "metrics.csv").read_text().splitlines()
    assert [row.split(",")[0] for row in metrics[1:]] == [str(s) for s in range(1, steps + 1)]
    killed_at = float(re.search(r"killing at ([0-9.]+)", output).group(1))
    first = min(float(t) for t in re.findall(r"first step after recovery at ([0-9.]+)", output))
    assert first - killed_at < 20, f"recovery took {first - killed_at:.1f} s"


def test_history_rolls_back_to_a_step():
    history = History(losses=[5.0, 4.0, 3.0, 2.0], tokens_per_second=[1.0, 2.0, 3.0, 4.0],
                      bytes_communicated=[30, 40], validation={2: 3.5, 4: 2.5},
                      cross_node_bytes={2: 100, 4: 200})
    history.rolled_back_to(3)
    assert (history.step, history.losses, history.tokens_per_second) == (3, [5.0, 4.0, 3.0],
                                                                          [1.0, 2.0, 3.0])
    assert history.bytes_communicated == [30]   # counted from step 3 on: step 3's stays
    assert (history.validation, history.cross_node_bytes) == ({2: 3.5}, {2: 100})


def test_recovery_refusals_say_why():
    assert refusal(TrainConfig(optimizer="hsdp"), 3, [2, 1]) == (
        "--optimizer hsdp needs as many ranks on every node, and the survivors' nodes hold 2, 1 "
        "(a whole node lost is survived)")
    assert refusal(TrainConfig(optimizer="ddp", batch_size=32), survivors=3) == (
        "--batch-size 32 does not split over the 3 surviving ranks")
    assert refusal(TrainConfig(optimizer="local", min_ranks=4, batch_size=12), survivors=3) == (
        "3 ranks survive, fewer than --min-ranks 4")
    if lanes.LANE == "system":    # Open MPI 4.1: no ULFM
        assert refusal(TrainConfig(optimizer="postlocal")).startswith(
            "ULFM is not available: the MPI library (open-mpi 4.1")


def test_a_shard_travels_as_bytes_and_comes_back_equal():
    state = {3: {"step": torch.tensor(2.0), "exp_avg": torch.randn(4, 5),
                 "exp_avg_sq": torch.rand(4, 5, dtype=torch.float64)},
             7: {"momentum_buffer": torch.arange(6, dtype=torch.int32).view(2, 3),
                 "note": "kept", "count": 5}}
    back = shard_from_bytes(shard_bytes(state))
    assert sorted(back) == [3, 7] and back[7]["note"] == "kept" and back[7]["count"] == 5
    for index, entries in state.items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                assert back[index][key].dtype == value.dtype
                assert torch.equal(back[index][key], value)
