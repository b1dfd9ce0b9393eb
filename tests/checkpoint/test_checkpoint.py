"""Checkpoints: round trips for each optimizer, continuing equals an uninterrupted run, the
file format, export/import with plain torch, bad input, failed saves."""
import errno
import json
import os
import re
import resource
import zlib

import h5py
import numpy as np
import pytest
import torch
from mpi4py import MPI

from tensorplay_hpc import checkpoint
from tensorplay_hpc.checkpoint import format as fmt
from tensorplay_hpc.checkpoint import cli
from tensorplay_hpc.distributed.algorithms.model_averaging import averagers
from tensorplay_hpc.distributed.optim import PostLocalSGDOptimizer, ZeroRedundancyOptimizer
from tensorplay_hpc.distributed.parallel import DistributedDataParallel

WORLD = MPI.COMM_WORLD


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.BatchNorm1d(10),
                               torch.nn.Linear(10, 3))


def batch(step):
    """The same data on every rank, so replicas stay equal without gradient averaging."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def train(model, optimizer, steps, start=0):
    for step in range(start, start + steps):
        x, y = batch(step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def params(model):
    return [p.detach().clone() for p in fmt.unwrap_model(model).state_dict().values()]


KINDS = {
    "local": lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
    "zero": lambda m: ZeroRedundancyOptimizer(m.parameters(), torch.optim.Adam, lr=0.01),
    "zero-bucket": lambda m: ZeroRedundancyOptimizer(m.parameters(), torch.optim.AdamW, lr=0.01,
                                                    parameters_as_bucket_view=True),
    "postlocal": lambda m: PostLocalSGDOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
        averagers.PeriodicModelAverager(period=2, warmup_steps=1)),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_continue_after_load_equals_uninterrupted_run(folder, kind):
    reference = make_model()
    train(reference, KINDS[kind](reference), 8)

    model = make_model()
    optimizer = KINDS[kind](model)
    train(model, optimizer, 5)
    path = checkpoint.save(os.path.join(folder, f"{kind}.h5"), model, optimizer,
                           extra={"step": 5})

    resumed = make_model(seed=7)                       # different start values
    optimizer = KINDS[kind](resumed)
    extra = checkpoint.load(path, resumed, optimizer)
    assert extra["step"] == 5
    if kind == "postlocal":
        assert optimizer.averager.step == 5
    train(resumed, optimizer, 3, start=5)
    for a, b in zip(params(reference), params(resumed)):
        assert torch.equal(a, b)                       # bit-exact at the same world size


def test_zero_state_is_consolidated_in_pytorch_structure(folder):
    model = make_model()
    optimizer = KINDS["zero"](model)
    train(model, optimizer, 3)
    path = checkpoint.save(os.path.join(folder, "zero.h5"), model, optimizer)
    optimizer.consolidate_state_dict(to=0)
    if WORLD.Get_rank() == 0:
        expected = optimizer.state_dict()
        exported = os.path.join(folder, "zero.pt")
        cli.export(path, exported)
        saved = torch.load(exported, weights_only=True)
        assert saved["optimizer"]["param_groups"] == expected["param_groups"]
        assert sorted(saved["optimizer"]["state"]) == sorted(expected["state"])
        for index, state in expected["state"].items():
            for key, value in state.items():
                assert torch.equal(saved["optimizer"]["state"][index][key], value)
        # ... and a plain torch optimizer loads it and steps like the ZeRO one.
        plain_model = make_model(seed=3)
        plain_model.load_state_dict(saved["model"])
        plain = torch.optim.Adam(plain_model.parameters(), lr=0.5)
        plain.load_state_dict(saved["optimizer"])
        assert plain.param_groups[0]["lr"] == 0.01
        train(plain_model, plain, 2, start=3)
        zero_copy = make_model(seed=3)
        zero_copy.load_state_dict(saved["model"])
        local = torch.optim.Adam(zero_copy.parameters(), lr=0.01)
        local.load_state_dict(expected)
        train(zero_copy, local, 2, start=3)
        for a, b in zip(params(plain_model), params(zero_copy)):
            assert torch.equal(a, b)
    WORLD.Barrier()


def test_import_from_plain_torch_then_load_into_zero(folder):
    model = make_model()
    plain = torch.optim.Adam(model.parameters(), lr=0.02)
    train(model, plain, 4)
    source = os.path.join(folder, "plain.pt")
    target = os.path.join(folder, "imported.h5")
    if WORLD.Get_rank() == 0:
        torch.save({"model": model.state_dict(), "optimizer": plain.state_dict()}, source)
        cli.import_(source, target, "torch.optim.adam.Adam")
    WORLD.Barrier()
    resumed = make_model(seed=9)
    zero = ZeroRedundancyOptimizer(resumed.parameters(), torch.optim.Adam, lr=0.5)
    checkpoint.load(target, resumed, zero)
    assert zero.param_groups[0]["lr"] == 0.02
    train(model, plain, 2, start=4)
    train(resumed, zero, 2, start=4)
    for a, b in zip(params(model), params(resumed)):
        assert torch.equal(a, b)


def test_ddp_wrapped_model_and_extras(folder):
    model = DistributedDataParallel(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train(model, optimizer, 2)
    rng = torch.get_rng_state()
    extra = {"epoch": 3, "position": (17, 4), "nested": {"a": [1, 2.5, None]},
             "rng": rng, "array": np.arange(5, dtype=np.int32) * WORLD.Get_rank(),
             "name": f"rank{WORLD.Get_rank()}", "generator": np.random.default_rng(5).bit_generator.state}
    path = checkpoint.save(os.path.join(folder, "ddp.h5"), model, optimizer, extra=extra)
    other = DistributedDataParallel(make_model(seed=4))
    loaded = checkpoint.load(path, other, torch.optim.SGD(other.parameters(), lr=0.1))
    assert loaded["epoch"] == 3 and loaded["position"] == (17, 4)
    assert loaded["nested"] == {"a": [1, 2.5, None]}
    assert torch.equal(loaded["rng"], rng)
    assert loaded["array"].tolist() == [i * WORLD.Get_rank() for i in range(5)]
    assert loaded["name"] == f"rank{WORLD.Get_rank()}"
    assert loaded["generator"] == extra["generator"]
    for a, b in zip(params(model), params(other)):
        assert torch.equal(a, b)


def test_file_format_is_plain_hdf5(folder):
    """Serial h5py and json alone find every tensor: a large one in its own dataset, small ones
    back to back in their dtype's packed dataset, each with its dtype and checksum."""
    model = torch.nn.Sequential(torch.nn.Linear(200, 200), torch.nn.Tanh(), torch.nn.Linear(200, 3))
    model[0].weight.data = model[0].weight.data.to(torch.bfloat16)     # 80,000 bytes
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    path = checkpoint.save(os.path.join(folder, "format.h5"), model, optimizer,
                           extra={"step": 12})
    if WORLD.Get_rank() == 0:
        with h5py.File(path, "r") as f:      # serial h5py, no MPI
            assert f.attrs["format"] == fmt.FORMAT
            assert f.attrs["format_version"] == fmt.FORMAT_VERSION == 5
            assert f.attrs["world_size"] == WORLD.Get_size()
            assert json.loads(f.attrs["replicas"]) == [list(range(WORLD.Get_size()))]
            assert f.attrs["step"] == 12
            assert f.attrs["torch_version"] == torch.__version__
            catalog = json.loads(f["catalog"][()].tobytes())
            columns, sizes = f["catalog_columns"][()], f["catalog_shapes"][()]
            names, dtypes = catalog["names"], catalog["dtypes"]
            assert columns.dtype == sizes.dtype == np.int64 and columns.shape == (len(names), 5)
            assert sorted(n[len("model/"):] for n in names if n.startswith("model/")) == sorted(
                model.state_dict())
            starts = np.cumsum(columns[:, 4]) - columns[:, 4]
            tensors = {name: (offset, tuple(sizes[start:start + ndim]), numel, dtypes[code], crc)
                       for name, (offset, numel, code, crc, ndim), start
                       in zip(names, columns.tolist(), starts.tolist())}
            assert tensors["model/0.weight"] == (
                -1, (200, 200), 40_000, "bfloat16",
                fmt.checksum(model[0].weight.data.view(torch.int16).numpy()))
            weight = f["model/0.weight"]
            assert weight.dtype == np.int16
            assert torch.equal(torch.from_numpy(weight[()]).view(torch.bfloat16), model[0].weight.data)
            packed = {name: entry for name, entry in tensors.items() if entry[0] >= 0}
            assert "model/2.bias" in packed and "model/0.bias" in packed
            for name, (offset, shape, numel, dtype, crc) in packed.items():
                assert numel == int(np.prod(shape))
                values = f[f"packed/{dtype}"][offset:offset + numel]
                assert fmt.checksum(values) == crc
            offset = tensors["model/2.bias"][0]
            assert torch.equal(torch.from_numpy(f["packed/float32"][offset:offset + 3]),
                               model[2].bias.data)
            assert sorted(f["packed"]) == ["float32"]
            assert catalog["attributes"]["optimizer"]["class"] == "torch.optim.sgd.SGD"
        assert checkpoint.latest(folder) == path
    WORLD.Barrier()


def test_checksum_taken_in_pieces_is_the_crc32_of_the_whole():
    data = np.random.default_rng(0).integers(0, 256, 3 * fmt.CHECKSUM_PIECE_BYTES + 5,
                                             dtype=np.uint8)
    assert fmt.checksum(data[:-5].view(np.float32)) == zlib.crc32(data[:-5].tobytes())
    assert fmt.checksum(data) == zlib.crc32(data.tobytes())
    assert fmt.checksum(data[:0]) == 0


def test_keep_prunes_older_checkpoints(folder):
    model = make_model()
    for step in range(4):
        checkpoint.save(os.path.join(folder, f"step{step}.h5"), model, extra={"step": step}, keep=2)
    WORLD.Barrier()
    names = sorted(n for n in os.listdir(folder) if n.endswith(".h5"))
    assert names == ["step2.h5", "step3.h5"]
    assert checkpoint.latest(folder).endswith("step3.h5")


def test_failed_save_leaves_previous_checkpoint(folder, monkeypatch):
    model = make_model()
    path = os.path.join(folder, "last.h5")
    checkpoint.save(path, model, extra={"step": 1})
    before = open(path, "rb").read() if WORLD.Get_rank() == 0 else None
    bad_rank = WORLD.Get_size() - 1
    if WORLD.Get_rank() == bad_rank:
        def fail(*args, **kwargs):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr("tensorplay_hpc.checkpoint.writer.write_own", fail)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    with pytest.raises(checkpoint.CheckpointError, match=f"rank {bad_rank}: OSError.*No space"):
        checkpoint.save(path, model, extra={"step": 2})
    WORLD.Barrier()
    if WORLD.Get_rank() == 0:
        assert open(path, "rb").read() == before
        assert [n for n in os.listdir(folder) if ".tmp-" in n] == []
    fresh = make_model(seed=5)
    assert checkpoint.load(path, fresh)["step"] == 1
    assert torch.equal(fresh[0].weight, make_model()[0].weight)


def test_a_layout_failing_on_rank_0_is_the_same_error_on_every_rank(folder, monkeypatch):
    """Rank 0 alone creates the file's datasets: its failure reaches every rank, which then
    writes nothing."""
    model = make_model()
    path = os.path.join(folder, "last.h5")
    checkpoint.save(path, model, extra={"step": 1})
    before = open(path, "rb").read() if WORLD.Get_rank() == 0 else None
    written = []

    def fail(*args):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr("tensorplay_hpc.checkpoint.writer.lay_out", fail)
    monkeypatch.setattr("tensorplay_hpc.checkpoint.writer.write_own",
                        lambda *args: written.append(args))
    with pytest.raises(checkpoint.CheckpointError) as raised:
        checkpoint.save(path, model, extra={"step": 2})
    assert str(raised.value) == (f"saving checkpoint {path} failed on 1 of {WORLD.Get_size()} "
                                 "ranks: rank 0: OSError: [Errno 28] No space left on device")
    assert written == []
    WORLD.Barrier()
    if WORLD.Get_rank() == 0:
        assert open(path, "rb").read() == before
        assert [n for n in os.listdir(folder) if ".tmp-" in n] == []
    assert checkpoint.load(path, make_model(seed=5))["step"] == 1


@pytest.mark.mpi(min_size=2)
def test_a_write_cut_short_on_one_rank_is_the_same_error_on_every_rank(folder, monkeypatch):
    """A file-size limit on the last rank stands in for a disk that fills up after the space
    check: its write is cut short, which each MPI library reports its own way (a short count,
    an exception), and which reaches every rank as the system's error naming the bytes
    written."""
    model = make_model()
    path = os.path.join(folder, "last.h5")
    checkpoint.save(path, model, extra={"step": 1})
    before = open(path, "rb").read() if WORLD.Get_rank() == 0 else None
    monkeypatch.setattr("tensorplay_hpc.checkpoint.files.check_space", lambda *args: None)
    last = WORLD.Get_size() - 1
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    if WORLD.Get_rank() == last:
        resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, limits[1]))
    try:   # every rank's extra is 1 MiB of its own: the file's end lies past 2 MiB
        with pytest.raises(checkpoint.CheckpointError) as raised:
            checkpoint.save(path, model, extra={"step": 2, "pad": torch.ones(2**18)})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    _assert_short_write_left_the_file(raised.value, path, before, last, r"\d+",
                                      errno.EFBIG)


def test_a_failed_write_of_the_checksums_is_the_same_error_on_every_rank(folder, monkeypatch):
    """Rank 0 writes the catalog's checksums last, after every rank's data: a failure there
    still reaches every rank, and the previous checkpoint stays as it was."""
    model = make_model()
    path = os.path.join(folder, "columns.h5")
    checkpoint.save(path, model, extra={"step": 1})
    before = open(path, "rb").read() if WORLD.Get_rank() == 0 else None
    calls = []

    def eight_bytes_then_none(fd, data, at):
        calls.append(at)
        return 8 if len(calls) == 1 else 0
    monkeypatch.setattr("tensorplay_hpc.checkpoint.writer.os.pwrite", eight_bytes_then_none)
    with pytest.raises(checkpoint.CheckpointError) as raised:
        checkpoint.save(path, model, extra={"step": 2})
    if WORLD.Get_rank() == 0:
        assert calls[1] == calls[0] + 8        # the rest was tried once more, then given up
    _assert_short_write_left_the_file(raised.value, path, before, 0, "8", errno.ENOSPC)


def test_each_rank_syncs_its_own_writes_and_a_failed_sync_is_an_error_everywhere(folder,
                                                                                 monkeypatch):
    """On a parallel file system a node's writes are durable only once that node syncs them:
    every rank ``fsync``s the temporary file after its writes, before the commit (where rank 0
    syncs it again, then the folder). A sync that fails (an I/O error) fails the save on every
    rank and leaves the previous checkpoint."""
    model = make_model()
    path = os.path.join(folder, "synced.h5")
    synced, real_fsync = [], os.fsync

    def record(fd):
        synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)
    monkeypatch.setattr("tensorplay_hpc.checkpoint.writer.os.fsync", record)
    checkpoint.save(path, model, extra={"step": 1, "mine": torch.ones(4)})   # data on every rank
    temporary = synced[0]
    assert temporary.startswith("synced.h5.tmp-")
    assert synced == ([temporary, temporary, os.path.basename(folder)] if WORLD.Get_rank() == 0
                      else [temporary])
    before = open(path, "rb").read() if WORLD.Get_rank() == 0 else None
    last = WORLD.Get_size() - 1
    if WORLD.Get_rank() == last:
        def fail(fd):
            raise OSError(5, "Input/output error")
        monkeypatch.setattr("tensorplay_hpc.checkpoint.writer.os.fsync", fail)
    with pytest.raises(checkpoint.CheckpointError) as raised:
        checkpoint.save(path, model, extra={"step": 2, "mine": torch.ones(4)})
    monkeypatch.undo()
    _assert_failure_left_the_file(raised.value, path, before, last,
                                  re.escape("OSError: [Errno 5] Input/output error"))


def _assert_short_write_left_the_file(error, path, before, rank, written, number):
    """``error`` reports a write cut short on ``rank`` by the system's error ``number`` after
    ``written`` bytes (a regex); see :func:`_assert_failure_left_the_file`. Collective."""
    _assert_failure_left_the_file(
        error, path, before, rank,
        re.escape(f"OSError: [Errno {number}] {os.strerror(number)}: ") +
        f"wrote {written} of \\d+ bytes at byte \\d+ of the file")


def _assert_failure_left_the_file(error, path, before, rank, failure):
    """``error`` reports ``failure`` (a regex) on ``rank`` alone, and the save left the
    checkpoint at ``path`` as it was (``before``, rank 0's bytes), with no temporary file, and
    loadable (its step is 1). Collective."""
    assert re.fullmatch(f"saving checkpoint {path} failed on 1 of {WORLD.Get_size()} ranks: "
                        f"rank {rank}: {failure}", str(error)), str(error)
    WORLD.Barrier()
    if WORLD.Get_rank() == 0:
        assert open(path, "rb").read() == before
        assert [n for n in os.listdir(os.path.dirname(path)) if ".tmp-" in n] == []
    assert checkpoint.load(path, make_model(seed=5))["step"] == 1


def corrupt(path, name, offset=0):
    """Flip the bits of byte ``offset`` of tensor ``name``'s values in the file."""
    with checkpoint.Reader(path) as reader:
        dataset, first = reader.catalog.entry(name)[:2]
        values = reader.file[dataset]
        where = values.id.get_offset() + (first or 0) * values.dtype.itemsize
    with open(path, "r+b") as raw:
        raw.seek(where + offset)
        byte = raw.read(1)
        raw.seek(where + offset)
        raw.write(bytes([byte[0] ^ 0xFF]))


def test_bad_checkpoints_give_clear_errors(folder):
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters())
    train(model, optimizer, 1)
    good = checkpoint.save(os.path.join(folder, "good.h5"), model, optimizer)
    paths = {name: os.path.join(folder, f"{name}.h5") for name in
             ("truncated", "corrupted", "foreign")}
    if WORLD.Get_rank() == 0:
        data = open(good, "rb").read()
        open(paths["truncated"], "wb").write(data[:len(data) // 3])
        open(paths["corrupted"], "wb").write(data)
        corrupt(paths["corrupted"], "model/0.weight", 5)
        with h5py.File(paths["foreign"], "w") as f:
            f["x"] = np.zeros(3)
    WORLD.Barrier()
    cases = [
        (os.path.join(folder, "missing.h5"), model, None, "no such checkpoint file"),
        (paths["truncated"], model, None, "truncated"),
        (paths["corrupted"], model, None, "checksum mismatch in dataset 'model/0.weight'"),
        (paths["foreign"], model, None, "not a tensorplay_hpc checkpoint"),
        (good, torch.nn.Linear(6, 10), None, "model does not match"),
        (good, torch.nn.Sequential(torch.nn.Linear(6, 11), torch.nn.Tanh(), torch.nn.BatchNorm1d(11),
                                   torch.nn.Linear(11, 3)), None, "has shape"),
        (good, None, torch.optim.SGD(model.parameters(), lr=0.1),
         "holds torch.optim.adam.Adam state, the optimizer is torch.optim.sgd.SGD"),
    ]
    n = WORLD.Get_size()
    for path, m, opt, message in cases:
        with pytest.raises(checkpoint.CheckpointError, match=message) as raised:
            checkpoint.load(path, m, opt)
        # A damaged dataset is found by the one rank that reads it (the largest entry: rank 0).
        failed = f"1 of {n} ranks: rank 0: " if path == paths["corrupted"] else f"{n} of {n} ranks"
        assert f"failed on {failed}" in str(raised.value)
    # A bad file among good ones is skipped when looking for the newest.
    assert checkpoint.latest(folder) == good


# -- who reads what: bytes read per rank, replicas -----------------------------------------------

class Four(torch.nn.Module):
    """Four float32 parameters of 100 values: 400 bytes each, and 804 bytes of Adam state each
    (exp_avg, exp_avg_sq and a 4-byte step) after one step."""

    def __init__(self, offset=0.0):
        super().__init__()
        self.p = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.full((100,), i + offset)) for i in range(4)])


def adam_step(model, gradient=1.0, optimizer_class=torch.optim.Adam):
    optimizer = optimizer_class(model.parameters(), lr=0.01)
    for i, p in enumerate(model.parameters()):
        p.grad = torch.full_like(p, gradient * (i + 1))
    optimizer.step()
    return optimizer


def bytes_read_loading(path, model, optimizer, replica_group=None):
    """Load as ``checkpoint.load`` does; every rank's count of dataset bytes it read."""
    from tensorplay_hpc.checkpoint import restore
    from tensorplay_hpc.checkpoint.replicas import Replicas
    replicas = Replicas(WORLD, replica_group)
    with checkpoint.Reader(path) as reader:
        restore.load_into(reader, WORLD, replicas, model, optimizer)
        return WORLD.allgather(reader.bytes_read)


def state_tensors(optimizer):
    """The tensor state, by parameter index and key."""
    state = optimizer.state_dict()["state"]
    return [state[i][k] for i in sorted(state) for k in sorted(state[i])]


def test_replicated_entries_are_read_once_in_total(folder):
    model = Four()
    optimizer = adam_step(model)
    path = checkpoint.save(os.path.join(folder, "read-once.h5"), model, optimizer)
    resumed = Four(offset=5.0)
    again = adam_step(resumed, gradient=3.0)
    counts = bytes_read_loading(path, resumed, again)
    # 4 x 400 model bytes + 4 x 804 state bytes = 4816, split by bytes between the ranks.
    assert counts == {1: [4816], 2: [2408, 2408], 4: [1204] * 4}[WORLD.Get_size()]
    assert all(torch.equal(a, b) for a, b in zip(params(model), params(resumed)))
    assert all(torch.equal(a, b) for a, b in zip(state_tensors(optimizer), state_tensors(again)))


def test_sharded_state_is_read_only_by_its_owner(folder):
    model = Four()
    optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
    for i, p in enumerate(model.parameters()):
        p.grad = torch.full_like(p, i + 1.0)
    optimizer.step()
    path = checkpoint.save(os.path.join(folder, "sharded.h5"), model, optimizer)
    resumed = Four(offset=5.0)
    again = ZeroRedundancyOptimizer(resumed.parameters(), torch.optim.Adam, lr=0.01)
    counts = bytes_read_loading(path, resumed, again)
    n = WORLD.Get_size()
    owned = [again.partition.rank_of.count(r) for r in range(n)]
    assert owned == {1: [4], 2: [2, 2], 4: [1] * 4}[n]
    # The model's 1600 bytes split between the ranks, plus 804 bytes per parameter owned.
    assert counts == {1: [4816], 2: [2408, 2408], 4: [1204] * 4}[n]
    assert all(torch.equal(a, b) for a, b in zip(params(model), params(resumed)))
    assert all(torch.equal(a, b) for a, b in zip(state_tensors(optimizer.optim),
                                                 state_tensors(again.optim)))


def test_each_replica_resumes_its_own_copy_and_other_layouts_their_average(folder):
    n, rank = WORLD.Get_size(), WORLD.Get_rank()
    color = rank * 2 // n                    # replicas [0] | [0], [1] | [0, 1], [2, 3]
    replica = WORLD.Split(color, rank)
    model = Four(offset=10.0 * color)
    optimizer = adam_step(model, gradient=1.0 + color)
    path = checkpoint.save(os.path.join(folder, "replicas.h5"), model, optimizer,
                           replica_group=replica)
    with checkpoint.Reader(path) as reader:
        groups = [[0]] if n == 1 else [list(range(n // 2)), list(range(n // 2, n))]
        assert json.loads(reader.attribute("", "replicas")) == groups
        assert reader.has("replica1/model/p.0") == (n > 1) and reader.has("model/p.0") == (n == 1)

    own = Four(offset=-1.0)
    own_optimizer = adam_step(own, gradient=7.0)
    counts = bytes_read_loading(path, own, own_optimizer, replica)
    # each replica's 4816 bytes, split between the ranks holding it
    assert counts == {1: [4816], 2: [4816, 4816], 4: [2408] * 4}[n]
    assert all(torch.equal(a, b) for a, b in zip(params(model), params(own)))
    assert all(torch.equal(a, b) for a, b in zip(state_tensors(optimizer),
                                                 state_tensors(own_optimizer)))

    averaged = Four(offset=-1.0)
    averaged_optimizer = adam_step(averaged, gradient=7.0)
    counts = bytes_read_loading(path, averaged, averaged_optimizer)   # one group: another layout
    assert counts == {1: [4816], 2: [4816, 4816], 4: [2408] * 4}[n]
    copies = WORLD.allgather((params(model), state_tensors(optimizer)))
    first, last = copies[0], copies[-1]      # one rank of each replica
    for mine, a, b in zip(params(averaged) + state_tensors(averaged_optimizer),
                          first[0] + first[1], last[0] + last[1]):
        expected = ((a.double() + b.double()) / 2).to(a.dtype)
        assert torch.equal(mine, expected)
    if n > 1:
        assert params(averaged)[0][0].item() == pytest.approx(4.99, abs=1e-6)   # (-0.01 + 9.99) / 2
    if rank == 0:                            # export gives the same combination
        cli.export(path, os.path.join(folder, "replicas.pt"))
        exported = torch.load(os.path.join(folder, "replicas.pt"), weights_only=True)
        assert all(torch.equal(exported["model"][k], v) for k, v in averaged.state_dict().items())
    WORLD.Barrier()
    replica.Free()


def rewrite_in_old_layout(path, version):
    """Rewrite a checkpoint as older versions laid it out: version 3 with one JSON list per
    tensor in its catalog; versions 1 and 2 with a dataset per tensor carrying its dtype and
    checksum and every attribute an HDF5 attribute (and no replicas in version 1)."""
    with checkpoint.Reader(path) as reader:
        catalog = reader.catalog
        tensors = {name: (fmt.to_numpy(reader.tensor(name)), entry)
                   for name, entry in zip(catalog.names, catalog.entries())}
        attributes = catalog.attributes
        root = dict(reader.file.attrs)
    with h5py.File(path, "r+" if version == 3 else "w") as f:
        f.attrs["format_version"] = version
        if version == 3:
            document = {"tensors": {name: list(entry) for name, (_, entry) in tensors.items()},
                        "attributes": attributes}
            for name in ("catalog", "catalog_columns", "catalog_shapes"):
                del f[name]
            f["catalog"] = np.frombuffer(json.dumps(document).encode(), dtype=np.uint8)
            return
        f.attrs.update({k: v for k, v in root.items() if k != "format_version"})
        if version == 1:
            del f.attrs["replicas"]
        for name, (array, entry) in tensors.items():
            dataset = f.create_dataset(name, data=array)
            dataset.attrs.update({"torch_dtype": entry.dtype, "crc32": np.uint32(entry.crc32)})
        for node, attrs in attributes.items():
            f.require_group(node).attrs.update(attrs)


@pytest.mark.parametrize("version", [1, 2, 3])
def test_files_of_older_versions_still_load(folder, version):
    model = Four()
    optimizer = adam_step(model)
    path = checkpoint.save(os.path.join(folder, f"v{version}.h5"), model, optimizer)
    if WORLD.Get_rank() == 0:
        rewrite_in_old_layout(path, version)
    WORLD.Barrier()
    resumed = Four(offset=5.0)
    again = adam_step(resumed, gradient=3.0)
    checkpoint.load(path, resumed, again)
    assert all(torch.equal(a, b) for a, b in zip(params(model), params(resumed)))
    assert all(torch.equal(a, b) for a, b in zip(state_tensors(optimizer), state_tensors(again)))
