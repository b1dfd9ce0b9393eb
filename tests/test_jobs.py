"""Tests of ``jobs/``: the scripts pass shellcheck; ``local.sh`` stops at a checkpoint on
SIGTERM and resumes; on a real single-node Slurm, ``train.sbatch`` is signalled before its time
limit, checkpoints, requeues itself and finishes with the losses of an uninterrupted run, and
``bench.sbatch`` prints benchmark results."""
import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from slurm_cluster import SlurmCluster, SlurmUnavailable
from tensorplay_hpc.train.preemption import EXIT_PREEMPTED
from launch import ONLY_UNDER_ONE_RANK, REPO, clean_env, single_rank
from train_launch import TINY, losses, restarts, train_command

nested = pytest.mark.skipif(not single_rank(), reason=ONLY_UNDER_ONE_RANK)

RUN = ["--steps", "150", "--checkpoint-every", "10"]
"""Long enough that a signal sent at the first checkpoint arrives before the end."""


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list:
    """The losses of RUN at 2 ranks without a stop (what every resumed run must reproduce)."""
    if not single_rank():
        pytest.skip(ONLY_UNDER_ONE_RANK)
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    result = subprocess.run(train_command(2, *RUN, "--run-dir", str(run_dir)), cwd=run_dir,
                            env=clean_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return losses(run_dir)


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


@pytest.fixture(scope="module")
def cluster():
    if not single_rank():
        pytest.skip(ONLY_UNDER_ONE_RANK)
    try:
        with SlurmCluster() as running:
            yield running
    except SlurmUnavailable as reason:
        pytest.skip(f"no Slurm: {reason}")


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


@nested
@pytest.mark.timeout(1200)
def test_train_sbatch_is_signalled_requeued_and_finishes_like_an_uninterrupted_run(
        cluster, uninterrupted, tmp_path):
    run_dir, output = tmp_path / "slurm", tmp_path / "job.out"
    job = cluster.sbatch([f"--output={output}", "jobs/train.sbatch", *TINY, *RUN], cwd=REPO,
                         env=clean_env(RUN_DIR=str(run_dir)))
    _wait_for_text(output, "checkpoint at step 10 ", 300, cluster, job)
    # What --signal=B:USR1@120 does two minutes before the time limit: USR1 to the batch shell.
    signalled = cluster.run(["scancel", "--signal=USR1", "--batch", job])
    assert signalled.returncode == 0, signalled.stderr
    info = _wait_for_state(cluster, job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, 600)
    log = output.read_text(errors="replace")
    assert info["JobState"] == "COMPLETED", log
    assert info["Restarts"] == "1", log
    for line in ("signal received", "SIGUSR1: stopping at step", f"requeueing job {job}",
                 f"job {job} run 2", "resumed from", "done: 150 steps"):
        assert line in log
    assert losses(run_dir) == uninterrupted
    assert len(restarts(run_dir)) == 1
    assert (run_dir / "loss.png").exists()


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
