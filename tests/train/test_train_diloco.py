"""The training job with ``--optimizer diloco``: each rank's replica and inner optimizer, the
outer optimizer, the global copy and a sync in flight all survive a checkpoint, so a run stopped
by a signal between syncs resumes exactly; the bytes each sync sends; the program's options."""
import csv
import signal
from pathlib import Path

import pytest
import torch
from mpi4py import MPI

from tensorplay_hpc import checkpoint
from tensorplay_hpc.train.config import TrainConfig
from tensorplay_hpc.train.data import VOCAB_SIZE
from tensorplay_hpc.train.loop import EXIT_PREEMPTED, Run
from tensorplay_hpc.train.model import CharTransformer
from tensorplay_hpc.train.preemption import Preemption
from launch import ONLY_UNDER_ONE_RANK, single_rank
from test_train import shared_dir, tiny, train_here  # noqa: F401 (shared_dir is a fixture)
from train_launch import cross_node_bytes, losses, preempt_program, restarts, run_program

WORLD = MPI.COMM_WORLD
PARAMETERS = sum(p.numel() for p in CharTransformer(VOCAB_SIZE, 16, 32, 1, 2).parameters())
"""Of train_launch.TINY's model."""


def _model(path: Path, replica: str) -> dict:
    with checkpoint.Reader(str(path)) as reader:
        return {n: reader.tensor(f"{replica}model/{n}") for n in reader.names(f"{replica}model")}


@pytest.mark.scale
@pytest.mark.resume_smoke
@pytest.mark.timeout(300)   # four runs; at 8 ranks over 4 nodes of this 2-core machine 64-114 s
@pytest.mark.parametrize("settings", [
    dict(sync_every=4, fragments=2, overlap_steps=1),   # fragment 0's sync of step 4 in flight
    # a replica per node (one here, two over simulated nodes)
    dict(sync_every=3, delta_dtype="bfloat16", outer_momentum=0.5, node_local=True)])
def test_diloco_stopped_between_syncs_resumes_exactly(shared_dir, settings):
    whole = train_here(tiny(shared_dir / "whole", optimizer="diloco", steps=8, **settings))
    expected = losses(shared_dir / "whole")
    assert whole.steps == 8 and float(expected[-1]) < float(expected[0])

    parts = shared_dir / "parts"
    train_here(tiny(parts, optimizer="diloco", steps=3, **settings))
    with Preemption() as preemption:
        if WORLD.rank == 0:   # the stop is agreed after the resumed run's first step
            signal.raise_signal(signal.SIGUSR1)
        stopped = train_here(tiny(parts, optimizer="diloco", steps=8, resume=True, **settings),
                             preemption=preemption)
    assert stopped.exit_code == EXIT_PREEMPTED and stopped.steps == 4
    saved = parts / "checkpoints" / "step-0000004.h5"
    if WORLD.size > 1 and not settings.get("node_local"):   # one replica each, trained apart
        first, second = _model(saved, "replica0/"), _model(saved, "replica1/")
        assert any(not torch.equal(first[name], second[name]) for name in first)
    rest = train_here(tiny(parts, optimizer="diloco", steps=8, resume=True, **settings))
    assert losses(parts) == expected and restarts(parts) == [4, 5]
    assert rest.loss == whole.loss


def test_diloco_resume_keeps_the_outer_settings_of_the_command_line(shared_dir):
    train_here(tiny(shared_dir, optimizer="diloco", sync_every=2, steps=2))
    with Preemption() as preemption, Run(tiny(shared_dir, optimizer="diloco", sync_every=2,
                                              steps=3, outer_lr=0.3, resume=True)) as run:
        run.train(preemption)
        outer_lr = {g["lr"] for g in run.strategy.optimizer.outer_optimizer.param_groups}
        nesterov = {g["nesterov"] for g in run.strategy.optimizer.outer_optimizer.param_groups}
    WORLD.Barrier()
    assert outer_lr == {0.3} and nesterov == {True}


def test_diloco_settings_are_checked():
    with pytest.raises(ValueError, match="--sync-every must be at least 1, got 0"):
        TrainConfig(optimizer="diloco", sync_every=0)
    with pytest.raises(ValueError, match="--outer-lr must be a positive number, got -1"):
        TrainConfig(optimizer="diloco", outer_lr=-1)
    with pytest.raises(ValueError, match="--outer-momentum must be at least 0 and below 1, got 1"):
        TrainConfig(optimizer="diloco", outer_momentum=1)
    with pytest.raises(ValueError, match="--delta-dtype must be one of float32, bfloat16, "
                                         "float16, got 'int8'"):
        TrainConfig(optimizer="diloco", delta_dtype="int8")
    with pytest.raises(ValueError, match="--overlap-steps must not be negative"):
        TrainConfig(optimizer="diloco", overlap_steps=-1)
    with pytest.raises(ValueError, match="--node-local needs --optimizer diloco, got "
                                         "--optimizer ddp"):
        TrainConfig(optimizer="ddp", node_local=True)


def _bytes_per_step(run_dir: Path) -> list:
    with open(run_dir / "metrics.csv", newline="") as f:
        return [int(row["bytes_communicated"]) for row in csv.DictReader(f)]


@pytest.mark.skipif(not single_rank(), reason=ONLY_UNDER_ONE_RANK)
@pytest.mark.timeout(300)
def test_program_trains_with_diloco_sends_16_bit_deltas_and_resumes_after_sigusr1(tmp_path):
    """Two ranks, a sync every 4 steps in bfloat16: the syncing steps send the model's
    parameters in 2 bytes each more than the others; stopped after a checkpoint, the program
    resumes at that step; on one node no byte crosses between nodes."""
    options = ["--optimizer", "diloco", "--sync-every", "4", "--delta-dtype", "bfloat16",
               "--steps", "32", "--checkpoint-every", "4", "--eval-every", "16", "--lr", "0.01"]
    run_dir = tmp_path / "run"
    output = preempt_program(tmp_path, 2, run_dir, 4, *options)
    assert "--optimizer diloco --inner adamw" in output
    stopped_at = len(losses(run_dir))
    assert 4 <= stopped_at < 32
    resumed = run_program(tmp_path, 2, run_dir, *options, "--resume").stdout
    assert f"resumed from {run_dir}/checkpoints/step-{stopped_at:07d}.h5" in resumed
    trained = [float(loss) for loss in losses(run_dir)]
    assert len(trained) == 32 and restarts(run_dir) == [stopped_at + 1]
    assert sum(trained[-4:]) / 4 < sum(trained[:4]) / 4 - 0.5
    sent = _bytes_per_step(run_dir)
    assert {sent[s - 1] - sent[s - 2] for s in range(4, 33, 4)} == {2 * PARAMETERS}
    assert set(cross_node_bytes(run_dir).values()) == {0}
