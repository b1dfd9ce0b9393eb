"""Checkpoints across separate jobs: resharding to other world sizes, and a rank killed in the
middle of a save."""
import os
import resource
import uuid

import pytest
import torch

from checkpoint_job import make_model, train
from launch import SUPPORT, mpiexec, only_in_single_rank_run
from tensorplay_hpc import checkpoint

JOB = str(SUPPORT / "checkpoint_job.py")
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
@pytest.mark.parametrize("mode", ["kill-during-save", "kill-during-async-save"])
def test_rank_killed_during_save_leaves_last_checkpoint(tmp_path, mode):
    """The async save's writer thread kills its rank in the middle of the background write,
    while the main threads train."""
    path = str(tmp_path / "ck.h5")
    run = mpiexec(2, [JOB, mode, path], timeout=120)
    assert run.returncode != 0
    assert checkpoint.latest(str(tmp_path)) == path
    model = make_model()
    assert checkpoint.load(path, model)["step"] == 2     # the first save, intact
    leftovers = [n for n in os.listdir(tmp_path) if ".tmp-" in n]
    assert len(leftovers) <= 1                            # the aborted save's temporary file
    checkpoint.save(str(tmp_path / "later.h5"), model)    # removes it: its writer is dead
    assert sorted(os.listdir(tmp_path)) == ["ck.h5", "later.h5"]


@pytest.mark.timeout(300)
def test_full_disk_during_save_is_an_error_and_keeps_last_checkpoint(tmp_path):
    """A file-size limit stands in for a full disk: writes past it fail with EFBIG."""
    path = str(tmp_path / "ck.h5")
    limit = 8 * 2**20

    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    run = mpiexec(2, [JOB, "grow", path, "32"], timeout=120, preexec_fn=limit_file_size)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "save failed: saving checkpoint" in run.stdout
    assert "File too large" in run.stdout or "too large" in run.stdout.lower(), run.stdout
    assert "rank 0 loaded step 1" in run.stdout and "rank 1 loaded step 1" in run.stdout
    assert [n for n in os.listdir(tmp_path) if ".tmp-" in n] == []


@pytest.mark.timeout(300)
def test_a_folder_that_other_nodes_do_not_see_is_an_error_on_every_rank(simulated_nodes):
    """Each simulated node has a /tmp of its own: ranks 2 and 3 (the second node) cannot see
    the file rank 0 creates there: the save fails on every rank, naming them."""
    folder = f"/tmp/tensorplay-node-local-{uuid.uuid4().hex[:8]}"
    run = mpiexec(4, [JOB, "save", f"{folder}/ck.h5", "1"], nodes=simulated_nodes, timeout=120)
    assert run.returncode != 0
    output = run.stdout + run.stderr
    assert "failed on 2 of 4 ranks: rank 2: FileNotFoundError" in output, output[-3000:]
    assert "rank 3: FileNotFoundError" in output
    assert "not on a file system that every rank shares" in output
    assert not os.path.exists(folder)       # this machine's /tmp is neither node's
