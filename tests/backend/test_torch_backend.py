"""The ``mpi4py`` torch.distributed backend: each collective, PyTorch's DDP, FSDP2, DTensor,
distributed checkpoints and ZeroRedundancyOptimizer on a group of the backend, against the
same program over gloo (the default group) in the same run."""
import copy
import os
import re
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from mpi4py import MPI

from tensorplay_hpc.comm import trace
from tensorplay_hpc.comm.chunking import CHUNK_ENV
from tensorplay_hpc.distributed.backend import BACKEND_NAME, MPIProcessGroup, UnsupportedOperation

from launch import SUPPORT, mpiexec, only_in_single_rank_run

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()


@pytest.fixture(scope="module")
def groups(gloo):
    """(ours, gloo's): a group of the backend over every rank, and gloo's default group."""
    ours = dist.new_group(backend=BACKEND_NAME)
    assert isinstance(ours, MPIProcessGroup)
    yield ours, dist.group.WORLD
    dist.destroy_process_group(ours)


def _both(groups, run):
    """``run(group)`` on our group and on gloo's; both results."""
    ours, theirs = groups
    return run(ours), run(theirs)


def _same(a, b, atol=0.0):
    """Equal tensors (nested in lists). With ``atol``, equal up to it from 3 ranks on: MPI and
    gloo add three or more ranks' numbers in different orders, which changes the last bits of
    floating point sums (of two numbers, the order does not matter)."""
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y, atol)
    elif atol and SIZE > 2:
        torch.testing.assert_close(a, b, rtol=0, atol=atol)
    else:
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b), (a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.bfloat16])
@pytest.mark.parametrize("op", ["SUM", "MAX", "MIN", "PRODUCT"])
def test_all_reduce_matches_gloo(groups, dtype, op):
    def run(group):
        t = (torch.arange(6) % 3 + RANK + 1).to(dtype)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=group)
        return t
    _same(*_both(groups, run))


def test_all_reduce_average_is_the_mean(groups):
    ours, _ = groups
    t = torch.full((5,), float(RANK))
    dist.all_reduce(t, op=dist.ReduceOp.AVG, group=ours)
    assert torch.equal(t, torch.full((5,), (SIZE - 1) / 2))


def test_unsupported_reduction_is_named(groups):
    ours, _ = groups
    with pytest.raises(UnsupportedOperation, match=rf"BAND.*rank {RANK}"):
        dist.all_reduce(torch.ones(2, dtype=torch.int64), op=dist.ReduceOp.BAND, group=ours)


def test_gathers_scatters_and_broadcasts_match_gloo(groups):
    def run(group):
        out = {}
        mine = torch.arange(4, dtype=torch.float32) + 10 * RANK
        parts = [torch.empty(4) for _ in range(SIZE)]
        dist.all_gather(parts, mine, group=group)
        out["all_gather"] = parts
        flat = torch.empty(4 * SIZE)
        dist.all_gather_into_tensor(flat, mine, group=group)
        out["all_gather_into_tensor"] = flat
        big = torch.arange(2 * SIZE, dtype=torch.float64) * (RANK + 1)
        piece = torch.empty(2, dtype=torch.float64)
        dist.reduce_scatter_tensor(piece, big, group=group)
        out["reduce_scatter_tensor"] = piece
        listed = torch.empty(3)
        dist.reduce_scatter(listed, [torch.full((3,), float(r + RANK)) for r in range(SIZE)],
                            group=group)
        out["reduce_scatter"] = listed
        b = torch.arange(7) if RANK == SIZE - 1 else torch.zeros(7, dtype=torch.int64)
        dist.broadcast(b, src=SIZE - 1, group=group)
        out["broadcast"] = b
        r = mine.clone()
        dist.reduce(r, dst=0, group=group)
        out["reduce"] = r if RANK == 0 else torch.zeros(0)
        g = [torch.empty(4) for _ in range(SIZE)] if RANK == 0 else None
        dist.gather(mine, g, dst=0, group=group)
        out["gather"] = g if RANK == 0 else []
        s = torch.empty(2)
        dist.scatter(s, [torch.full((2,), float(r)) for r in range(SIZE)] if RANK == 0 else None,
                     src=0, group=group)
        out["scatter"] = s
        objects = [None] * SIZE
        dist.all_gather_object(objects, {"rank": RANK, "name": "x" * RANK}, group=group)
        out["objects"] = [torch.tensor([o["rank"], len(o["name"])]) for o in objects]
        return out
    ours, theirs = _both(groups, run)
    assert ours.keys() == theirs.keys()
    for key in ours:
        _same(ours[key], theirs[key])


def test_all_to_all_matches_gloo(groups):
    def run(group):
        # rank r sends (r + 1) rows to each rank; uneven splits on the receiving side
        sends = [RANK + 1] * SIZE
        receives = [r + 1 for r in range(SIZE)]
        data = torch.arange(sum(sends) * 3, dtype=torch.float32).view(-1, 3) + 100 * RANK
        got = torch.empty(sum(receives), 3)
        dist.all_to_all_single(got, data, receives, sends, group=group)
        lists = [torch.empty(2) for _ in range(SIZE)]
        dist.all_to_all(lists, [torch.full((2,), float(10 * RANK + r)) for r in range(SIZE)],
                        group=group)
        return [got] + lists
    _same(*_both(groups, run))


def test_send_and_receive(groups):
    ours, _ = groups
    if SIZE < 2:
        pytest.skip("needs two ranks")
    if RANK == 0:
        dist.send(torch.arange(5.), dst=1, group=ours, tag=7)
        got = torch.empty(3, dtype=torch.int64)
        sender = dist.recv(got, group=ours, tag=8)   # from any rank
        assert sender == 1 and torch.equal(got, torch.tensor([1, 2, 3]))
    elif RANK == 1:
        got = torch.empty(5)
        assert dist.recv(got, src=0, group=ours, tag=7) == 0
        assert torch.equal(got, torch.arange(5.))
        dist.send(torch.tensor([1, 2, 3]), dst=0, group=ours, tag=8)
    dist.barrier(group=ours)


def test_asynchronous_work_completes_its_future(groups):
    ours, _ = groups
    t = torch.full((1000,), float(RANK + 1))
    work = dist.all_reduce(t, group=ours, async_op=True)
    doubled = work.get_future().then(lambda f: f.value()[0] * 2)
    expected = float(SIZE * (SIZE + 1) / 2)
    assert torch.equal(doubled.wait(), torch.full((1000,), 2 * expected))
    assert work.wait() and work.is_completed()
    assert torch.equal(t, torch.full((1000,), expected))


def test_long_messages_are_chunked(groups, setting):
    setting(CHUNK_ENV, "7")   # MPI's count limit, as if it were 7 elements
    def run(group):
        t = torch.arange(50, dtype=torch.float64) * (RANK + 1)
        dist.all_reduce(t, group=group)
        out = torch.empty(50 * SIZE, dtype=torch.float64)
        dist.all_gather_into_tensor(out, t, group=group)
        sent = torch.arange(20 * SIZE, dtype=torch.float32) + RANK
        got = torch.empty(20 * SIZE)
        dist.all_to_all_single(got, sent, group=group)
        return [t, out, got]
    _same(*_both(groups, run))


def test_operations_are_traced(groups):
    ours, _ = groups
    before = trace.bytes_communicated()
    dist.all_reduce(torch.ones(256), group=ours)
    assert trace.bytes_communicated() - before == 1024


# --- PyTorch's own parallelism on the backend ---------------------------------------------------

def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()


def _batches(steps=3):
    out = []
    for step in range(steps):
        torch.manual_seed(100 + step)
        out.append(torch.randn(2 * SIZE, 8, dtype=torch.float64))
    return out


def _mine(x):
    return x[2 * RANK:2 * RANK + 2]


@pytest.mark.parametrize("hook", [None, "fp16", "powerSGD"])
def test_ddp_matches_gloo(groups, hook):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    def run(group):
        ddp = DDP(_model(), process_group=group)
        if hook == "fp16":
            ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
        elif hook == "powerSGD":
            state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=1,
                                                start_powerSGD_iter=2, random_seed=5)
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for x in _batches(4):
            ddp(_mine(x)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in ddp.parameters()]
    # fp16: gloo rounds each partial sum to 16 bits, MPI sums in float32 and rounds once
    _same(*_both(groups, run), atol=1e-3 if hook == "fp16" else 1e-12)


def _fully_sharded(mesh, reshard=True):
    from torch.distributed.fsdp import fully_shard
    model = _model()
    fully_shard(model[0], mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model


def _train_fsdp(mesh, reshard=True):
    model = _fully_sharded(mesh, reshard)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for x in _batches():
        model(_mine(x)).pow(2).sum().backward()   # FSDP2 averages the gradients
        opt.step()
        opt.zero_grad()
    return model


def _local_adam():
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for x in _batches():
        (model(x).pow(2).sum() / SIZE).backward()
        opt.step()
        opt.zero_grad()
    return model


@pytest.mark.parametrize("reshard", [True, False], ids=["zero3", "zero2"])
def test_fsdp2_matches_gloo_and_a_local_adam(groups, reshard):
    from torch.distributed.device_mesh import DeviceMesh

    def run(group):
        model = _train_fsdp(DeviceMesh.from_group(group, "cpu"), reshard)
        local = [p.to_local().detach().clone() for p in model.parameters()]
        full = [p.full_tensor().detach().clone() for p in model.parameters()]
        return local, full
    (ours_local, ours_full), (gloo_local, gloo_full) = _both(groups, run)
    _same(ours_local, gloo_local, atol=1e-12)
    _same(ours_full, gloo_full, atol=1e-12)
    for mine, reference in zip(ours_full, _local_adam().parameters()):
        torch.testing.assert_close(mine, reference.detach(), rtol=1e-12, atol=1e-12)
    assert sum(p.numel() for p in ours_local) <= sum(p.numel() for p in ours_full) // SIZE + 32


@pytest.mark.mpi(min_size=4)
def test_hsdp_on_a_two_dimensional_mesh_matches_gloo(groups):
    """Replicas over the nodes (or over halves of the world on one node), shards within."""
    from tensorplay_hpc.comm import NodeLayout
    from torch.distributed.device_mesh import DeviceMesh
    layout = NodeLayout(WORLD)
    several = len(layout.nodes) > 1 and layout.node_size and layout.contiguous
    per_node = layout.node_size if several else SIZE // 2
    mesh = torch.arange(SIZE).view(SIZE // per_node, per_node)

    def run(backend):
        # every rank makes every group, as torch.distributed asks
        shards = [dist.new_group(row.tolist(), backend=backend) for row in mesh]
        replicas = [dist.new_group(col.tolist(), backend=backend) for col in mesh.t()]
        row, col = RANK // per_node, RANK % per_node
        # names of their own: DeviceMesh may reuse a mesh of the same shape and names
        device_mesh = DeviceMesh.from_group([replicas[col], shards[row]], "cpu", mesh=mesh,
                                            mesh_dim_names=(f"{backend} replicate",
                                                            f"{backend} shard"))
        model = _train_fsdp(device_mesh)
        full = [p.full_tensor().detach().clone() for p in model.parameters()]
        for group in (replicas[col], shards[row]):   # the others are not this rank's
            dist.destroy_process_group(group)
        return full
    ours, theirs = run(BACKEND_NAME), run("gloo")
    _same(ours, theirs, atol=1e-12)
    for mine, reference in zip(ours, _local_adam().parameters()):
        torch.testing.assert_close(mine, reference.detach(), rtol=1e-12, atol=1e-12)


def test_dtensor_redistribution_matches_gloo(groups):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    def run(group):
        mesh = DeviceMesh.from_group(group, "cpu")
        torch.manual_seed(3)
        full = torch.randn(4 * SIZE, 2 * SIZE, dtype=torch.float64)
        rows = distribute_tensor(full, mesh, [Shard(0)])
        columns = rows.redistribute(mesh, [Shard(1)])
        replicated = columns.redistribute(mesh, [Replicate()])
        # each rank holds a term of a sum: reduce-scatter it, and all-reduce it
        partial = DTensor.from_local(full * (RANK + 1), mesh, [Partial()])
        scattered = partial.redistribute(mesh, [Shard(0)])
        summed = partial.redistribute(mesh, [Replicate()])
        return [rows.to_local(), columns.to_local(), replicated.to_local(),
                scattered.to_local(), summed.to_local(), full]
    ours, theirs = _both(groups, run)
    _same(ours, theirs, atol=1e-12)
    full = ours[-1]
    assert torch.equal(ours[0], full.chunk(SIZE, 0)[RANK])
    assert torch.equal(ours[1], full.chunk(SIZE, 1)[RANK])
    assert torch.equal(ours[2], full)
    torch.testing.assert_close(ours[4], full * (SIZE * (SIZE + 1) // 2))
    torch.testing.assert_close(ours[3], ours[4].chunk(SIZE, 0)[RANK])


def test_distributed_checkpoint_round_trip_and_another_world_size(groups, folder):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import DeviceMesh
    ours, _ = groups
    model = _train_fsdp(DeviceMesh.from_group(ours, "cpu"))
    state = get_model_state_dict(model)
    path = os.path.join(folder, "dcp")
    dcp.save(state, checkpoint_id=path, process_group=ours)
    expected = {k: v.full_tensor() for k, v in state.items()}
    # the same world size, into a fresh sharded model
    fresh = _fully_sharded(DeviceMesh.from_group(ours, "cpu"))
    fresh_state = get_model_state_dict(fresh)
    dcp.load(fresh_state, checkpoint_id=path, process_group=ours)
    for key, value in fresh_state.items():
        assert torch.equal(value.full_tensor(), expected[key]), key
    # half the ranks (one when alone), into a model sharded over them
    members = list(range(max(1, SIZE // 2)))
    half = dist.new_group(members, backend=BACKEND_NAME)
    if RANK in members:
        smaller = _fully_sharded(DeviceMesh.from_group(half, "cpu"))
        smaller_state = get_model_state_dict(smaller)
        dcp.load(smaller_state, checkpoint_id=path, process_group=half)
        for key, value in smaller_state.items():
            assert value.to_local().numel() < value.numel() or len(members) == 1
            assert torch.equal(value.full_tensor(), expected[key]), key
        dist.destroy_process_group(half)
    # one rank alone, into a plain unsharded model
    plain = {k: torch.zeros_like(v) for k, v in expected.items()}
    dcp.load(plain, checkpoint_id=path, no_dist=True)
    for key, value in plain.items():
        assert torch.equal(value, expected[key]), key
    dist.barrier(group=ours)


def test_fsdp2_checkpoint_loads_each_ranks_rows_one_batch_at_a_time(groups, folder,
                                                                     monkeypatch):
    """Our HDF5 checkpoint of an FSDP2 model and its Adam: loading keeps no more than a batch of
    whole values in memory (numpy buffers, which tracemalloc sees) and continues exactly."""
    import tracemalloc
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from tensorplay_hpc import checkpoint
    from tensorplay_hpc.checkpoint import restore
    mesh = DeviceMesh.from_group(groups[0], "cpu")

    def sharded():
        torch.manual_seed(RANK)   # each rank's start differs: the load must overwrite it
        model = nn.Sequential(*[nn.Linear(128, 128, dtype=torch.float64) for _ in range(8)])
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.Adam(model.parameters(), lr=0.01)

    def step(model, optimizer):
        x = torch.randn(8, 128, dtype=torch.float64, generator=torch.Generator().manual_seed(RANK))
        model(x).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    model, optimizer = sharded()
    step(model, optimizer)
    path = checkpoint.save(os.path.join(folder, "fsdp2.h5"), model, optimizer)
    fresh, fresh_optimizer = sharded()
    whole = 3 * sum(p.numel() * p.element_size() for p in model.parameters())   # and 2 moments
    monkeypatch.setattr(restore, "READ_BATCH_BYTES", 128 * 128 * 8)   # one weight
    tracemalloc.start()
    checkpoint.load(path, model=fresh, optimizer=fresh_optimizer)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < whole / 4, (peak, whole)
    for mine, saved in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(mine.full_tensor(), saved.full_tensor())
    step(model, optimizer)
    step(fresh, fresh_optimizer)
    for mine, saved in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(mine.to_local(), saved.to_local())


def test_torch_zero_redundancy_optimizer_matches_gloo(groups):
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO

    def run(group):
        model = _model()
        opt = TorchZeRO(model.parameters(), torch.optim.Adam, process_group=group, lr=0.05)
        for x in _batches():
            model(_mine(x)).pow(2).sum().backward()
            for p in model.parameters():
                dist.all_reduce(p.grad, group=group)
            opt.step()
            opt.zero_grad()
        opt.consolidate_state_dict(to=0)
        state = opt.state_dict() if RANK == 0 else None
        exp_avg = [] if state is None else [s["exp_avg"] for s in state["state"].values()]
        return [p.detach().clone() for p in model.parameters()] + exp_avg
    _same(*_both(groups, run), atol=1e-12)


# --- dist.init_process_group("mpi4py") in a job of its own ---------------------------------------

JOB = str(SUPPORT / "torch_backend_job.py")


@only_in_single_rank_run
def test_init_process_group_needs_no_address():
    run = mpiexec(2, [JOB, "main"], timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "ALL OK on 2 ranks" in run.stdout


@only_in_single_rank_run
def test_init_process_group_across_nodes(simulated_nodes):
    run = mpiexec(4, [JOB, "main"], timeout=240, nodes=simulated_nodes)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "ALL OK on 4 ranks" in run.stdout


@only_in_single_rank_run
def test_init_process_group_over_a_part_of_the_world_and_again():
    run = mpiexec(4, [JOB, "on_parts"], timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "PARTS OK on 4 ranks" in run.stdout


@only_in_single_rank_run
def test_init_process_group_refuses_a_world_size_mpi_did_not_start():
    run = mpiexec(2, [JOB, "wrong_world_size"], timeout=120)
    assert run.returncode != 0
    assert "world_size=99 but MPI says 2" in run.stderr


@only_in_single_rank_run
def test_watchdog_names_the_rank_missing_from_a_backend_collective():
    run = mpiexec(2, [JOB, "one_rank_all_reduce"], timeout=120,
                  env=dict(os.environ, TENSORPLAY_HPC_COLLECTIVE_TIMEOUT="5"))
    ended = time.time()
    assert run.returncode != 0 and "not reached" not in run.stdout, run.stdout + run.stderr
    assert "collective timeout: all_reduce" in run.stderr
    assert "ranks not arrived: [1]." in run.stderr, run.stderr
    called = float(re.search(r"calling at ([0-9.]+)", run.stdout).group(1))
    assert ended - called < 15
