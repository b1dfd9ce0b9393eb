"""Remote references over MPI windows and served windows, and distributed autograd: values read
and gradients sent one-sidedly, checked against numbers computed by hand; the transport chosen,
and the errors when none works."""
import os

import pytest
import torch
from mpi4py import MPI

from lanes import LANE
from launch import mpiexec, only_in_single_rank_run
from tensorplay_hpc import comm
from tensorplay_hpc.comm import capabilities, fault_tolerance, library
from tensorplay_hpc.distributed import autograd, rma

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64]


def owned(rank):
    """Rank r owns r tensors (rank 0 none): tensor i is i + 1 long and holds 100 r + i + j."""
    return [(torch.arange(i + 1) + 100 * rank + i).to(DTYPES[i % len(DTYPES)])
            for i in range(rank)]


@pytest.fixture(params=[None, "3"], ids=["whole", "chunked"])
def chunking(request, setting):
    """Run once as is and once with every window operation split into 3-element pieces."""
    if request.param:
        setting(comm.CHUNK_ENV, request.param)


@pytest.fixture(params=["auto", "served"])
def transport(request, monkeypatch):
    """The transport the group's capabilities give, and served windows forced."""
    if request.param != "auto":
        monkeypatch.setenv(capabilities.TRANSPORT_ENV, request.param)
    return request.param


def automatic_transport(world):
    """What ``share`` must choose over ``world`` by itself."""
    if capabilities.within_one_node(world):
        return "shared"
    return "mpi" if capabilities.one_sided_works(world) else "served"


def test_transport_follows_the_capabilities_or_the_override(world, transport):
    expected = automatic_transport(world) if transport == "auto" else transport
    with rma.share([torch.zeros(1)]) as shared:
        assert shared.transport == expected
        assert shared.values.shared_memory == (expected == "shared")


def test_share_gives_every_rank_references_to_all_tensors(world, chunking, transport):
    rank, size = world.Get_rank(), world.Get_size()
    mine = owned(rank)
    with rma.share(mine) as shared:
        assert len(shared.refs) == sum(range(size))
        assert shared.refs == [ref for r in range(size) for ref in shared.refs_of(r)]
        for owner in range(size):
            expected = owned(owner)
            refs = shared.refs_of(owner)
            assert len(refs) == len(expected)
            for ref, value in zip(refs, expected):
                assert ref.owner() == owner
                assert ref.is_owner() == (owner == rank)
                assert ref.shape == value.shape and ref.dtype == value.dtype
                fetched = ref.to_here()
                assert fetched.dtype == value.dtype and torch.equal(fetched, value)
                assert not fetched.requires_grad
        for ref, tensor in zip(shared.refs_of(rank), mine):
            assert ref.local_value() is tensor
        for ref in shared.refs:
            if not ref.is_owner():
                with pytest.raises(RuntimeError, match=f"rank {rank}, which does not own it"):
                    ref.local_value()


def test_owner_tensors_live_in_window_memory(world, transport):
    rank, size = world.Get_rank(), world.Get_size()
    weight = torch.nn.Parameter(torch.full((4,), float(rank)))
    with rma.share([weight]) as shared:
        assert isinstance(weight, torch.nn.Parameter) and weight.requires_grad
        with torch.no_grad():
            weight.add_(10)  # the owner writes its tensor; the window sees it
        world.Barrier()
        for owner, [ref] in enumerate(shared.refs_of(r) for r in range(size)):
            assert torch.equal(ref.to_here(), torch.full((4,), owner + 10.0))
        world.Barrier()
    assert torch.equal(weight.detach(), torch.full((4,), rank + 10.0))  # usable after close
    weight.data.add_(1)
    assert weight[0].item() == rank + 11.0


def test_share_over_a_subcommunicator(world, transport):
    rank = world.Get_rank()
    half = world.Split(rank % 2, rank)
    try:
        with rma.share([torch.tensor([float(rank)])], process_group=half) as shared:
            members = half.allgather(rank)
            assert [ref.to_here().item() for ref in shared.refs] == [float(m) for m in members]
    finally:
        half.Free()


def test_share_rejects_gpu_like_and_repeated_tensors(world):
    rank = world.Get_rank()
    with pytest.raises(TypeError, match=f"tensor 0 on rank {rank} must be a CPU torch.Tensor"):
        rma.share(["not a tensor"])
    t = torch.zeros(2)
    with pytest.raises(ValueError, match=f"rank {rank} lists the same tensor twice"):
        rma.share([t, t])


def test_progress_thread_and_poll(world):
    assert MPI.Query_thread() == MPI.THREAD_MULTIPLE
    rank = world.Get_rank()
    with rma.share([torch.tensor([rank * 2.0])], progress_thread=True) as shared:
        rma.poll()
        assert [ref.to_here().item() for ref in shared.refs] == [
            2.0 * r for r in range(world.Get_size())]
        world.Barrier()


def test_a_progress_thread_runs_by_default_where_the_library_needs_one(world, transport):
    """The MPICH lineage serves one-sided operations only inside the target's MPI calls, and
    every library does across nodes: each rank then gets a progress thread unless asked not
    to; Open MPI's shared-memory windows need none, nor do served windows (they have a service
    thread)."""
    mpich_lineage = LANE in ("mpich", "impi")
    assert library.target_progress_needed() == mpich_lineage
    assert library.target_progress_needed(across_nodes=True)
    with rma.share([torch.ones(2)]) as shared:
        assert shared.progress_thread == (shared.transport == "mpi" or (
            shared.transport == "shared" and mpich_lineage))
    with rma.share([torch.ones(2)], progress_thread=False) as shared:
        assert not shared.progress_thread


@pytest.mark.scale   # every trainer sends to every owner at once
def test_backward_sends_each_trainers_gradients_to_its_own_slot(world, chunking, transport):
    rank = world.Get_rank()
    mine = [(torch.arange(3, dtype=torch.float32) + rank).requires_grad_(),
            torch.ones(2, dtype=torch.float16, requires_grad=True),
            torch.full((2,), 5.0)]  # frozen: it does not require grad
    with rma.share(mine) as shared:
        trained = [ref for ref in shared.refs if ref.index < 2]
        assert [ref.requires_grad for ref in shared.refs] == [True, True, False] * world.Get_size()
        world.Barrier()
        with autograd.context() as context_id:
            assert context_id >> 48 == rank
            values = [ref.to_here() for ref in shared.refs]
            assert [v.requires_grad for v in values] == [ref.requires_grad for ref in shared.refs]
            assert all(v.is_leaf for v in values)
            # every rank trains every tensor at once; rank r's gradient of tensor k is
            # (r + 1) * value (from 0.5 (r + 1) x^2) plus, in a second pass, 1
            loss = sum(((v.float() ** 2) * 0.5 * (rank + 1)).sum() for v in values)
            autograd.backward(context_id, [loss])
            autograd.backward(context_id, [sum(v.float().sum() for v in values)])
            grads = autograd.get_gradients(context_id)
            assert set(grads) == set(trained)  # none for the frozen tensors
            for ref in trained:
                expected = ref.to_here().detach().float() * (rank + 1) + 1
                assert grads[ref].dtype == ref.dtype
                assert torch.equal(grads[ref], expected.to(ref.dtype))
        world.Barrier()
        # a new context starts from zero, not from the old context's gradients
        with autograd.context() as context_id:
            first = shared.refs[0].to_here()
            autograd.backward(context_id, [first.sum() * 3])
            assert torch.equal(autograd.get_gradients(context_id)[shared.refs[0]],
                               torch.full((3,), 3.0))
        world.Barrier()


def test_fetching_one_tensor_twice_sums_its_gradients(world, transport):
    rank = world.Get_rank()
    with rma.share([torch.tensor([1.0, 2.0], requires_grad=True)] if rank == 0 else []) as shared:
        [ref] = shared.refs
        with autograd.context() as context_id:
            a, b = ref.to_here(), ref.to_here()
            autograd.backward(context_id, [(a * 2).sum() + (b * b).sum()])
            assert torch.equal(autograd.get_gradients(context_id)[ref], torch.tensor([4.0, 6.0]))
        world.Barrier()


def test_use_after_close_is_an_error(world, transport):
    rank = world.Get_rank()
    closed = rf"^SharedTensors is closed \(rank {rank}\): its windows were freed by close\(\)"
    weight = torch.full((2,), float(rank), requires_grad=True)
    shared = rma.share([weight])
    [ref] = shared.refs_of(rank)
    with autograd.context() as context_id:
        value = ref.to_here()
        world.Barrier()
        shared.close()
        shared.close()  # closing again does nothing
        for call in (ref.to_here, ref.local_value,
                     lambda: autograd.backward(context_id, [value.sum()])):
            with pytest.raises(RuntimeError, match=closed):
                call()
    with pytest.raises(RuntimeError, match=closed):
        shared.new_window(8)
    assert torch.equal(weight.detach(), torch.full((2,), float(rank)))  # the owner's tensor lives


def test_unknown_context_and_nesting_are_errors(world):
    rank = world.Get_rank()
    with pytest.raises(ValueError, match="unknown distributed autograd context id 987654"):
        autograd.backward(987654, [torch.zeros((), requires_grad=True)])
    with pytest.raises(ValueError, match="987654"):
        autograd.get_gradients(987654)
    with autograd.context() as context_id:
        with pytest.raises(RuntimeError, match=f"{context_id} is already open on world rank "
                                               f"{rank}"):
            with autograd.context():
                pass
    with pytest.raises(ValueError, match=str(context_id)):
        autograd.get_gradients(context_id)  # closed


def test_an_unknown_transport_is_an_error_on_every_rank(world, monkeypatch):
    monkeypatch.setenv(capabilities.TRANSPORT_ENV, "carrier-pigeon")
    with pytest.raises(ValueError, match=rf"failed on {world.Get_size()} of {world.Get_size()} "
                                         r"ranks: rank 0: .*'carrier-pigeon'.*auto, shared, mpi, "
                                         "served"):
        rma.share([torch.zeros(1)])


def test_recovery_enabled_on_some_ranks_only_is_an_error_on_every_rank(world):
    """Recovery decides the transport: a rank that enabled it alone would make other windows
    than the rest."""
    if world.Get_size() < 2:
        pytest.skip("needs two ranks")
    if world.Get_rank() == 1:
        fault_tolerance.enable()
    try:
        with pytest.raises(ValueError, match=r"fault_tolerance.enable\(\): ranks \[1\] differ "
                                             r"from rank 0 .*rank 0 has \('recovery', False\), "
                                             r"rank 1 has \('recovery', True\)"):
            rma.share([torch.zeros(1)])
    finally:
        fault_tolerance.disable()


def test_shared_memory_forced_across_nodes_is_an_error_on_every_rank(world, monkeypatch):
    if capabilities.within_one_node(world):
        pytest.skip("the ranks share a node")
    monkeypatch.setenv(capabilities.TRANSPORT_ENV, "shared")
    with pytest.raises(rma.TransportError, match="=shared needs every rank on one node"):
        rma.share([torch.zeros(1)])


BELOW_MULTIPLE_JOB = """
import os, torch
from mpi4py import MPI
from tensorplay_hpc.distributed import rma
rank = MPI.COMM_WORLD.Get_rank()
outcomes = []
for transport, progress_thread in (("auto", rank == 0), ("served", False)):
    os.environ["TENSORPLAY_HPC_RMA_TRANSPORT"] = transport
    try:
        rma.share([torch.zeros(2)], progress_thread=progress_thread).close()
        outcomes.append(f"rank {rank} {transport}: shared")
    except rma.TransportError as error:
        outcomes.append(f"rank {rank} {transport}: {error}")
everyone = MPI.COMM_WORLD.gather(outcomes)
if rank == 0:
    print("\\n".join(sum(everyone, [])), flush=True)
"""


@only_in_single_rank_run
def test_below_thread_multiple_every_rank_raises_before_any_window():
    """A progress thread on rank 0 only, and served windows, at MPI_THREAD_SERIALIZED: both
    ranks raise the same error (this used to leave rank 1 waiting in a barrier forever)."""
    result = mpiexec(2, ["-c", BELOW_MULTIPLE_JOB], timeout=120,
                     env={**os.environ, "MPI4PY_RC_THREAD_LEVEL": "serialized"})
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("rank ")]
    progress = ("rma.share(progress_thread=True) needs MPI_THREAD_MULTIPLE, but rank 0 runs at "
                "MPI_THREAD_SERIALIZED: run MPI at MPI_THREAD_MULTIPLE")
    served = ("rma.share: no transport works: the served transport needs MPI_THREAD_MULTIPLE, but "
              "rank 0 runs at MPI_THREAD_SERIALIZED, rank 1 runs at MPI_THREAD_SERIALIZED: run MPI "
              "at MPI_THREAD_MULTIPLE")
    assert [line.split(": ", 1)[0] for line in lines] == [
        "rank 0 auto", "rank 0 served", "rank 1 auto", "rank 1 served"]
    for line in lines:
        assert line.split(": ", 1)[1].startswith(progress if " auto" in line else served), line
