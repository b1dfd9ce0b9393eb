"""The training program with PyTorch's FSDP2 over MPI (``--optimizer fsdp`` and ``hsdp``): exact
resume after SIGUSR1, resume at other rank counts, and checkpoints that load into a plain
model."""
import shutil
from pathlib import Path

import pytest
import torch
from mpi4py import MPI

from tensorplay_hpc import checkpoint
from tensorplay_hpc.train.data import VOCAB_SIZE, Corpus, batch_for_rank, validation_batches
from tensorplay_hpc.train.model import CharTransformer, next_token_loss
from launch import ONLY_UNDER_ONE_RANK, single_rank
from train_launch import losses, preempt_program, restarts, run_program

pytestmark = [pytest.mark.skipif(not single_rank(), reason=ONLY_UNDER_ONE_RANK),
              pytest.mark.timeout(600)]

STEPS = 8
OPTIONS = ["--steps", str(STEPS), "--checkpoint-every", "2", "--keep", "0", "--eval-every", "4",
           "--seed", "3"]
SHAPE = dict(context=16, width=32, layers=1, heads=2)   # train_launch.TINY's
SEED, BATCH = 3, 8


def _step_file(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step-{step:07d}.h5"


def _model_tensors(path: Path) -> dict:
    with checkpoint.Reader(str(path)) as reader:
        return {name: reader.tensor(f"model/{name}") for name in reader.names("model")}


def _plain(path: Path):
    """The checkpoint loaded into an unsharded model and a plain AdamW, on this rank alone."""
    torch.manual_seed(0)
    model = CharTransformer(VOCAB_SIZE, SHAPE["context"], SHAPE["width"], SHAPE["layers"],
                            SHAPE["heads"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    extra = checkpoint.load(str(path), model=model, optimizer=optimizer,
                            process_group=MPI.COMM_SELF)
    return model, optimizer, extra


def _loss_at(model, corpus: Corpus, step: int) -> float:
    """The training loss of the global batch of ``step`` (0-based), as the program reports it
    (every rank's slice is the same size, so the mean of the ranks' means)."""
    inputs, targets = batch_for_rank(corpus.train, seed=SEED, step=step, batch_size=BATCH,
                                     context=SHAPE["context"], rank=0, world_size=1)
    with torch.no_grad():
        return next_token_loss(model, inputs, targets).item()


def _validation(model, corpus: Corpus, ranks: int) -> float:
    """The validation loss as ``ranks`` ranks compute it: the mean of each rank's mean."""
    means = []
    with torch.no_grad():
        for rank in range(ranks):
            batches = validation_batches(corpus.validation, seed=SEED, batches=1,
                                         batch_size=BATCH, context=SHAPE["context"], rank=rank,
                                         world_size=ranks)
            means.append(torch.stack([next_token_loss(model, x, y) for x, y in batches]).mean())
    return torch.stack(means).double().mean().item()


def _close(a, b, tolerance=2e-5):
    assert len(a) == len(b) and all(abs(float(x) - float(y)) <= tolerance
                                    for x, y in zip(a, b)), (a, b)


def test_fsdp_resumes_exactly_after_sigusr1_at_other_rank_counts_and_into_a_plain_model(
        tmp_path):
    whole = tmp_path / "whole"
    output = run_program(tmp_path, 2, whole, "--optimizer", "fsdp", *OPTIONS).stdout
    assert "fsdp: parameters, gradients and optimizer state in 2 shards" in output
    expected = losses(whole)
    assert len(expected) == STEPS and float(expected[-1]) < float(expected[0])

    parts = tmp_path / "parts"
    preempt_program(tmp_path, 2, parts, 2, "--optimizer", "fsdp", *OPTIONS)
    stopped_at = len(losses(parts))
    assert 2 <= stopped_at < STEPS and _step_file(parts, stopped_at).exists()
    resumed = run_program(tmp_path, 2, parts, "--optimizer", "fsdp", *OPTIONS, "--resume").stdout
    assert f"at step {stopped_at}" in resumed
    assert losses(parts) == expected and restarts(parts) == [stopped_at + 1]
    final = _model_tensors(_step_file(whole, STEPS))
    assert all(torch.equal(final[name], value)
               for name, value in _model_tensors(_step_file(parts, STEPS)).items())

    # The file holds whole tensors: an unsharded model and AdamW load it and compute what
    # the FSDP model computed (its validation loss at the end, the next step's loss).
    corpus = Corpus.from_stdlib()
    model, optimizer, extra = _plain(_step_file(whole, STEPS))
    assert extra["step"] == STEPS
    assert all(torch.equal(p, final[name]) for name, p in model.state_dict().items())
    with open(whole / "metrics.csv") as f:
        saved_validation = float(f.read().splitlines()[-1].split(",")[2])
    assert abs(_validation(model, corpus, 2) - saved_validation) <= 2e-6
    state = optimizer.state_dict()["state"]
    shapes = [tuple(p.shape) for p in model.parameters()]
    assert len(state) == len(shapes)
    assert [tuple(state[i]["exp_avg"].shape) for i in range(len(shapes))] == shapes
    assert all(state[i]["step"].item() == STEPS for i in state)

    # A 2-rank checkpoint continues at 1 and at 4 ranks from the parameters in the file.
    middle = _step_file(whole, 4)
    plain, _, _ = _plain(middle)
    assert abs(_loss_at(plain, corpus, 4) - float(expected[4])) <= 2e-5
    for ranks in (1, 4):
        run_dir = tmp_path / f"at{ranks}"
        (run_dir / "checkpoints").mkdir(parents=True)
        shutil.copy(middle, run_dir / "checkpoints")
        run_program(tmp_path, ranks, run_dir, "--optimizer", "fsdp", *OPTIONS, "--resume")
        continued = losses(run_dir)
        assert continued[:4] == expected[:4]
        # the same sums in other orders: equal to the last digits (Adam then magnifies such
        # differences in the parameters of near-zero gradients, so those are not compared)
        _close(continued[4:], expected[4:])


def _hsdp_resumes_exactly(tmp_path: Path, layout: str) -> None:
    """An hsdp run of 4 ranks says ``layout``, and stopped by SIGUSR1 and resumed gives the
    losses of an uninterrupted run."""
    options = ["--optimizer", "hsdp", *OPTIONS]
    whole = tmp_path / "whole"
    output = run_program(tmp_path, 4, whole, *options).stdout
    assert layout in output
    expected = losses(whole)
    assert len(expected) == STEPS

    parts = tmp_path / "parts"
    preempt_program(tmp_path, 4, parts, 2, *options)
    stopped_at = len(losses(parts))
    assert 2 <= stopped_at < STEPS
    run_program(tmp_path, 4, parts, *options, "--resume")
    assert losses(parts) == expected and restarts(parts) == [stopped_at + 1]


def test_hsdp_on_four_ranks_of_one_node_is_two_by_two_and_resumes_exactly(tmp_path):
    _hsdp_resumes_exactly(tmp_path, "hsdp: one node, so 2 replicas of 2 shards each")
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    # the same file as fsdp writes: whole tensors, loadable unsharded
    model, _, _ = _plain(_step_file(parts, STEPS))
    final = _model_tensors(_step_file(whole, STEPS))
    assert all(torch.equal(p, final[name]) for name, p in model.state_dict().items())
