"""Pruning with ``keep``: the file just written stays, damaged files are neither counted nor
deleted, the order is the one recorded in the files, other runs are untouched; ``latest`` and
``checkpoints`` follow the same order."""
import os
import warnings

import h5py
import numpy as np
import pytest
import torch
from mpi4py import MPI

from tensorplay_hpc import checkpoint

WORLD = MPI.COMM_WORLD
RANK = WORLD.Get_rank()


def model():
    torch.manual_seed(0)
    return torch.nn.Linear(40, 30)


def save(folder, name, step, keep=None):
    """Save under ``folder``/``name`` with ``step`` recorded; the warnings about files left alone
    (raised on rank 0, which prunes)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint.save(os.path.join(folder, name), model(), extra={"step": step}, keep=keep)
    return [str(w.message) for w in caught if "left alone" in str(w.message)]


def listing(folder):
    WORLD.Barrier()
    return sorted(n for n in os.listdir(folder) if n.endswith(".h5"))


def on_rank0(action):
    """Run ``action`` on rank 0 while the others wait."""
    if RANK == 0:
        action()
    WORLD.Barrier()


def corrupt_copy(path):
    """Replace ``path`` by a copy whose largest dataset has one byte flipped (the file still
    opens as a checkpoint; a checksum no longer matches)."""
    with h5py.File(path, "r") as f:
        datasets = []
        f.visititems(lambda _, obj: datasets.append(obj) if isinstance(obj, h5py.Dataset)
                     and obj.dtype == np.float32 else None)
        where = max(datasets, key=lambda d: d.size).id.get_offset()
    with open(path, "rb") as good:
        data = bytearray(good.read())
    data[where + 7] ^= 0xFF
    with open(path + ".new", "wb") as out:
        out.write(data)
    os.replace(path + ".new", path)


def test_keep_never_deletes_the_file_just_written(folder):
    # An older run's last file records a larger step; names sort it after the new one too.
    save(folder, "old-run-final.h5", 1000)
    save(folder, "new-step0010.h5", 10, keep=1)
    assert listing(folder) == ["new-step0010.h5", "old-run-final.h5"]
    assert checkpoint.load(os.path.join(folder, "new-step0010.h5"), model())["step"] == 10
    assert checkpoint.latest(folder) == os.path.join(folder, "new-step0010.h5")
    # A run resumed from step 20 after step 30: the new file is kept, the abandoned one goes.
    save(folder, "new-step0030.h5", 30)
    save(folder, "new-step0021.h5", 21, keep=1)
    assert listing(folder) == ["new-step0021.h5", "old-run-final.h5"]


def test_damaged_newest_is_neither_counted_nor_deleted(folder):
    for step in (1, 2, 3):
        save(folder, f"run-step{step}.h5", step)
    damaged = os.path.join(folder, "run-step3.h5")
    on_rank0(lambda: corrupt_copy(damaged))
    left = save(folder, "run-step4.h5", 4, keep=2)
    assert listing(folder) == ["run-step2.h5", "run-step3.h5", "run-step4.h5"]
    if RANK == 0:
        assert len(left) == 1
        assert left[0].startswith(f"keep=2: {damaged} is left alone, neither counted nor deleted: ")
        assert "checksum mismatch" in left[0]
    else:
        assert left == []
    assert checkpoint.latest(folder) == os.path.join(folder, "run-step4.h5")
    # Still not counted: the next save keeps the two newest good files.
    save(folder, "run-step5.h5", 5, keep=2)
    assert listing(folder) == ["run-step3.h5", "run-step4.h5", "run-step5.h5"]


def test_unreadable_files_of_the_run_are_left_alone_with_a_warning(folder):
    save(folder, "run-step1.h5", 1)
    save(folder, "run-step2.h5", 2)
    paths = {name: os.path.join(folder, f"run-step{n}.h5")
             for n, name in ((7, "truncated"), (8, "foreign"), (9, "garbage"))}

    def make():
        with open(os.path.join(folder, "run-step2.h5"), "rb") as good:
            data = good.read()
        with open(paths["truncated"], "wb") as out:
            out.write(data[:len(data) // 3])
        with h5py.File(paths["foreign"], "w") as f:
            f["x"] = np.zeros(3)
        with open(paths["garbage"], "wb") as out:
            out.write(b"not a checkpoint" * 100)
    on_rank0(make)
    left = save(folder, "run-step3.h5", 3, keep=2)
    assert listing(folder) == ["run-step2.h5", "run-step3.h5", "run-step7.h5", "run-step8.h5",
                               "run-step9.h5"]
    if RANK == 0:
        assert [w.split(": ")[1] for w in left] == [
            f"{paths[name]} is left alone, neither counted nor deleted"
            for name in ("truncated", "foreign", "garbage")]
        assert "not a readable HDF5 file" in left[0]
        assert left[1].endswith("not a tensorplay_hpc checkpoint (format attribute is None)")
        assert "not a readable HDF5 file" in left[2]
    else:
        assert left == []


def test_order_is_the_recorded_creation_time_then_step(folder):
    # Saved in the order 9, 100, 10: names, steps and creation times all sort differently.
    for step in (9, 100, 10):
        save(folder, f"step-{step}.h5", step)
    names = ["step-9.h5", "step-100.h5", "step-10.h5"]

    def scramble():   # modification times in the opposite order (as after a copy)
        for age, name in enumerate(names):
            os.utime(os.path.join(folder, name), (1e9 + 1000 - age, 1e9 + 1000 - age))
    on_rank0(scramble)
    assert checkpoint.checkpoints(folder) == [os.path.join(folder, n) for n in names]
    assert checkpoint.latest(folder) == os.path.join(folder, "step-10.h5")
    save(folder, "step-11.h5", 11, keep=2)
    assert listing(folder) == ["step-10.h5", "step-11.h5"]

    # With equal creation times the recorded step decides, not the modification time. (The
    # files are made version 4 files, which have no metadata checksums to cover the change.)
    def same_created():
        for name in ("step-10.h5", "step-11.h5"):
            with h5py.File(os.path.join(folder, name), "r+") as f:
                f.attrs["created"] = "2030-01-01T00:00:00+00:00"
                f.attrs["format_version"] = 4
                del f.attrs["metadata_crc32"]
        os.utime(os.path.join(folder, "step-10.h5"), (2e9, 2e9))
    on_rank0(same_created)
    assert checkpoint.checkpoints(folder) == [os.path.join(folder, n)
                                              for n in ("step-10.h5", "step-11.h5")]


def test_files_of_other_runs_are_untouched(folder):
    for step in (5, 6):
        save(folder, f"a1-step{step}.h5", step)
    save(folder, "best.h5", 6)
    for step in (1, 2, 3):
        left = save(folder, f"a2-step{step}.h5", step, keep=1)
        assert left == []
    assert listing(folder) == ["a1-step5.h5", "a1-step6.h5", "a2-step3.h5", "best.h5"]
    assert checkpoint.latest(folder) == os.path.join(folder, "a2-step3.h5")
