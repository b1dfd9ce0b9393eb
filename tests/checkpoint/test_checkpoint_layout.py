"""Checkpoints laid out for parallel file systems: large datasets on the alignment boundary,
stripe and collective-buffering hints reaching the MPI-IO open, the collective write path
giving the same bytes as the independent one, and HDF5 file locking as the setting says."""
import fcntl
import os

import h5py
import numpy as np
import pytest
import torch
from mpi4py import MPI

from tensorplay_hpc import checkpoint
from tensorplay_hpc.checkpoint import locking, striping, writer

WORLD = MPI.COMM_WORLD
BOUNDARY = 1 << 16


def extras(rank):
    """This rank's values: two tensors above the boundary (of odd sizes, so that unaligned
    datasets would follow each other at odd offsets), one below it and a tiny one."""
    g = torch.Generator().manual_seed(rank)
    return {"large": torch.randn(20_011 + rank, generator=g),
            "larger": torch.randn(3, 17_003, generator=g, dtype=torch.float64),
            "medium": torch.randn(9_001, generator=g),
            "tiny": torch.arange(5)}


def data_regions(path):
    """(name, offset, bytes) of every contiguous dataset with values in ``path``."""
    found = []
    with h5py.File(path, "r") as f:
        def visit(name, node):
            if isinstance(node, h5py.Dataset) and node.id.get_offset() is not None:
                found.append((name, node.id.get_offset(), node.id.get_storage_size()))
        f.visititems(visit)
    return sorted(found)


def raw(path, regions):
    with open(path, "rb") as f:
        return [(f.seek(offset), f.read(nbytes))[1] for _, offset, nbytes in regions]


@pytest.mark.mpi(min_size=1)
def test_large_datasets_start_on_the_boundary_and_small_files_stay_small(folder, setting):
    setting(striping.ALIGN_ENV, str(BOUNDARY))
    path = checkpoint.save(os.path.join(folder, "aligned.h5"), extra=extras(WORLD.rank))
    regions = data_regions(path)
    large = [(name, offset) for name, offset, nbytes in regions if nbytes >= BOUNDARY]
    assert len(large) >= 2 * WORLD.size
    assert [offset % BOUNDARY for _, offset in large] == [0] * len(large), large
    loaded = checkpoint.load(path)
    assert all(torch.equal(loaded[key], value) for key, value in extras(WORLD.rank).items())
    # The default boundary (4 MiB here: no striped file system) leaves a small file small.
    setting(striping.ALIGN_ENV, "")
    small = checkpoint.save(os.path.join(folder, "small.h5"), extra={"tiny": torch.arange(5)})
    assert striping.file_system("/proc/self") == "proc"
    assert striping.stripe_size(folder) is None     # not Lustre, GPFS nor BeeGFS here
    assert striping.boundary(folder) == striping.DEFAULT_BOUNDARY
    assert os.path.getsize(small) < 1 << 16


@pytest.mark.mpi(min_size=1)
def test_stripe_and_buffering_hints_reach_the_open(folder, setting):
    setting(striping.STRIPE_COUNT_ENV, "1")
    setting(striping.STRIPE_SIZE_ENV, str(1 << 20))
    path = WORLD.bcast(os.path.join(folder, "hinted.bin"))
    if WORLD.rank == 0:
        striping.create(path)
    WORLD.Barrier()
    asked = striping.hints(collective=True)
    assert asked == {"striping_factor": "1", "striping_unit": str(1 << 20),
                     "romio_cb_write": "enable", "cb_nodes": "1",
                     "cb_buffer_size": str(1 << 20)}
    handle = writer.open_for_writing(path, WORLD)
    try:
        reported = handle.Get_info()
        told = {key: reported.Get(key) for key in asked}
        reported.Free()
    finally:
        handle.Close()
    # Each library reports the hints it keeps (ROMIO drops striping on a plain file system).
    kept = {key: value for key, value in told.items() if value is not None}
    assert kept and kept == {key: asked[key] for key in kept}, told
    with pytest.raises(ValueError, match=striping.STRIPE_COUNT_ENV):
        setting(striping.STRIPE_COUNT_ENV, "two")
        striping.hints(collective=False)


@pytest.mark.mpi(min_size=1)
def test_the_collective_write_gives_the_bytes_of_the_independent_one(folder, setting):
    setting(striping.ALIGN_ENV, str(BOUNDARY))
    paths = {}
    for way in ("independent", "collective"):
        setting(writer.WRITE_ENV, way)
        # Rank 0 writes more runs than the others: they take part in its extra rounds.
        values = extras(WORLD.rank)
        if WORLD.rank == 0:
            values.update({f"more{i}": torch.full((20_000,), float(i)) for i in range(3)})
        paths[way] = checkpoint.save(os.path.join(folder, f"{way}.h5"), extra=values)
    regions = data_regions(paths["independent"])
    assert regions == data_regions(paths["collective"])
    assert raw(paths["independent"], regions) == raw(paths["collective"], regions)
    assert checkpoint.load(paths["collective"])["large"].equal(
        extras(WORLD.rank)["large"])


@pytest.mark.mpi(min_size=1)
def test_readers_lock_the_file_only_as_the_setting_says(folder, setting):
    path = checkpoint.save(os.path.join(folder, "locked.h5"), extra={"x": torch.ones(3)})
    WORLD.Barrier()
    holder = os.open(path, os.O_RDONLY)     # another writer's exclusive lock, as HDF5 takes
    try:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB) if WORLD.rank == 0 else None
        WORLD.Barrier()
        setting(locking.LOCKING_ENV, "off")
        assert locking.file_locking(path) is False
        assert checkpoint.load(path)["x"].equal(torch.ones(3))
        setting(locking.LOCKING_ENV, "on")
        assert locking.file_locking(path) is True
        with pytest.raises(checkpoint.CheckpointError, match="not a readable HDF5 file"):
            checkpoint.Reader(path)
        setting(locking.LOCKING_ENV, "auto")
        setting("HDF5_USE_FILE_LOCKING", "FALSE")
        assert locking.file_locking(path) is False
        setting(locking.LOCKING_ENV, "sometimes")
        with pytest.raises(ValueError, match=locking.LOCKING_ENV):
            locking.file_locking(path)
        WORLD.Barrier()
    finally:
        os.close(holder)
