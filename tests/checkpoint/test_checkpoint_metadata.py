"""Checkpoints whose metadata is damaged or missing (the catalog, an attribute): a
CheckpointError on every rank naming the file and what is wrong, never a raw JSON, key or HDF5
error, and never a partial load."""
import json
import os

import h5py
import numpy as np
import pytest
import torch
from mpi4py import MPI

from tensorplay_hpc import checkpoint
from tensorplay_hpc.distributed.optim import ZeroRedundancyOptimizer

WORLD = MPI.COMM_WORLD


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))


def _stepped(model, optimizer):
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    return optimizer


def _edit(path, change):
    """On rank 0, ``change(f, catalog)`` the file or its catalog (a JSON document, written back
    if changed), after making it a file of format version 4, which has no metadata checksums:
    what is checked here is how damaged metadata is decoded once past them (the checksums are
    tested in test_checkpoint_integrity.py)."""
    if WORLD.Get_rank() == 0:
        with h5py.File(path, "r+") as f:
            f.attrs["format_version"] = 4
            del f.attrs["metadata_crc32"]
            text = f["catalog"][()].tobytes()
            catalog = json.loads(text)
            change(f, catalog)
            if catalog != json.loads(text):
                del f["catalog"]
                f["catalog"] = np.frombuffer(json.dumps(catalog).encode(), dtype=np.uint8)
    WORLD.Barrier()


def _garble_param_groups(f, catalog):
    catalog["attributes"]["optimizer"]["param_groups"] = '[{"lr": 0.1, '


def _drop_param_groups(f, catalog):
    del catalog["attributes"]["optimizer"]["param_groups"]


def _drop_format_version(f, catalog):
    del f.attrs["format_version"]


def _garble_replicas(f, catalog):
    f.attrs["replicas"] = "[[0, 1"


def _drop_catalog(f, catalog):
    del f["catalog"]


def _garble_catalog(f, catalog):
    del f["catalog"]
    f["catalog"] = np.frombuffer(b'{"tensors": {"model/0.weight": [', dtype=np.uint8)


def _drop_columns(f, catalog):
    del f["catalog_columns"]


def _narrow_columns(f, catalog):
    columns = f["catalog_columns"][()]
    del f["catalog_columns"]
    f["catalog_columns"] = columns[:, :3]


def _garble_shape(f, catalog):
    sizes = f["catalog_shapes"][()]
    sizes[0] += 1
    f["catalog_shapes"][...] = sizes


CASES = [
    (_garble_param_groups, "attribute 'param_groups' of 'optimizer' is damaged"),
    (_drop_param_groups, "the checkpoint lacks attribute 'param_groups' of 'optimizer'"),
    (_drop_format_version, "attribute 'format_version' is missing or damaged"),
    (_garble_replicas, "attribute 'replicas' of '/' is damaged"),
    (_drop_catalog, "the checkpoint lacks its catalog"),
    (_garble_catalog, "the checkpoint's catalog is damaged"),
    (_drop_columns, "the checkpoint lacks its catalog \\(dataset 'catalog_columns'\\)"),
    (_narrow_columns, "catalog is damaged \\(ValueError: columns of shape \\(\\d+, 3\\)"),
    (_garble_shape, "catalog is damaged \\(ValueError: a tensor's element count differs"),
]


@pytest.mark.parametrize("change, message", CASES, ids=[c.__name__[1:] for c, _ in CASES])
def test_damaged_metadata_is_named_on_every_rank(folder, change, message):
    model = _model()
    optimizer = _stepped(model, torch.optim.Adam(model.parameters(), lr=0.1))
    path = checkpoint.save(os.path.join(folder, "ckpt.h5"), model, optimizer)
    _edit(path, change)
    fresh = _model(seed=1)
    before = [p.detach().clone() for p in fresh.parameters()]
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.1)
    with pytest.raises(checkpoint.CheckpointError, match=message) as raised:
        checkpoint.load(path, fresh, fresh_optimizer)
    assert path in str(raised.value)
    messages = WORLD.allgather(str(raised.value))
    assert messages == [messages[0]] * WORLD.Get_size()
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.parameters()))   # nothing loaded
    assert fresh_optimizer.state_dict()["state"] == {}


def test_damaged_state_values_of_a_sharded_optimizer_name_the_node(folder):
    """Each rank decodes the values of the state it owns: the owner of parameter 0 names it."""
    model = _model()
    zero = _stepped(model, ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.1))
    path = checkpoint.save(os.path.join(folder, "zero.h5"), model, zero)

    def garble(f, catalog):
        catalog["attributes"]["optimizer/state/0"] = {"values": "{"}
    _edit(path, garble)
    fresh = _model(seed=1)
    fresh_zero = ZeroRedundancyOptimizer(fresh.parameters(), torch.optim.Adam, lr=0.1)
    owner = fresh_zero.partition.rank_of[0]
    with pytest.raises(checkpoint.CheckpointError,
                       match=f"rank {owner}: .*attribute 'values' of 'optimizer/state/0' is "
                             "damaged") as raised:
        checkpoint.load(path, fresh, fresh_zero)
    messages = WORLD.allgather(str(raised.value))
    assert messages == [messages[0]] * WORLD.Get_size()


def test_loading_the_latest_of_an_empty_folder_says_there_is_none(folder):
    assert checkpoint.latest(folder) is None
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"the path is None \(checkpoint.latest\(folder\) gives None"):
        checkpoint.load(checkpoint.latest(folder), _model())
