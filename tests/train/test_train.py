"""Tests of ``tensorplay-hpc train``: data, model, history, and resumes that reproduce an
uninterrupted run exactly; in process at every world size, and as a program under mpiexec."""
import csv
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import torch
from mpi4py import MPI

from tensorplay_hpc import checkpoint, comm
from tensorplay_hpc.train.config import TrainConfig
from tensorplay_hpc.train.data import VALIDATION_EVERY, Corpus, batch_for_rank, stdlib_files
from tensorplay_hpc.train.data import VOCAB_SIZE
from tensorplay_hpc.train.history import History
from tensorplay_hpc.train.model import CharTransformer
from tensorplay_hpc.train.loop import EXIT_PREEMPTED, Run, threads_per_rank, train
from tensorplay_hpc.train.mesh import hybrid_shape
from tensorplay_hpc.train.config import UsageError
from tensorplay_hpc.train.run_folder import CheckpointsDoNotFit, RunFolderInUse
from tensorplay_hpc.train.preemption import Preemption
from launch import ONLY_UNDER_ONE_RANK, REPO, clean_env, single_rank
from train_launch import losses, preempt_program, restarts, train_command

WORLD = MPI.COMM_WORLD


@pytest.fixture
def shared_dir():
    """A temporary folder that every rank sees (made by rank 0), removed afterwards."""
    folder = Path(WORLD.bcast(tempfile.mkdtemp(prefix="tensorplay-train-") if WORLD.rank == 0
                              else None))
    yield folder
    WORLD.Barrier()
    if WORLD.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)


def train_here(config: TrainConfig, **kwargs):
    """Train on every rank; return once rank 0 has written the CSV too."""
    outcome = train(config, **kwargs)
    WORLD.Barrier()
    return outcome


def tiny(folder: Path, **settings) -> TrainConfig:
    values = dict(layers=1, width=32, heads=2, context=16, batch_size=max(8, WORLD.size),
                  eval_every=0, eval_batches=1, progress=False, threads=1, warmup_steps=2,
                  average_period=2, run_dir=folder)
    values.update(settings)
    return TrainConfig(**values)


# -- data, history, settings ------------------------------------------------------------------

def test_corpus_is_the_sorted_stdlib_split_by_position():
    files = stdlib_files()
    assert files == sorted(files, key=lambda p: str(p))
    assert all(p.suffix == ".py" and "site-packages" not in p.parts for p in files)
    corpus = Corpus.from_stdlib()
    validation = files[VALIDATION_EVERY - 1::VALIDATION_EVERY]
    assert corpus.files == len(files)
    assert corpus.validation.numel() == sum(p.stat().st_size for p in validation)
    assert corpus.train.numel() + corpus.validation.numel() == sum(p.stat().st_size for p in files)
    assert bytes(corpus.validation[:64].tolist()) == validation[0].read_bytes()[:64]


def test_rank_slices_make_up_the_global_batch():
    text = torch.arange(1000, dtype=torch.int64).to(torch.uint8)
    whole_x, whole_y = batch_for_rank(text, seed=3, step=7, batch_size=8, context=5, rank=0,
                                      world_size=1)
    parts = [batch_for_rank(text, seed=3, step=7, batch_size=8, context=5, rank=r, world_size=4)
             for r in range(4)]
    assert torch.equal(torch.cat([x for x, _ in parts]), whole_x)
    assert torch.equal(torch.cat([y for _, y in parts]), whole_y)
    assert torch.equal(whole_y[:, :-1], whole_x[:, 1:])
    consecutive = (whole_x[:, 1:] - whole_x[:, :-1]) % 256
    assert torch.equal(consecutive, torch.ones(8, 4, dtype=torch.int64))
    again, _ = batch_for_rank(text, seed=3, step=7, batch_size=8, context=5, rank=0, world_size=1)
    other, _ = batch_for_rank(text, seed=3, step=8, batch_size=8, context=5, rank=0, world_size=1)
    assert torch.equal(again, whole_x) and not torch.equal(other, whole_x)
    with pytest.raises(ValueError, match="--batch-size 6 is not a multiple of the 4 ranks"):
        batch_for_rank(text, seed=3, step=7, batch_size=6, context=5, rank=1, world_size=4)


def test_history_survives_a_checkpoint_extra_and_writes_csv(tmp_path):
    history = History(losses=[5.5, 4.25, 3.0], tokens_per_second=[10.0, 20.0, 30.0],
                      bytes_communicated=[4096, 4104], validation={2: 4.5, 3: 3.5}, restarts=[1],
                      cross_node_bytes={1: 0, 3: 70000})
    assert History.from_extra(history.to_extra()) == history
    history.write_csv(tmp_path / "m.csv")
    assert (tmp_path / "m.csv").read_text().splitlines() == [
        "step,loss,validation_loss,tokens_per_second,bytes_communicated,restart,cross_node_bytes",
        "1,5.500000,,10.0,,0,0", "2,4.250000,4.500000,20.0,4096,1,",
        "3,3.000000,3.500000,30.0,4104,0,70000"]


def test_settings_are_checked():
    with pytest.raises(ValueError, match="--optimizer must be one of zero, postlocal, ddp, local"):
        TrainConfig(optimizer="adagrad")
    with pytest.raises(ValueError, match="--comm-hook fp16 needs --optimizer zero or ddp"):
        TrainConfig(optimizer="postlocal", comm_hook="fp16")
    with pytest.raises(ValueError, match="--comm-hook must be one of none, fp16, bf16, "):
        TrainConfig(comm_hook="int8")
    with pytest.raises(ValueError, match="--width must be at least 1"):
        TrainConfig(width=0)
    with pytest.raises(ValueError, match="--recover-every must be at least 1, got 0"):
        TrainConfig(recover=True, recover_every=0)
    with pytest.raises(ValueError, match="--width 32 is not a multiple of --heads 3"):
        TrainConfig(width=32, heads=3)
    for lr in (-0.1, 0.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=f"--lr must be a positive number, got {lr}"):
            TrainConfig(lr=lr)
    with pytest.raises(ValueError, match="--collective-timeout must be a number of seconds, "
                                         "got nan"):
        TrainConfig(collective_timeout=float("nan"))
    assert TrainConfig(width=64).unfit_for({"width": 32, "heads": 4, "inner": "sgd", "lr": 1}) == [
        "--width 64 but the checkpoints were written with --width 32",
        "--inner adamw but the checkpoints were written with --inner sgd"]
    assert TrainConfig().unfit_for({"optimizer": "ddp", "steps": 5}) == []
    with pytest.raises(ValueError, match="--batch-size 6 is not a multiple of the 4 ranks"):
        TrainConfig(batch_size=6).check_ranks(4)
    TrainConfig(batch_size=8).check_ranks(4)
    assert TrainConfig(run_dir="x").checkpoint_dir == Path("x/checkpoints")


# -- resume in process, at this world size -------------------------------------------------------

@pytest.mark.scale
@pytest.mark.resume_smoke
@pytest.mark.timeout(300)   # four runs; hsdp at 8 ranks over 4 nodes of 2 cores: 86 s to over 120
@pytest.mark.parametrize("optimizer", ["zero", "postlocal", "ddp", "local", "fsdp", "hsdp"])
def test_signal_checkpoint_and_resume_reproduce_an_uninterrupted_run(shared_dir, optimizer):
    whole = train_here(tiny(shared_dir / "whole", optimizer=optimizer, steps=6))
    assert whole.exit_code == 0 and whole.steps == 6
    expected = losses(shared_dir / "whole")
    assert len(expected) == 6 and float(expected[-1]) < float(expected[0])

    parts = shared_dir / "parts"
    first = train_here(tiny(parts, optimizer=optimizer, steps=3))
    assert first.exit_code == 0 and first.checkpoint.endswith("step-0000003.h5")
    with Preemption() as preemption:
        if WORLD.rank == 0:  # one rank is signalled; all must stop at the same step
            signal.raise_signal(signal.SIGUSR1)
        stopped = train_here(tiny(parts, optimizer=optimizer, steps=6, resume=True),
                             preemption=preemption)
    assert stopped.exit_code == EXIT_PREEMPTED
    assert stopped.steps == 4 and stopped.checkpoint.endswith("step-0000004.h5")
    rest = train_here(tiny(parts, optimizer=optimizer, steps=6, resume=True))
    assert rest.exit_code == 0 and rest.steps == 6
    assert losses(parts) == expected
    assert restarts(parts) == [4, 5]
    assert rest.loss == whole.loss


@pytest.mark.scale
def test_hsdp_replicates_across_nodes_and_shards_within_one():
    """The mesh of ``--optimizer hsdp`` at this world size and node layout: a replica per node
    whenever the ranks span several, so only the replicate dimension's traffic crosses nodes."""
    layout = comm.NodeLayout(WORLD)
    rows, line = hybrid_shape(layout)
    if len(layout.nodes) > 1:
        assert rows == tuple(tuple(node) for node in layout.nodes)
        assert line == (f"hsdp: {len(layout.nodes)} replicas (one per node) of "
                        f"{WORLD.size // len(layout.nodes)} shards")
    else:
        shards = {1: 1, 2: 2, 4: 2, 8: 4, 16: 4}[WORLD.size]
        assert rows == tuple(tuple(range(r, r + shards)) for r in range(0, WORLD.size, shards))
    assert sorted(rank for row in rows for rank in row) == list(range(WORLD.size))


@pytest.mark.parametrize("optimizer, hook", [
    ("ddp", "fp16"), ("ddp", "bf16"), ("zero", "powersgd"), ("ddp", "hierarchical")])
def test_comm_hooks_train_and_resume_exactly(shared_dir, optimizer, hook):
    """PowerSGD compresses from step 3 on (after a 2-step warm-up), so the resume at step 4
    needs its error feedback and factors from the checkpoint."""
    settings = dict(optimizer=optimizer, comm_hook=hook, powersgd_rank=2)
    whole = train_here(tiny(shared_dir / "whole", steps=6, **settings))
    expected = losses(shared_dir / "whole")
    assert whole.steps == 6 and float(expected[-1]) < float(expected[0])
    parts = shared_dir / "parts"
    train_here(tiny(parts, steps=4, **settings))
    rest = train_here(tiny(parts, steps=6, resume=True, **settings))
    assert losses(parts) == expected and rest.loss == whole.loss


def test_metrics_count_the_bytes_of_each_step_and_fp16_halves_the_gradients(shared_dir):
    counts = {}
    for hook in ("none", "fp16"):
        train_here(tiny(shared_dir / hook, optimizer="ddp", comm_hook=hook, steps=2))
        with open(shared_dir / hook / "metrics.csv", newline="") as f:
            counts[hook] = [int(row["bytes_communicated"]) for row in csv.DictReader(f)]
    model = CharTransformer(VOCAB_SIZE, 16, 32, 1, 2)
    gradients = sum(p.numel() for p in model.parameters())
    assert counts["none"][0] == counts["none"][1] > 4 * gradients
    assert [a - b for a, b in zip(counts["none"], counts["fp16"])] == [2 * gradients] * 2


def test_a_new_run_refuses_a_folder_with_an_earlier_run_and_resume_names_changed_settings(
        shared_dir, capsys):
    first = train_here(tiny(shared_dir, steps=2))
    assert first.steps == 2
    metrics = (shared_dir / "metrics.csv").read_text()
    settings = json.loads((shared_dir / "settings.json").read_text())
    assert (settings["steps"], settings["ranks"], settings["started_at_step"]) == (
        2, WORLD.size, 0)
    with pytest.raises(RunFolderInUse, match="holds an earlier run .* pass --resume"):
        train(tiny(shared_dir, steps=4))
    assert (shared_dir / "metrics.csv").read_text() == metrics
    assert sorted(p.name for p in (shared_dir / "checkpoints").iterdir()) == ["step-0000002.h5"]
    capsys.readouterr()
    with Preemption() as preemption, Run(tiny(shared_dir, steps=3, lr=0.01, resume=True)) as run:
        resumed = run.train(preemption)
        stepped_with = {group["lr"] for group in run.strategy.optimizer.optim.param_groups}
    WORLD.Barrier()
    assert resumed.steps == 3 and stepped_with == {0.01}
    said = capsys.readouterr().out
    if WORLD.rank == 0:
        assert "--resume: --lr was 0.003 when the checkpoint was saved, now 0.01" in said
        assert "--resume: --steps was 2 when the checkpoint was saved, now 3" in said
        assert "--threads" not in said and "--resume: --resume" not in said
    assert json.loads((shared_dir / "settings.json").read_text())["started_at_step"] == 2


def files_in(folder: Path) -> dict:
    """Every file under ``folder``: its contents and modification time."""
    return {path: (path.read_bytes(), path.stat().st_mtime_ns)
            for path in sorted(folder.rglob("*")) if path.is_file()}


def test_resume_without_a_checkpoint_it_can_continue_is_refused_and_writes_nothing(shared_dir):
    train_here(tiny(shared_dir, steps=2))
    before = files_in(shared_dir)
    for change, reason in ((dict(width=48), "--width 48 but the checkpoints were written with "
                            "--width 32"),
                           (dict(inner="sgd", heads=4), "--heads 4 but the checkpoints were "
                            "written with --heads 2; --inner sgd but the checkpoints were "
                            "written with --inner adamw")):
        with pytest.raises(CheckpointsDoNotFit, match=re.escape(
                f"--resume: {reason}: no checkpoint in {shared_dir}/checkpoints fits this run, "
                "and nothing was written")):
            train(tiny(shared_dir, steps=4, resume=True, **change))
    assert files_in(shared_dir) == before

    other = shared_dir / "other"   # a checkpoint without the run's settings, of another model
    torch.manual_seed(0)   # the same on every rank
    checkpoint.save(str(other / "checkpoints" / "step-0000001.h5"), model=torch.nn.Linear(2, 2),
                    extra={"step": 1}, process_group=WORLD)
    before = files_in(other)
    with pytest.raises(UsageError, match=re.escape(
            f"--resume: none of the 1 checkpoints in {other}/checkpoints loads (see above), and "
            "nothing was written")):
        train(tiny(other, steps=2, resume=True))
    WORLD.Barrier()
    assert files_in(other) == before


def test_threads_follow_slurm_cpus_per_task(monkeypatch):
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "8")
    assert threads_per_rank(WORLD, 0) == 8
    assert threads_per_rank(WORLD, 3) == 3


# -- the program under mpiexec --------------------------------------------------------------------

def run_to_end(tmp_path: Path, options, run_dir: Path, *more: str,
               ranks: int = 2) -> subprocess.CompletedProcess:
    """Run the program on ``ranks`` ranks to its end; it must succeed."""
    result = subprocess.run(train_command(ranks, *options, "--run-dir", str(run_dir), *more),
                            cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def preempt_after_checkpoint(tmp_path: Path, options, run_dir: Path, step: int,
                             ranks: int = 2) -> int:
    """Run the program, stop it with SIGUSR1 once the checkpoint of ``step`` is written
    (:func:`train_launch.preempt_program`); return the step it stopped at, checkpointed."""
    preempt_program(tmp_path, ranks, run_dir, step, *options)
    stopped_at = len(losses(run_dir))
    assert (run_dir / "checkpoints" / f"step-{stopped_at:07d}.h5").exists()
    return stopped_at


@pytest.mark.skipif(not single_rank(), reason=ONLY_UNDER_ONE_RANK)
@pytest.mark.timeout(900)
def test_program_on_two_ranks_stops_on_sigusr1_and_resumes_exactly(tmp_path):
    options = ["--steps", "80", "--checkpoint-every", "5", "--eval-every", "40"]
    whole = run_to_end(tmp_path, options, tmp_path / "whole")
    expected = losses(tmp_path / "whole")
    assert len(expected) == 80 and float(expected[-1]) < float(expected[0]) - 1.0
    for line in ("done: 80 steps", "throughput:", "metrics: ", "plot: ", "checkpoints: "):
        assert line in whole.stdout
    assert (tmp_path / "whole" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    run_dir = tmp_path / "parts"
    stopped_at = preempt_after_checkpoint(tmp_path, options, run_dir, 5)
    assert 5 < stopped_at < 80

    resumed = run_to_end(tmp_path, options, run_dir, "--resume")
    assert f"at step {stopped_at}" in resumed.stdout
    assert losses(run_dir) == expected
    assert restarts(run_dir) == [stopped_at + 1]


@pytest.mark.skipif(not single_rank(), reason=ONLY_UNDER_ONE_RANK)
def test_program_refuses_to_resume_with_another_width_and_leaves_the_run_as_it_was(tmp_path):
    run_dir = tmp_path / "run"
    train_here(tiny(run_dir, steps=4, checkpoint_every=2))
    before = files_in(run_dir)
    assert [path.name for path in before if path.suffix == ".h5"] == [
        "step-0000002.h5", "step-0000004.h5"]
    result = subprocess.run(train_command(2, "--steps", "6", "--width", "48", "--run-dir",
                                          str(run_dir), "--resume"),
                            cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("tensorplay-hpc train: error: ") == 1, result.stderr
    assert (f"tensorplay-hpc train: error: --resume: --width 48 but the checkpoints were written "
            f"with --width 32: no checkpoint in {run_dir}/checkpoints fits this run, and nothing "
            "was written" in result.stderr)
    assert "Traceback" not in result.stderr and "MPI_ABORT" not in result.stderr
    assert files_in(run_dir) == before


@pytest.mark.skipif(not single_rank(), reason=ONLY_UNDER_ONE_RANK)
def test_console_script_and_module_show_the_train_options():
    script = shutil.which("tensorplay-hpc")
    assert script is not None, "the tensorplay-hpc console script is not installed"
    for command in ([script, "train", "--help"],
                    ["python", "-m", "tensorplay_hpc", "train", "--help"]):
        result = subprocess.run(command, cwd=REPO, env=clean_env(), capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0, result.stderr
        for option in ("--optimizer", "--inner", "--checkpoint-every", "--resume", "--device"):
            assert option in result.stdout


@pytest.mark.skipif(not single_rank(), reason=ONLY_UNDER_ONE_RANK)
@pytest.mark.timeout(900)
def test_rank_killed_mid_training_ends_the_job_and_resume_loses_nothing(tmp_path):
    options = ["--steps", "60", "--checkpoint-every", "10", "--eval-every", "30"]
    run_to_end(tmp_path, options, tmp_path / "whole")
    expected = losses(tmp_path / "whole")

    run_dir = tmp_path / "killed"
    job = subprocess.Popen(train_command(2, *options, "--run-dir", str(run_dir)), cwd=tmp_path,
                           env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    for line in job.stdout:
        if "checkpoint at step 20 " in line:
            break
    ranks = subprocess.run(["pgrep", "-P", str(job.pid)], capture_output=True, text=True).stdout
    victim = int(ranks.split()[-1])
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    job.stdout.read()
    assert job.wait(timeout=120) != 0
    assert time.monotonic() - killed_at < 30
    newest = checkpoint.latest(str(run_dir / "checkpoints"))
    assert newest is not None and int(newest[-10:-3]) >= 20

    run_to_end(tmp_path, options, run_dir, "--resume")
    assert losses(run_dir) == expected      # every step after the checkpoint redone exactly
