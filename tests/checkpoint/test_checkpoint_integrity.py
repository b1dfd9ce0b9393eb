"""Integrity beyond the tensors' values: one flipped character of metadata (the root's
attributes, the catalog) is an error naming it on every rank; a disk that fills during a save is
an error without a crash; temporaries of dead saves are removed, those of live ones kept; two
groups may save one path at once."""
import os
import subprocess
import time
import uuid

import h5py
import pytest
import torch
from mpi4py import MPI

from launch import SUPPORT, mpiexec, only_in_single_rank_run
from tensorplay_hpc import checkpoint
from tensorplay_hpc.checkpoint import cli, files

WORLD = MPI.COMM_WORLD
RANK = WORLD.Get_rank()
JOB = str(SUPPORT / "checkpoint_job.py")


def _saved(folder, name, step):
    """A checkpoint of an SGD model at lr 0.01 whose extras hold ``step``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    return checkpoint.save(os.path.join(folder, name), model, optimizer, extra={"step": step})


def _replace_in_catalog(f, old, new):
    """Replace the first ``old`` in the catalog's JSON document by ``new`` (as long), in place."""
    raw = f["catalog"][()]
    at = raw.tobytes().index(old)
    raw[at:at + len(new)] = list(new)
    f["catalog"][...] = raw


def _lr(f):
    _replace_in_catalog(f, b'\\"lr\\": 0.01', b'\\"lr\\": 0.09')


def _extra_step(f):
    _replace_in_catalog(f, b'\\"step\\": 2', b'\\"step\\": 7')


def _root_step(f):
    f.attrs["step"] = 7


def _column(f):
    columns = f["catalog_columns"][()]
    columns[-1, 0] += 1                 # where a packed tensor begins
    f["catalog_columns"][...] = columns


def _table(f):
    f.attrs["metadata_crc32"] = f.attrs["metadata_crc32"][:-2]


CATALOG = "the catalog's JSON document \\(tensor names, dtypes and every attribute below the root"
DAMAGE = [
    (_lr, CATALOG),
    (_extra_step, CATALOG),
    (_root_step, "root attribute 'step' does not match its checksum"),
    (_column, "the catalog's columns of tensor places and dtypes \\(dataset 'catalog_columns'\\)"),
    (_table, "the checksums of the checkpoint's metadata \\(root attribute 'metadata_crc32'\\) "
             "cannot be read \\(JSONDecodeError"),
]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("damage, message", DAMAGE, ids=[d.__name__[1:] for d, _ in DAMAGE])
def test_one_flipped_character_of_metadata_is_named_on_every_rank(folder, damage, message):
    """The damaged file fails load on every rank with the same message, loads nothing, is passed
    over by latest() for the good one before it, and fails the command line's verification."""
    case = os.path.join(folder, damage.__name__[1:])
    good = _saved(case, "run-1.h5", 2)
    damaged = _saved(case, "run-2.h5", 2)
    if RANK == 0:
        with h5py.File(damaged, "r+") as f:
            damage(f)
    WORLD.Barrier()
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(checkpoint.CheckpointError, match=message) as raised:
        checkpoint.load(damaged, model, optimizer)
    text = str(raised.value)
    assert text.startswith(f"loading checkpoint {damaged} failed on {WORLD.Get_size()} of ")
    assert f"rank 0: CheckpointError: {damaged}: " in text and "the file is damaged" in text
    assert WORLD.allgather(text) == [text] * WORLD.Get_size()
    assert optimizer.param_groups[0]["lr"] == 0.5
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert checkpoint.latest(case) == good
    with pytest.raises(checkpoint.CheckpointError, match=message):
        cli.summary(damaged)
    assert checkpoint.load(good, model, optimizer) == {"step": 2}
    assert optimizer.param_groups[0]["lr"] == 0.01


def test_a_file_of_version_4_has_no_metadata_checksums_and_loads(folder):
    path = _saved(os.path.join(folder, "v4"), "old.h5", 2)
    if RANK == 0:
        with h5py.File(path, "r+") as f:
            f.attrs["format_version"] = 4
            del f.attrs["metadata_crc32"]
            _lr(f)                        # unchecked in a file of version 4
    WORLD.Barrier()
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    assert checkpoint.load(path, model, optimizer) == {"step": 2}
    assert optimizer.param_groups[0]["lr"] == 0.09


def _named(temporary, host=None, namespace=None, pid=None, suffix=""):
    """``temporary`` (named by files.temporary_name) made by another host, pid namespace or
    pid."""
    base, _, made_by = temporary.rpartition(".tmp-")
    own_host, own_namespace, own_pid, random = made_by.rsplit(".", 3)
    return (f"{base}.tmp-{host or own_host}.{namespace or own_namespace}.{pid or own_pid}."
            f"{random}{suffix}")


@pytest.mark.mpi(min_size=2)
def test_a_save_removes_the_temporaries_of_certainly_dead_saves_only(folder):
    """Made on this host, in this pid namespace, by a process that has ended (reaped, or a
    zombie, as a killed rank is for a moment): removed (with its space probe). Made by a live
    process (rank 1's), on another host, in another pid namespace, or named as older versions
    named them: kept."""
    case = os.path.join(folder, "temporaries")
    path = os.path.join(case, "ck.h5")
    live_pid = WORLD.bcast(os.getpid(), root=1)
    kept, dead = [], []
    if RANK == 0:
        os.makedirs(case)
        ended = subprocess.Popen(["true"])
        ended.wait()
        zombie = subprocess.Popen(["true"])
        while open(f"/proc/{zombie.pid}/stat").read().rpartition(")")[2].split()[0] != "Z":
            time.sleep(0.01)
        own = files.temporary_name(path)
        kept = [_named(own, pid=live_pid), _named(own, pid=live_pid, suffix=".space"),
                _named(own, host="another-node", pid=ended.pid),
                _named(own, namespace="12345", pid=ended.pid),
                f"{path}.tmp-{uuid.uuid4().hex[:12]}"]
        dead = [_named(files.temporary_name(path), pid=ended.pid),
                _named(files.temporary_name(path), pid=ended.pid, suffix=".space"),
                _named(files.temporary_name(path), pid=zombie.pid)]
        for name in kept + dead:
            open(name, "wb").close()
    _saved(case, "ck.h5", 1)
    if RANK == 0:
        zombie.wait()
        assert sorted(os.listdir(case)) == sorted(["ck.h5", *map(os.path.basename, kept)])


@pytest.mark.mpi(min_size=2)
def test_two_groups_saving_one_path_at_once_both_succeed(folder):
    """Each save has its own temporary and its own space probe; the last rename wins."""
    path = os.path.join(folder, "both.h5")
    group = WORLD.Split(RANK % 2, RANK)
    try:
        torch.manual_seed(RANK % 2)
        model = torch.nn.Linear(40, 40)
        WORLD.Barrier()
        for step in range(6):
            checkpoint.save(path, model, extra={"group": RANK % 2, "step": step},
                            process_group=group)
    finally:
        group.Free()
    WORLD.Barrier()
    extra = checkpoint.load(path, torch.nn.Linear(40, 40))
    assert extra["step"] == 5 and extra["group"] in (0, 1)
    assert [n for n in os.listdir(folder) if n.startswith("both.h5.tmp-")] == []


@only_in_single_rank_run
@pytest.mark.timeout(120)
def test_a_disk_that_fills_while_the_file_is_laid_out_is_an_error_without_a_crash(tmp_path):
    """A 2 MiB tmpfs, filled but for 4 KiB once the save has checked the free space: HDF5's
    writes of the file's layout fail. Each rank gets the error, the job ends normally (no
    segmentation fault at exit), the last checkpoint loads and no temporary is left."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs",
                                            str(disk)]).returncode != 0:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        run = mpiexec(2, [JOB, "fill", str(disk / "ck.h5"), "4096"], timeout=90)
        left = os.listdir(disk)
    finally:
        subprocess.run(["umount", str(disk)], check=True)
    assert run.returncode == 0, run.stderr[-3000:]
    failed = [line for line in run.stdout.splitlines() if line.startswith("save failed: ")]
    assert len(failed) == 2 and failed[0] == failed[1], run.stdout
    assert "rank 0: OSError: [Errno 28] No space left on device: writing the layout of " \
           f"{disk}/ck.h5.tmp-" in failed[0]
    assert "rank 0 loaded step 1" in run.stdout and "rank 1 loaded step 1" in run.stdout
    assert left == ["ck.h5"]
