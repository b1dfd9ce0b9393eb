"""Tests of ``jobs/``: the scripts pass shellcheck; ``local.sh`` stops at a checkpoint on
SIGTERM and resumes; on a real Slurm, of one node and of two simulated nodes, ``train.sbatch`` is
signalled before its time limit, checkpoints, requeues itself and finishes with the losses of an
uninterrupted run, and ``bench.sbatch`` prints benchmark results."""
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

import pytest

from slurm_cluster import SlurmCluster, SlurmUnavailable
from tensorplay_hpc.train.preemption import EXIT_PREEMPTED
from launch import ONLY_UNDER_ONE_RANK, REPO, clean_env, single_rank
from simulated_nodes import SimulatedNodes
from train_launch import TINY, losses, restarts, train_command

nested = pytest.mark.skipif(not single_rank(), reason=ONLY_UNDER_ONE_RANK)

RUN = ["--steps", "150", "--checkpoint-every", "10"]
"""Long enough that a signal sent at the first checkpoint arrives before the end."""
RUN_ON_TWO_NODES = ["--steps", "60", "--checkpoint-every", "10"]
"""RUN across two nodes, where each step takes several times longer: 50 steps after the first
checkpoint still leave the signal time to arrive."""

def _shared_folder(nodes: SimulatedNodes, name: str) -> Path:
    """A new folder in the nodes' scratch, which every node sees (a node's /tmp is its own);
    it goes with the cluster."""
    return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=nodes.scratch))


def _uninterrupted(run_dir: Path, ranks: int, *options: str,
                   nodes: Optional[SimulatedNodes] = None) -> List[str]:
    """The losses of RUN (RUN_ON_TWO_NODES across ``nodes``) at ``ranks`` ranks without a stop
    (what every resumed run must reproduce), on this node or across ``nodes``."""
    run = RUN if nodes is None else RUN_ON_TWO_NODES
    result = subprocess.run(train_command(ranks, *run, *options, "--run-dir", str(run_dir),
                                          nodes=nodes),
                            cwd=run_dir, env=clean_env(), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return losses(run_dir)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list:
    """RUN's losses at 2 ranks on this node."""
    if not single_rank():
        pytest.skip(ONLY_UNDER_ONE_RANK)
    return _uninterrupted(tmp_path_factory.mktemp("uninterrupted"), 2)


@pytest.fixture(scope="module")
def uninterrupted_on_two_nodes(simulated_nodes) -> list:
    """RUN_ON_TWO_NODES's losses at 4 ranks, 2 on each simulated node (mpiexec, no Slurm)."""
    return _uninterrupted(_shared_folder(simulated_nodes, "uninterrupted"), 4,
                          nodes=simulated_nodes)


def test_job_scripts_pass_shellcheck():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (scripts/setup.sh installs it)")
    scripts = sorted(str(p.relative_to(REPO)) for pattern in ("jobs/*.sh", "jobs/*.sbatch",
                                                             "scripts/*.sh")
                     for p in REPO.glob(pattern))
    assert {"jobs/local.sh", "jobs/train.sbatch", "jobs/train-gpu.sbatch",
            "jobs/bench.sbatch"} <= set(scripts)
    result = subprocess.run(["shellcheck", *scripts], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


@nested
@pytest.mark.timeout(900)
def test_local_sh_checkpoints_on_sigterm_and_resumes(uninterrupted, tmp_path):
    run_dir = tmp_path / "local"
    command = ["bash", str(REPO / "jobs" / "local.sh"), *TINY, *RUN, "--run-dir", str(run_dir)]
    job = subprocess.Popen(command, cwd=tmp_path, env=clean_env(RANKS="2"), text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seen = []
    for line in job.stdout:
        seen.append(line)
        if "checkpoint at step 10 " in line:
            job.send_signal(signal.SIGTERM)  # to the script, which asks the ranks to stop
            break
    seen.extend(job.stdout)
    output = "".join(seen)
    assert job.wait(timeout=300) == EXIT_PREEMPTED, output
    assert "signal received" in output and "run " in output and "again" in output
    stopped_at = len(losses(run_dir))
    assert 10 < stopped_at < 150

    again = subprocess.run(command, cwd=tmp_path, env=clean_env(RANKS="2"), capture_output=True,
                           text=True, timeout=600)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"resumed from {run_dir / 'checkpoints'}" in again.stdout
    assert losses(run_dir) == uninterrupted
    assert restarts(run_dir) == [stopped_at + 1]


def _slurm(**options):
    """A running ``SlurmCluster(**options)``, stopped after; a skip where Slurm cannot run."""
    if not single_rank():
        pytest.skip(ONLY_UNDER_ONE_RANK)
    try:
        with SlurmCluster(**options) as running:
            yield running
    except SlurmUnavailable as reason:
        pytest.skip(f"no Slurm: {reason}")


@pytest.fixture(scope="module")
def cluster():
    """A Slurm of one node: this machine."""
    yield from _slurm()


@pytest.fixture(scope="module")
def two_nodes(simulated_nodes):
    """A Slurm of two nodes, ``n1`` and ``n2``, of two CPUs each: the simulated nodes."""
    yield from _slurm(nodes=simulated_nodes)


def _wait_for_state(cluster: SlurmCluster, job: str, states: set, seconds: float) -> dict:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        info = cluster.job(job)
        if info.get("JobState") in states:
            return info
        time.sleep(1)
    raise AssertionError(f"job {job} not in {states} within {seconds} s: {cluster.job(job)}\n"
                         f"{cluster.logs()}")


def _wait_for_text(path: Path, text: str, seconds: float, cluster: SlurmCluster, job: str) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        if cluster.job(job).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
            break
        time.sleep(0.5)
    content = path.read_text(errors="replace") if path.exists() else "(no output)"
    raise AssertionError(f"{text!r} not in {path} within {seconds} s:\n{content}")


def _signal_and_finish(cluster: SlurmCluster, job: str, output: Path, run_dir: Path,
                       expected: List[str]) -> str:
    """Send ``job`` (train.sbatch of ``len(expected)`` steps) the time-limit warning after its
    first checkpoint;
    check that it is requeued once, resumes and ends with the ``expected`` losses. The log."""
    _wait_for_text(output, "checkpoint at step 10 ", 300, cluster, job)
    # What --signal=B:USR1@120 does two minutes before the time limit: USR1 to the batch shell.
    signalled = cluster.run(["scancel", "--signal=USR1", "--batch", job])
    assert signalled.returncode == 0, signalled.stderr
    info = _wait_for_state(cluster, job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, 600)
    log = output.read_text(errors="replace")
    assert info["JobState"] == "COMPLETED", log
    assert info["Restarts"] == "1", log
    for line in ("signal received", "SIGUSR1: stopping at step", f"requeueing job {job}",
                 f"job {job} run 2", "resumed from", f"done: {len(expected)} steps"):
        assert line in log
    assert losses(run_dir) == expected
    assert len(restarts(run_dir)) == 1
    assert (run_dir / "loss.png").exists()
    return log


@nested
@pytest.mark.timeout(1200)
def test_train_sbatch_is_signalled_requeued_and_finishes_like_an_uninterrupted_run(
        cluster, uninterrupted, tmp_path):
    run_dir, output = tmp_path / "slurm", tmp_path / "job.out"
    job = cluster.sbatch([f"--output={output}", "jobs/train.sbatch", *TINY, *RUN], cwd=REPO,
                         env=clean_env(RUN_DIR=str(run_dir)))
    log = _signal_and_finish(cluster, job, output, run_dir, uninterrupted)
    assert "2 ranks of 1 CPUs on " in log


@nested
@pytest.mark.timeout(300)
def test_srun_in_a_two_node_job_runs_two_ranks_on_each_node(two_nodes, simulated_nodes):
    output = _shared_folder(simulated_nodes, "probe") / "probe.out"
    job = two_nodes.sbatch([f"--output={output}", "--nodes=2", "--ntasks-per-node=2", "--wrap",
                            f"srun --mpi=pmix {sys.executable} tests/support/node_probe.py"],
                           cwd=REPO, env=clean_env())
    info = _wait_for_state(two_nodes, job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, 120)
    log = output.read_text(errors="replace")
    assert info["JobState"] == "COMPLETED" and info["NodeList"] == "n[1-2]", log
    seen = json.loads(log.strip().splitlines()[-1])
    assert [r["hostname"] for r in seen] == ["n1", "n1", "n2", "n2"]
    assert [r["processor"] for r in seen] == ["n1", "n1", "n2", "n2"]
    assert [r["node_size"] for r in seen] == [2, 2, 2, 2]
    assert [r["shared_window_over_world"] for r in seen] == [False] * 4


@nested
@pytest.mark.timeout(1200)
def test_train_sbatch_on_two_nodes_is_signalled_requeued_and_finishes_like_an_uninterrupted_run(
        two_nodes, simulated_nodes, uninterrupted_on_two_nodes):
    folder = _shared_folder(simulated_nodes, "slurm")
    run_dir, output = folder / "run", folder / "job.out"
    job = two_nodes.sbatch([f"--output={output}", "--nodes=2", "--ntasks-per-node=2",
                            "jobs/train.sbatch", *TINY, *RUN_ON_TWO_NODES],
                           cwd=REPO, env=clean_env(RUN_DIR=str(run_dir)))
    log = _signal_and_finish(two_nodes, job, output, run_dir, uninterrupted_on_two_nodes)
    assert "4 ranks of 1 CPUs on n[1-2]" in log


@nested
@pytest.mark.timeout(900)
def test_bench_sbatch_prints_json_results(cluster, tmp_path):
    output, results = tmp_path / "bench.out", tmp_path / "bench.jsonl"
    job = cluster.sbatch([f"--output={output}", "jobs/bench.sbatch"], cwd=REPO,
                         env=clean_env(BENCHMARKS="comm", REPEAT="1", RESULTS=str(results)))
    info = _wait_for_state(cluster, job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, 600)
    log = output.read_text(errors="replace")
    assert info["JobState"] == "COMPLETED", log
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert rows and all(row["bench"] == "comm" and row["ranks"] == 2 for row in rows)
    assert {"allreduce", "allgather", "broadcast"} <= {row["case"] for row in rows}
    assert all(row["ours_s"] > 0 and row["speedup"] > 0 for row in rows)


@nested
@pytest.mark.timeout(900)
def test_train_gpu_sbatch_runs_its_training_step(cluster, tmp_path):
    # This node has no GPU: ask for none, and let the trailing --device cpu override the
    # script's --device cuda, so everything but the device is the real script at work.
    output, run_dir = tmp_path / "gpu.out", tmp_path / "gpu"
    job = cluster.sbatch([f"--output={output}", "--gpus-per-node=0", "--cpus-per-task=1",
                          "--ntasks-per-node=2", "jobs/train-gpu.sbatch", *TINY, "--steps", "20",
                          "--device", "cpu"], cwd=REPO, env=clean_env(RUN_DIR=str(run_dir)))
    info = _wait_for_state(cluster, job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, 600)
    log = output.read_text(errors="replace")
    assert info["JobState"] == "COMPLETED", log
    assert "2 ranks on cpu" in log and "CUDA-aware MPI override: none" in log
    assert "done: 20 steps" in log and "training exited with status 0" in log
    assert len(losses(run_dir)) == 20
