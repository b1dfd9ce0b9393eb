"""Remote references over MPI windows and distributed autograd: values read and gradients sent
one-sidedly, checked against numbers computed by hand."""
import pytest
import torch
from mpi4py import MPI

from tensorplay_hpc import comm
from tensorplay_hpc.distributed import autograd, rma

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64]


def owned(rank):
    """Rank r owns r tensors (rank 0 none): tensor i is i + 1 long and holds 100 r + i + j."""
    return [(torch.arange(i + 1) + 100 * rank + i).to(DTYPES[i % len(DTYPES)])
            for i in range(rank)]


@pytest.fixture(params=[None, "3"], ids=["whole", "chunked"])
def chunking(request, monkeypatch):
    """Run once as is and once with every window operation split into 3-element pieces."""
    if request.param:
        monkeypatch.setenv(comm.CHUNK_ENV, request.param)


def test_share_gives_every_rank_references_to_all_tensors(world, chunking):
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


def test_owner_tensors_live_in_window_memory(world):
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


def test_share_over_a_subcommunicator(world):
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


def test_backward_sends_each_trainers_gradients_to_its_own_slot(world, chunking):
    rank = world.Get_rank()
    mine = [torch.arange(3, dtype=torch.float32) + rank, torch.ones(2, dtype=torch.float16)]
    with rma.share(mine) as shared:
        world.Barrier()
        with autograd.context() as context_id:
            assert context_id >> 48 == rank
            values = [ref.to_here() for ref in shared.refs]
            assert all(v.requires_grad and v.is_leaf for v in values)
            # every rank trains every tensor at once; rank r's gradient of tensor k is
            # (r + 1) * value (from 0.5 (r + 1) x^2) plus, in a second pass, 1
            loss = sum(((v.float() ** 2) * 0.5 * (rank + 1)).sum() for v in values)
            autograd.backward(context_id, [loss])
            autograd.backward(context_id, [sum(v.float().sum() for v in values)])
            grads = autograd.get_gradients(context_id)
            assert set(grads) == set(shared.refs)
            for ref in shared.refs:
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


def test_fetching_one_tensor_twice_sums_its_gradients(world):
    rank = world.Get_rank()
    with rma.share([torch.tensor([1.0, 2.0])] if rank == 0 else []) as shared:
        [ref] = shared.refs
        with autograd.context() as context_id:
            a, b = ref.to_here(), ref.to_here()
            autograd.backward(context_id, [(a * 2).sum() + (b * b).sum()])
            assert torch.equal(autograd.get_gradients(context_id)[ref], torch.tensor([4.0, 6.0]))
        world.Barrier()


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
