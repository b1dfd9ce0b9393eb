"""Checkpoints across separate jobs: resharding to other world sizes, and a rank killed in the
middle of a save."""
import os

import pytest
import torch

from checkpoint_job import make_model, train
from launch import mpiexec, only_in_single_rank_run
from tensorplay_hpc import checkpoint

JOB = os.path.join(os.path.dirname(__file__), "checkpoint_job.py")
pytestmark = only_in_single_rank_run


def uninterrupted(steps):
    model = make_model()
    train(model, torch.optim.Adam(model.parameters(), lr=0.01), 0, steps)
    return [p.detach() for p in model.parameters()]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The checkpoint after 4 steps on a given number of ranks, saved once per world size."""
    paths = {}

    def on(ranks):
        if ranks not in paths:
            path = str(tmp_path_factory.mktemp(f"saved{ranks}") / "ck.h5")
            run = mpiexec(ranks, [JOB, "save", path, "4"])
            assert run.returncode == 0, run.stderr[-3000:]
            paths[ranks] = path
        return paths[ranks]
    return on


@pytest.mark.timeout(600)
@pytest.mark.parametrize("saved_on,loaded_on", [(2, 1), (2, 3), (2, 4), (4, 2)])
def test_resharding_continues_like_an_uninterrupted_run(saved, tmp_path, saved_on, loaded_on):
    out = str(tmp_path / "params.pt")
    run = mpiexec(loaded_on, [JOB, "resume", saved(saved_on), "3", out])
    assert run.returncode == 0, run.stderr[-3000:]
    for ours, reference in zip(torch.load(out), uninterrupted(7)):
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(300)
def test_rank_killed_during_save_leaves_last_checkpoint(tmp_path):
    path = str(tmp_path / "ck.h5")
    run = mpiexec(2, [JOB, "kill-during-save", path], timeout=120)
    assert run.returncode != 0
    assert checkpoint.latest(str(tmp_path)) == path
    model = make_model()
    assert checkpoint.load(path, model)["step"] == 2     # the first save, intact
    leftovers = [n for n in os.listdir(tmp_path) if ".tmp-" in n]
    assert len(leftovers) <= 1                            # the aborted save's temporary file
