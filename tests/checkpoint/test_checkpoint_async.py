"""Checkpoints saved in the background: the file equals a blocking save's, whatever training
does meanwhile; errors on one rank reach every rank; saves in a row; the deferred write below
MPI_THREAD_MULTIPLE; closing the writer; the main thread's Python collectives during a write."""
import faulthandler
import json
import os
import time

import h5py
import pytest
import torch
from mpi4py import MPI

from tensorplay_hpc import checkpoint
from tensorplay_hpc.checkpoint import background
from tensorplay_hpc.checkpoint import format as fmt
from tensorplay_hpc.distributed.algorithms.model_averaging import averagers
from tensorplay_hpc.distributed.optim import PostLocalSGDOptimizer, ZeroRedundancyOptimizer

WORLD = MPI.COMM_WORLD

KINDS = {
    "local": lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
    "zero": lambda m: ZeroRedundancyOptimizer(m.parameters(), torch.optim.AdamW, lr=0.01),
    "postlocal": lambda m: PostLocalSGDOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
        averagers.PeriodicModelAverager(period=2, warmup_steps=1)),
}


def make_model(seed=0):
    torch.manual_seed(seed)
    # 0.weight (300 x 200 float32, 240,000 bytes) gets a dataset of its own; the rest is packed.
    return torch.nn.Sequential(torch.nn.Linear(200, 300), torch.nn.Tanh(),
                               torch.nn.BatchNorm1d(300), torch.nn.Linear(300, 3))


def train(model, optimizer, start, steps):
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(8, 200, generator=g), torch.randn(8, 3, generator=g)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def contents(path):
    """Every dataset's raw bytes and every attribute of the file but the creation time (and
    the metadata checksums, which cover it)."""
    found = {}
    with h5py.File(path, "r") as f:
        found["/"] = {k: v for k, v in f.attrs.items() if k not in ("created", "metadata_crc32")}

        def visit(name, node):
            if isinstance(node, h5py.Dataset):
                found[name] = (node.dtype.str, node.shape, node[()].tobytes())
        f.visititems(visit)
    return found


def state(model, optimizer):
    """Copies of the model's entries and this rank's optimizer state tensors."""
    inner = optimizer.optim if hasattr(optimizer, "optim") else optimizer
    tensors = [t.clone() for t in model.state_dict().values()]
    for entry in inner.state.values():
        tensors += [v.clone() for _, v in sorted(entry.items()) if torch.is_tensor(v)]
    return tensors


@pytest.mark.parametrize("kind", list(KINDS))
def test_background_save_writes_the_blocking_save_file_while_training_goes_on(folder, kind):
    model = make_model()
    optimizer = KINDS[kind](model)
    train(model, optimizer, 0, 3)
    extra = {"step": 3, "rank": WORLD.Get_rank(), "noise": torch.arange(5.0) * WORLD.Get_rank()}
    blocking = checkpoint.save(os.path.join(folder, "blocking.h5"), model, optimizer, extra=extra)
    saved = state(model, optimizer)
    with checkpoint.AsyncCheckpointer() as checkpointer:
        handle = checkpointer.save(os.path.join(folder, "async.h5"), model, optimizer,
                                   extra=extra)
        train(model, optimizer, 3, 2)               # changes every tensor saved, in place
        extra["noise"].add_(1.0)
        assert handle.wait() == os.path.join(folder, "async.h5")
        assert handle.done() and handle.write_seconds > 0 and handle.stall_seconds > 0
    if WORLD.Get_rank() == 0:
        ours, theirs = contents(handle.path), contents(blocking)
        assert sorted(ours) == sorted(theirs)
        assert "model/0.weight" in ours and "packed/float32" in ours
        for name in theirs:
            assert ours[name] == theirs[name], name
    WORLD.Barrier()
    resumed = make_model(seed=5)
    again = KINDS[kind](resumed)
    train(resumed, again, 0, 1)
    loaded = checkpoint.load(handle.path, resumed, again)
    assert loaded["step"] == 3 and loaded["rank"] == WORLD.Get_rank()
    assert torch.equal(loaded["noise"], torch.arange(5.0) * WORLD.Get_rank())
    assert all(torch.equal(a, b) for a, b in zip(saved, state(resumed, again)))


def test_saves_in_a_row_reuse_the_host_buffers_and_keep_the_newest(folder):
    model = make_model()
    optimizer = KINDS["zero"](model)
    train(model, optimizer, 0, 1)
    handles = []
    for step in range(1, 4):
        handles.append(checkpoint.save_async(os.path.join(folder, f"step-{step}.h5"), model,
                                             optimizer, extra={"step": step}, keep=2))
        if step > 1:
            assert handles[-2].done()                        # the new save waited for it
        sizes = WORLD.allgather(checkpoint.async_checkpointer().host_bytes)
        train(model, optimizer, step, 1)
        # The model's 62,403 float32 values and one int64 counter, AdamW's 2 x 61,803 float32
        # moments and 6 float32 step counters, split between the ranks.
        assert sum(sizes) == (62_403 + 2 * 61_803 + 6) * 4 + 8 == 744_068
    assert handles[-1].wait().endswith("step-3.h5")
    checkpoint.close_async()
    assert checkpoint.async_checkpointer() is None
    names = sorted(n for n in os.listdir(folder) if n.endswith(".h5"))
    assert names == ["step-2.h5", "step-3.h5"]
    assert checkpoint.latest(folder) == handles[-1].path
    fresh = make_model(seed=3)
    assert checkpoint.load(handles[1].path, fresh)["step"] == 2


@pytest.mark.mpi(min_size=2)
def test_a_write_failing_on_one_rank_raises_the_same_error_on_every_rank(folder, monkeypatch):
    model = make_model()
    optimizer = KINDS["zero"](model)
    path = os.path.join(folder, "last.h5")
    size, bad = WORLD.Get_size(), WORLD.Get_size() - 1
    with checkpoint.AsyncCheckpointer() as checkpointer:
        assert checkpointer.save(path, model, optimizer, extra={"step": 1}).wait() == path
        before = open(path, "rb").read() if WORLD.Get_rank() == 0 else None
        if WORLD.Get_rank() == bad:
            def fail(*args, **kwargs):
                raise OSError(28, "No space left on device")
            monkeypatch.setattr("tensorplay_hpc.checkpoint.writer.write_own", fail)
        handle = checkpointer.save(path, model, optimizer, extra={"step": 2})
        train(model, optimizer, 0, 1)
        with pytest.raises(checkpoint.CheckpointError) as raised:
            handle.wait()
        message = str(raised.value)
        assert message == (f"saving checkpoint {path} failed on 1 of {size} ranks: rank {bad}: "
                           "OSError: [Errno 28] No space left on device")
        assert WORLD.allgather(message) == [message] * size
        monkeypatch.undo()
        # The failure was reported: the next save does not raise it again, and succeeds.
        assert checkpointer.save(path, model, optimizer, extra={"step": 3}).wait() == path
    if WORLD.Get_rank() == 0:
        assert open(path, "rb").read() != before
        assert [n for n in os.listdir(folder) if ".tmp-" in n] == []
    assert checkpoint.load(path, make_model(seed=4))["step"] == 3


def test_an_unreported_failure_is_raised_by_the_next_save_and_bad_arguments_by_wait(folder):
    model = make_model()
    path = os.path.join(folder, "ck.h5")
    with checkpoint.AsyncCheckpointer() as checkpointer:
        checkpointer.save(path, model, extra={"step": 1}, keep=0)
        with pytest.raises(checkpoint.CheckpointError,
                           match=f"failed on {WORLD.Get_size()} of {WORLD.Get_size()} ranks: "
                                 "rank 0: ValueError: keep must be at least 1, got 0"):
            checkpointer.save(path, model, extra={"step": 2})
        assert checkpointer.wait() is None                   # nothing in flight
        assert checkpointer.save(path, model, extra={"step": 3}).wait() == path
    assert checkpoint.load(path, make_model(seed=1))["step"] == 3


def test_below_thread_multiple_the_write_runs_in_wait(folder, monkeypatch):
    monkeypatch.setattr(background, "ranks_below_multiple", lambda comm: [0])
    model = make_model()
    optimizer = KINDS["local"](model)
    train(model, optimizer, 0, 2)
    blocking = checkpoint.save(os.path.join(folder, "blocking.h5"), model, optimizer)
    with checkpoint.AsyncCheckpointer() as checkpointer:
        assert not checkpointer.threaded
        handle = checkpointer.save(os.path.join(folder, "deferred.h5"), model, optimizer)
        train(model, optimizer, 2, 1)
        assert not handle.done() and not os.path.exists(handle.path)
        WORLD.Barrier()
        assert handle.wait() == handle.path and handle.done()
    if WORLD.Get_rank() == 0:
        assert contents(handle.path) == contents(blocking)
    WORLD.Barrier()


def test_a_closed_checkpointer_refuses_to_save(folder):
    checkpointer = checkpoint.AsyncCheckpointer()
    handle = checkpointer.save(os.path.join(folder, "ck.h5"), make_model(), extra={"step": 7})
    checkpointer.close()                    # waits for the save in flight
    assert handle.done() and os.path.exists(handle.path)
    checkpointer.close()                    # a second close does nothing
    with pytest.raises(RuntimeError, match=r"checkpoint.AsyncCheckpointer is closed: close\(\) "
                                           "freed its private communicator"):
        checkpointer.save(os.path.join(folder, "again.h5"), make_model())
    assert checkpoint.load(handle.path, make_model(seed=2))["step"] == 7


def test_a_blocking_save_lets_the_background_write_finish_first(folder):
    """Saves complete in the order they were made: a blocking save waits for the one in the
    background."""
    model = make_model()
    optimizer = KINDS["zero"](model)
    train(model, optimizer, 0, 1)
    handle = checkpoint.save_async(os.path.join(folder, "background.h5"), model, optimizer,
                                   extra={"step": 1})
    blocking = checkpoint.save(os.path.join(folder, "blocking.h5"), model, optimizer,
                               extra={"step": 1})
    assert handle.done() == checkpoint.async_checkpointer().threaded   # joined
    assert handle.wait() == os.path.join(folder, "background.h5")
    checkpoint.close_async()
    if WORLD.Get_rank() == 0:
        assert contents(handle.path) == contents(blocking)
    WORLD.Barrier()


@pytest.mark.timeout(180)
@pytest.mark.skipif(MPI.Query_thread() < MPI.THREAD_MULTIPLE, reason="writes in the background")
def test_the_main_thread_runs_collectives_that_keep_pythons_lock_during_a_background_write(
        folder):
    """mpi4py's first lower-case collective on a communicator keeps Python's lock while it
    waits (it duplicates the communicator). On the main thread during a background write it
    would wait forever for a rank whose writer thread kept the lock while waiting for other
    ranks (as collective h5py calls do), or was creating a communicator (Open MPI creates them
    one at a time per process): the writer does neither. A deadlock holds the lock
    pytest-timeout's thread needs: faulthandler's, which runs without it, ends the process
    instead (mpiexec then ends the job)."""
    model = make_model()
    optimizer = KINDS["zero"](model)
    train(model, optimizer, 0, 1)
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    path = os.path.join(folder, "during.h5")
    sums = []
    faulthandler.dump_traceback_later(60, exit=True)
    try:
        with checkpoint.AsyncCheckpointer() as checkpointer:
            assert checkpointer.threaded
            for save in range(4):
                handle = checkpointer.save(path, model, optimizer, extra={"step": save})
                for i in range(25):
                    fresh = WORLD.Dup()
                    sums.append(fresh.allreduce(rank + i))      # the first: a Comm_dup, locked
                    sums.append(fresh.bcast(f"{save}.{i}" if rank == 0 else None))
                    fresh.Free()
                    time.sleep(0.002 * rank)
                assert handle.wait() == path
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert sums == [value for save in range(4) for i in range(25)
                    for value in (size * (size - 1) // 2 + size * i, f"{save}.{i}")]
    if rank == 0:
        with h5py.File(path, "r") as f:                   # serial h5py reads it
            assert f.attrs["format_version"] == 5 and f.attrs["step"] == 3
            names = json.loads(f["catalog"][()].tobytes())["names"]
            columns = f["catalog_columns"][()]
            weight = torch.from_numpy(f["model/0.weight"][()])
            assert torch.equal(weight, model[0].weight.detach())
            offset = int(columns[names.index("model/3.bias"), 0])
            assert torch.equal(torch.from_numpy(f["packed/float32"][offset:offset + 3]),
                               model[3].bias.detach())
            assert fmt.checksum(f["model/0.weight"][()]) == int(
                columns[names.index("model/0.weight"), 3])
    WORLD.Barrier()
    fresh_model = make_model(seed=7)
    assert checkpoint.load(path, fresh_model)["step"] == 3
    assert all(torch.equal(a, b) for a, b in zip(fresh_model.state_dict().values(),
                                                 model.state_dict().values()))
