"""The lifetime rule of the library's MPI objects: every owner's close() frees its communicators
and windows on every rank, closing twice does nothing, use after close is a clear error, and
the garbage collector never frees one (it warns and leaves it to MPI_Finalize)."""
import gc
import threading
import time
from collections import Counter
import warnings
from pathlib import Path

import pytest
import torch
from mpi4py import MPI

from tensorplay_hpc import comm
from tensorplay_hpc.comm import lifetime, worker
from tensorplay_hpc.comm.work import in_background
from tensorplay_hpc.comm.private import private_comm
from tensorplay_hpc.distributed import rma
from tensorplay_hpc.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
    PostLocalSGDState, post_localSGD_hook)
from tensorplay_hpc.distributed.algorithms.join import Join
from tensorplay_hpc.distributed.algorithms.model_averaging import averagers
from tensorplay_hpc.distributed.algorithms.model_averaging.hierarchical_model_averager import (
    HierarchicalModelAverager)
from tensorplay_hpc.distributed.optim import DistributedOptimizer, ZeroRedundancyOptimizer
from tensorplay_hpc.distributed.parallel import DistributedDataParallel
from tensorplay_hpc.train.config import TrainConfig
from tensorplay_hpc.train.loop import Run
from tensorplay_hpc.train.preemption import Preemption

WORLD = MPI.COMM_WORLD
pytestmark = pytest.mark.timeout(60)
CACHE = "the library's cache on a user's communicator"


@pytest.fixture(autouse=True)
def _cached_duplicate_made():
    """The duplicate that hooks and averaging cache on MPI_COMM_WORLD lives as long as it (until
    MPI_Finalize): make it before any test counts what a test leaves. Other tests' unclosed
    objects are collected first, so that none is collected (and changes state) mid-test."""
    private_comm(WORLD)
    gc.collect()


def _made_since(before):
    """The open objects that were not there before (other tests' objects that are not collected
    yet may carry the same descriptions)."""
    return list((Counter(lifetime.open_objects()) - Counter(before)).elements())


def _model():
    return torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def _backward(model):
    model(torch.randn(3, 6)).square().sum().backward()


def zero():
    model = _model()
    optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.1)
    _backward(model)
    optimizer.step()
    return optimizer, optimizer.step


def ddp():
    model = DistributedDataParallel(_model())
    _backward(model)
    return model, lambda: model(torch.randn(3, 6))


def post_local_state():
    model = DistributedDataParallel(_model())
    state = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=1)
    model.register_comm_hook(state, post_localSGD_hook)
    for _ in range(2):          # the warm-up, then the node group
        _backward(model)
    model.close()
    return state, lambda: post_localSGD_hook(state, model.reducer.buckets[0])


def periodic_averager():
    averager = averagers.PeriodicModelAverager(period=2, warmup_steps=0)
    params = list(_model().parameters())
    averager.average_parameters(params)
    return averager, lambda: averager.average_parameters(params)


def hierarchical_averager():
    sizes = {2: 1, 4: WORLD.size} if WORLD.size > 1 else {4: 1}
    averager = HierarchicalModelAverager(sizes, warmup_steps=0)
    params = list(_model().parameters())
    averager.average_parameters(params)
    return averager, lambda: averager.average_parameters(params)


def shared_tensors():
    shared = rma.share([torch.arange(4.0, requires_grad=True)])
    owner = shared.refs[(WORLD.rank + 1) % WORLD.size]
    assert owner.to_here().tolist() == [0.0, 1.0, 2.0, 3.0]
    return shared, lambda: owner.to_here()


def distributed_optimizer():
    shared = rma.share([torch.full((3,), float(WORLD.rank), requires_grad=True)])
    optimizer = DistributedOptimizer(torch.optim.SGD, shared.refs, lr=1.0)

    class Both(comm.Closeable):
        def close(self):
            optimizer.close()
            shared.close()
    return Both(), lambda: optimizer.step(0)


OWNERS = {"ZeroRedundancyOptimizer": zero, "DistributedDataParallel": ddp,
          "PostLocalSGDState": post_local_state, "PeriodicModelAverager": periodic_averager,
          "HierarchicalModelAverager": hierarchical_averager, "SharedTensors": shared_tensors,
          "DistributedOptimizer": distributed_optimizer}


@pytest.mark.parametrize("name", OWNERS)
def test_close_frees_every_communicator_and_window_and_later_use_is_an_error(name):
    before = lifetime.open_objects()
    owner, use = OWNERS[name]()
    made = _made_since(before)
    assert made, f"{name} made no communicator or window"
    owner.close()
    assert _made_since(before) == []
    owner.close()                                   # closing again does nothing
    assert _made_since(before) == []
    with pytest.raises(RuntimeError, match=rf"is closed.*rank {WORLD.rank}"):
        use()


def test_the_owners_name_their_communicators():
    before = lifetime.open_objects()
    optimizer, _ = zero()
    made = _made_since(before)
    assert made == [f"ZeroRedundancyOptimizer: communicator MPI_COMM_WORLD (private duplicate) "
                    f"of {WORLD.size} ranks"]
    optimizer.close()


def test_a_with_block_closes_on_a_normal_exit_and_not_after_an_error():
    before = lifetime.open_objects()
    with comm.ProcessGroup(owner="a test") as group:
        assert group.comm.allreduce(1) == WORLD.size
    assert group.closed and _made_since(before) == []
    with pytest.raises(ValueError, match="the same on every rank"):
        with comm.ProcessGroup(owner="a test") as group:
            raise ValueError("the same on every rank")
    assert not group.closed and len(_made_since(before)) == 1
    group.close()                                    # every rank raised: all close now
    assert _made_since(before) == []


def test_a_group_collected_unclosed_warns_and_is_left_to_mpi_finalize():
    gc.collect()                 # other tests' objects are not counted below
    group = comm.ProcessGroup(owner="a forgotten test group")
    raw = group._comm
    in_background(group.comm, lambda: None).wait()   # its worker thread, where there are any
    after = threading.active_count() - (1 if worker.available() else 0)   # the worker ended
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del group
        gc.collect()
    deadline = time.monotonic() + 10
    while threading.active_count() > after and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() == after
    messages = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert messages == [
        f"a forgotten test group: communicator MPI_COMM_WORLD (private duplicate) of {WORLD.size} "
        f"ranks was collected without close() (world rank {WORLD.rank}): it stays allocated "
        "until MPI_Finalize; call its owner's close() on every rank, or use the owner as a "
        "context manager"]
    assert raw != MPI.COMM_NULL                      # not freed by the collector
    assert lifetime.live()[-1].startswith("a forgotten test group: ")
    assert lifetime.live()[-1].endswith(" (collected without close(): left to MPI_Finalize)")


def test_a_training_run_closes_its_model_optimizer_and_group(folder):
    before = lifetime.open_objects()
    config = TrainConfig(layers=1, width=16, heads=2, context=8, batch_size=4, eval_every=0,
                         eval_batches=1, progress=False, threads=1, steps=2, warmup_steps=1,
                         average_period=2, checkpoint_every=0, optimizer="postlocal",
                         run_dir=Path(folder) / "run")
    with Preemption() as preemption, Run(config, WORLD) as run:
        owners = {entry.split(":")[0] for entry in _made_since(before)}
        assert owners == {"the training run", "DistributedDataParallel",
                          "PeriodicModelAverager", "PostLocalSGDState"}
        assert run.train(preemption).steps == 2
    assert _made_since(before) == []
