"""The communication layer: every collective, every dtype, against values computed by hand."""
import os

import pytest
import torch
from mpi4py import MPI

from tensorplay_hpc import comm
from tensorplay_hpc.bench.network import bytes_sent
from tensorplay_hpc.comm import ReduceOp, collectives, staging, worker
from tensorplay_hpc.comm.chunking import chunk_elements, chunks

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16,
          torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8]
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@pytest.fixture
def group():
    pg = comm.ProcessGroup()
    yield pg
    pg.close()


@pytest.fixture(params=[None, "3"], ids=["whole", "chunked"])
def chunking(request, setting):
    """Run each test once as is and once with every message split into 3-element chunks."""
    if request.param:
        setting(comm.CHUNK_ENV, request.param)
    return request.param


def rank_tensor(rank, n, dtype):
    """Rank r holds [r+1, r+2, ..., r+n]."""
    return (torch.arange(n) + rank + 1).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_reduce_sum_every_dtype(group, chunking, dtype):
    size = group.size
    t = rank_tensor(group.rank, 7, dtype)
    comm.all_reduce(t, group.comm)
    # sum over r of (r + 1 + i) = size * (size + 1) / 2 + size * i
    expected = torch.tensor([size * (size + 1) // 2 + size * i for i in range(7)]).to(dtype)
    assert t.dtype == dtype
    assert torch.equal(t, expected)


@pytest.mark.parametrize("op,expected", [
    (ReduceOp.MAX, lambda size, i: size + i),
    (ReduceOp.MIN, lambda size, i: 1 + i),
    (ReduceOp.PRODUCT, lambda size, i: int(torch.arange(1 + i, size + 1 + i).prod())),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_all_reduce_other_ops(group, chunking, op, expected, dtype):
    t = rank_tensor(group.rank, 4, dtype)
    comm.all_reduce(t, group.comm, op)
    assert t.tolist() == [expected(group.size, i) for i in range(4)]


@pytest.mark.parametrize("dtype", FLOATS)
def test_all_reduce_average(group, chunking, dtype):
    t = torch.full((5,), 2.0 * group.rank, dtype=dtype)
    comm.all_reduce(t, group.comm, ReduceOp.AVG)
    assert t.tolist() == [float(group.size - 1)] * 5   # mean of 0, 2, ..., 2(size-1)


def test_all_reduce_bool(group, chunking):
    t = torch.tensor([group.rank == 0, False, True])
    comm.all_reduce(t, group.comm)              # sum of bools is logical or
    assert t.tolist() == [True, False, True]
    t = torch.tensor([group.rank == 0, True])
    comm.all_reduce(t, group.comm, ReduceOp.MIN)  # min is logical and
    assert t.tolist() == [group.size == 1, True]


def test_all_reduce_average_rejects_integers(group):
    with pytest.raises(TypeError, match="AVG"):
        comm.all_reduce(torch.ones(2, dtype=torch.int64), group.comm, ReduceOp.AVG)


def test_bfloat16_sum_is_computed_in_float32(group):
    # 256 + 1 + 1 ... : in bfloat16 arithmetic 256 + 1 rounds back to 256 at every step.
    t = torch.tensor([256.0 if group.rank == 0 else 1.0], dtype=torch.bfloat16)
    comm.all_reduce(t, group.comm)
    assert t.item() == float(torch.tensor(256.0 + group.size - 1).to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVG])
def test_sixteen_bit_floats_summed_in_their_own_type(group, chunking, dtype, op):
    t = rank_tensor(group.rank, 7, dtype)
    comm.all_reduce(t, group.comm, op, in_dtype=True)
    total = sum(rank_tensor(r, 7, torch.float64) for r in range(group.size))
    expected = total / group.size if op is ReduceOp.AVG else total
    assert t.dtype == dtype and torch.equal(t, expected.to(dtype))
    with pytest.raises(ValueError, match=f"only summed or averaged in their own type, not MAX "
                                         f"\\(rank {group.rank}\\)"):
        comm.all_reduce(t, group.comm, ReduceOp.MAX, in_dtype=True)


@pytest.mark.skipif(not os.environ.get("TENSORPLAY_TEST_NODES"),
                    reason="counts bytes between simulated nodes")
@pytest.mark.mpi(min_size=2)
def test_sixteen_bit_sums_in_their_own_type_send_half_the_bytes_between_nodes(group):
    layout = comm.NodeLayout(group.comm)
    if len(layout.nodes) < 2:
        pytest.skip("the ranks are on one node")

    def sent(in_dtype):
        tensor = torch.ones(1 << 20, dtype=torch.bfloat16)
        group.comm.Barrier()
        before = bytes_sent()
        for _ in range(3):
            comm.all_reduce(tensor, group.comm, in_dtype=in_dtype)
        group.comm.Barrier()
        mine = bytes_sent() - before if layout.node_rank == 0 else 0
        return group.comm.allreduce(mine)
    in_float32, in_bfloat16 = sent(False), sent(True)
    assert 0.45 < in_bfloat16 / in_float32 < 0.55, (in_bfloat16, in_float32)


def test_all_reduce_non_contiguous(group, chunking):
    base = torch.zeros(4, 6)
    view = base[:, ::2]                       # every other column: not contiguous
    assert not view.is_contiguous()
    view.copy_(torch.full((4, 3), float(group.rank + 1)))
    comm.all_reduce(view, group.comm)
    total = group.size * (group.size + 1) / 2
    assert torch.equal(base[:, ::2], torch.full((4, 3), total))
    assert torch.equal(base[:, 1::2], torch.zeros(4, 3))   # untouched columns


@pytest.mark.parametrize("dtype", DTYPES + [torch.bool])
def test_broadcast_every_dtype(group, chunking, dtype):
    root = group.size - 1
    t = rank_tensor(group.rank, 8, dtype) if dtype != torch.bool else torch.tensor(
        [group.rank == root, group.rank != root] * 4)
    comm.broadcast(t, group.comm, root)
    expected = rank_tensor(root, 8, dtype) if dtype != torch.bool else torch.tensor([True, False] * 4)
    assert torch.equal(t, expected)


def test_broadcast_non_contiguous(group, chunking):
    t = torch.full((3, 4), float(group.rank)).t()
    comm.broadcast(t, group.comm, 0)
    assert torch.equal(t, torch.zeros(4, 3))


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_gather(group, chunking, dtype):
    out = torch.zeros(group.size * 3, dtype=dtype)
    comm.all_gather(out, rank_tensor(group.rank, 3, dtype), group.comm)
    expected = torch.cat([rank_tensor(r, 3, dtype) for r in range(group.size)])
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_all_gather_v_in_place_and_from_input(group, chunking, dtype):
    counts = [r + 1 for r in range(group.size)]   # rank r owns r + 1 elements
    start = sum(counts[:group.rank])
    expected = torch.cat([torch.full((r + 1,), r + 1) for r in range(group.size)]).to(dtype)

    out = torch.zeros(sum(counts), dtype=dtype)
    out[start:start + counts[group.rank]] = group.rank + 1
    comm.all_gather_v(out, counts, group.comm)
    assert torch.equal(out, expected)

    out = torch.zeros(sum(counts), dtype=dtype)
    mine = torch.full((counts[group.rank],), group.rank + 1).to(dtype)
    comm.all_gather_v(out, counts, group.comm, input=mine)
    assert torch.equal(out, expected)


def test_all_gather_v_with_empty_parts(group, chunking):
    counts = [0 if r % 2 else 2 for r in range(group.size)]
    out = torch.zeros(sum(counts))
    mine = torch.full((counts[group.rank],), float(group.rank))
    comm.all_gather_v(out, counts, group.comm, input=mine)
    assert out.tolist() == [float(r) for r in range(group.size) if r % 2 == 0 for _ in range(2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int32])
def test_reduce_scatter(group, chunking, dtype):
    size, rank = group.size, group.rank
    counts = [2 + r for r in range(size)]
    # Every rank sends [0, 1, 2, ...] * (rank + 1); the sum is [0, 1, 2, ...] * size(size+1)/2.
    send = (torch.arange(sum(counts)) * (rank + 1)).to(dtype)
    out = torch.zeros(counts[rank], dtype=dtype)
    comm.reduce_scatter(out, send, group.comm, counts)
    start = sum(counts[:rank])
    expected = (torch.arange(start, start + counts[rank]) * (size * (size + 1) // 2)).to(dtype)
    assert torch.equal(out, expected)


def test_reduce_scatter_equal_parts_average(group, chunking):
    send = torch.full((group.size * 2,), float(group.rank))
    out = torch.empty(2)
    comm.reduce_scatter(out, send, group.comm, op=ReduceOp.AVG)
    assert out.tolist() == [(group.size - 1) / 2] * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_gather_to_one_rank(group, chunking, dtype):
    root = group.size // 2
    mine = torch.full((group.rank + 1,), group.rank % 2).to(dtype)
    result = comm.gather(mine, group.comm, root)
    if group.rank == root:
        expected = torch.cat([torch.full((r + 1,), r % 2) for r in range(group.size)]).to(dtype)
        assert torch.equal(result, expected)
    else:
        assert result is None


def test_empty_tensors(group, chunking):
    empty = torch.empty(0)
    comm.all_reduce(empty, group.comm)
    comm.broadcast(empty, group.comm, 0)
    out = torch.empty(0)
    comm.all_gather(out, empty, group.comm)
    comm.all_gather_v(out, [0] * group.size, group.comm)
    result = comm.gather(empty, group.comm, 0)
    assert empty.numel() == 0 and out.numel() == 0
    assert group.rank != 0 or result.numel() == 0


def test_nonblocking_forms(group, chunking):
    size, rank = group.size, group.rank
    a = torch.full((10,), float(rank))
    b = torch.full((4,), float(rank))
    out = torch.zeros(3 * size)
    rs_out = torch.zeros(1)
    works = [
        comm.all_reduce(a, group.comm, async_op=True),
        comm.broadcast(b, group.comm, size - 1, async_op=True),
        comm.all_gather_v(out, [3] * size, group.comm, input=torch.full((3,), float(rank)),
                          async_op=True),
        comm.reduce_scatter(rs_out, torch.ones(size), group.comm, async_op=True),
    ]
    assert all(isinstance(w, comm.Work) for w in works)
    for w in works:
        assert w.wait()
        assert w.is_completed()
    assert a.tolist() == [size * (size - 1) / 2] * 10
    assert b.tolist() == [float(size - 1)] * 4
    assert out.tolist() == [float(r) for r in range(size) for _ in range(3)]
    assert rs_out.tolist() == [float(size)]


def test_coalesced_mixed_dtypes(group, chunking):
    tensors = [torch.full((3,), 1.5, dtype=torch.bfloat16), torch.full((2, 2), float(group.rank)),
               torch.full((1,), group.rank, dtype=torch.int64), torch.full((2,), 0.25, dtype=torch.float16)]
    comm.all_reduce_coalesced(tensors, group.comm, ReduceOp.SUM)
    size = group.size
    assert tensors[0].dtype == torch.bfloat16 and tensors[0].tolist() == [1.5 * size] * 3
    assert tensors[1].tolist() == [[size * (size - 1) / 2] * 2] * 2
    assert tensors[2].tolist() == [size * (size - 1) // 2]
    assert tensors[3].tolist() == [0.25 * size] * 2

    tensors = [torch.full((2,), float(group.rank)), torch.full((3,), group.rank, dtype=torch.int8)]
    comm.broadcast_coalesced(tensors, group.comm, root=0)
    assert tensors[0].tolist() == [0.0, 0.0] and tensors[1].tolist() == [0, 0, 0]


@pytest.mark.parametrize("nonblocking", [None, "thread", "requests"],
                         ids=["streamed", "queued", "requests"])
def test_coalesced_streams_pieces(group, setting, monkeypatch, nonblocking):
    """With 64-byte pieces (16 float32 elements): small tensors packed a piece at a time, large
    ones reduced in their own memory (float32), through a float32 piece (bfloat16), or staged
    (not contiguous); every rank ends with the exact averages and the tensors keep storage.
    Started nonblocking, the same calls run on the communicator's worker, or as MPI requests
    one flat buffer per dtype."""
    setting(comm.PIECE_ENV, "64")
    async_op = nonblocking is not None
    if async_op:
        setting(worker.NONBLOCKING_ENV, nonblocking)
    r = float(group.rank)
    tensors = [torch.full((5,), r), torch.arange(40.) + r, torch.full((7,), 2 * r),
               torch.full((9,), r), torch.empty(0), (torch.arange(60.) + r).view(6, 10).t(),
               (torch.arange(50.) + r).to(torch.bfloat16), torch.full((3,), r, dtype=torch.bfloat16),
               torch.full((14,), r)]
    storages = [t.data_ptr() for t in tensors]
    calls = []
    real = collectives.all_reduce

    def recording(tensor, *args, **kwargs):
        calls.append((tensor.numel(), tensor.data_ptr() in storages))
        return real(tensor, *args, **kwargs)
    monkeypatch.setattr(collectives, "all_reduce", recording)
    work = comm.all_reduce_coalesced(tensors, group.comm, ReduceOp.AVG, async_op=async_op)
    if async_op:
        work.wait()
    if nonblocking == "requests":
        assert calls == [(135, False), (53, False)]      # one flat buffer per dtype
    else:   # float32: 40 in place; 5 + 7 packed; 60 (transposed) given whole to all_reduce,
        # which stages it; 9 + 0 packed; 14 alone in its piece, in place. bfloat16: 50 through
        # the piece, 16 at a time; 3 packed (converted to float32)
        assert calls == [(40, True), (12, False), (60, True), (9, False), (14, True),
                         (16, False), (16, False), (16, False), (2, False), (3, False)]
    mean = (group.size - 1) / 2
    assert tensors[0].tolist() == [mean] * 5
    assert tensors[1].tolist() == (torch.arange(40.) + mean).tolist()
    assert tensors[2].tolist() == [2 * mean] * 7 and tensors[3].tolist() == [mean] * 9
    assert tensors[4].numel() == 0
    assert tensors[5].tolist() == (torch.arange(60.) + mean).view(6, 10).t().tolist()
    assert tensors[6].tolist() == (torch.arange(50.) + mean).to(torch.bfloat16).tolist()
    assert tensors[7].tolist() == [mean] * 3
    assert tensors[8].tolist() == [mean] * 14
    assert [t.data_ptr() for t in tensors] == storages


def test_flat_buffer_views():
    tensors = [torch.arange(6.).view(2, 3), torch.tensor([7.0]), torch.empty(0), torch.ones(2, 2)]
    flat = comm.FlatBuffer.pack(tensors)
    assert flat.offsets == [0, 6, 7, 7]
    assert flat.buffer.tolist() == [0, 1, 2, 3, 4, 5, 7, 1, 1, 1, 1]
    flat.buffer.mul_(2)                       # views see the buffer
    assert flat.views[0].tolist() == [[0, 2, 4], [6, 8, 10]]
    outs = [torch.zeros_like(t) for t in tensors]
    flat.copy_to(outs)
    assert outs[3].tolist() == [[2, 2], [2, 2]]
    with pytest.raises(ValueError, match="elements"):
        comm.FlatBuffer([torch.Size([3])], torch.float32, buffer=torch.zeros(4))


def test_group_by_dtype_device():
    ts = [torch.zeros(1), torch.zeros(1, dtype=torch.bfloat16), torch.zeros(2)]
    groups = comm.group_by_dtype_device(ts)
    assert list(groups.values()) == [[0, 2], [1]]


def test_chunks():
    assert list(chunks(10, 4)) == [(0, 4), (4, 4), (8, 2)]
    assert list(chunks(0, 4)) == [(0, 0)]


def test_chunk_limit_from_environment(setting):
    assert chunk_elements() == 2**31 - 1
    setting(comm.CHUNK_ENV, "5")
    assert chunk_elements() == 5
    setting(comm.CHUNK_ENV, "0")
    with pytest.raises(ValueError, match=comm.CHUNK_ENV):
        chunk_elements()


def test_contiguous_cpu_tensors_are_zero_copy():
    t = torch.ones(4)
    staged = staging.Staged(t)
    assert staged.work is t and not staged.staged
    assert staging.memory(t).address == t.data_ptr()


def test_host_staging_path_copies_in_and_out(group, monkeypatch, chunking):
    """The path GPU tensors take when MPI is not CUDA-aware, run on CPU tensors."""
    monkeypatch.setattr(staging, "needs_host_copy", lambda tensor: True)
    monkeypatch.setattr(staging, "NATIVE", {})
    t = torch.full((5,), float(group.rank + 1))
    staged = staging.Staged(t)
    assert staged.staged and staged.work is not t and staged.work.data_ptr() != t.data_ptr()
    comm.all_reduce(t, group.comm)
    assert t.tolist() == [group.size * (group.size + 1) / 2] * 5
    h = torch.full((3,), 0.5 * group.rank, dtype=torch.bfloat16)
    comm.broadcast(h, group.comm, group.size - 1)
    assert h.tolist() == [0.5 * (group.size - 1)] * 3


def test_cuda_aware_override(monkeypatch):
    monkeypatch.setenv(comm.CUDA_AWARE_ENV, "1")
    assert comm.is_cuda_aware() is True
    monkeypatch.setenv(comm.CUDA_AWARE_ENV, "0")
    assert comm.is_cuda_aware() is False


def test_local_rank_and_device(world):
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    assert comm.local_rank(world) == node.Get_rank()
    node.Free()
    if not torch.cuda.is_available():
        assert comm.device_for_rank(world) == torch.device("cpu")


def test_node_layout_matches_hosts(world):
    rank = world.Get_rank()
    hosts = world.allgather(MPI.Get_processor_name())
    expected = [tuple(r for r, h in enumerate(hosts) if h == host) for host in dict.fromkeys(hosts)]
    layout = comm.NodeLayout(world)
    assert layout.nodes == tuple(expected)
    assert layout.nodes[layout.node].index(rank) == layout.node_rank
    assert layout.contiguous == (hosts == sorted(hosts, key=hosts.index))
    assert layout.node_size == (len(expected[0]) if len(set(map(len, expected))) == 1 else None)
    assert layout.block(1) == rank and layout.block(world.Get_size()) == 0
    if layout.contiguous and world.Get_size() % 2 == 0:
        assert layout.block(2) == rank // 2


@pytest.mark.mpi(min_size=2)
def test_sub_communicator_from_split(world, chunking):
    color = world.Get_rank() % 2
    sub = world.Split(color, world.Get_rank())
    pg = comm.ProcessGroup(sub)
    members = [r for r in range(world.Get_size()) if r % 2 == color]
    t = torch.tensor([float(world.Get_rank())])
    comm.all_reduce(t, pg.comm)
    assert t.item() == float(sum(members))
    out = torch.zeros(pg.size)
    comm.all_gather(out, torch.tensor([float(world.Get_rank())]), pg.comm)
    assert out.tolist() == [float(m) for m in members]
    pg.close()
    sub.Free()


def test_process_group_resolution(world):
    assert comm.resolve(None) is MPI.COMM_WORLD
    assert comm.resolve(world) is world
    assert not comm.is_member(MPI.COMM_NULL)
    with pytest.raises(TypeError, match="intracommunicator"):
        comm.resolve("world")
    with pytest.raises(ValueError, match="not a member"):
        comm.ProcessGroup(MPI.COMM_NULL)


def test_private_duplicate_is_separate_and_freed(world):
    pg = comm.ProcessGroup(world)
    assert pg.comm != world
    assert MPI.Comm.Compare(pg.comm, world) == MPI.CONGRUENT
    private = pg.comm
    pg.close()
    assert private == MPI.COMM_NULL


@pytest.mark.parametrize("name, call", [
    ("all_reduce", lambda c: comm.all_reduce([1.0], c)),
    ("reduce", lambda c: comm.reduce([1.0], c, 0)),
    ("broadcast", lambda c: comm.broadcast([1.0], c)),
    ("all_gather_v", lambda c: comm.all_gather_v(torch.zeros(c.Get_size()),
                                                 [1] * c.Get_size(), c, [1.0])),
    ("all_gather", lambda c: comm.all_gather(torch.zeros(c.Get_size()), [1.0], c)),
    ("reduce_scatter", lambda c: comm.reduce_scatter([1.0], torch.zeros(c.Get_size()), c)),
    ("gather", lambda c: comm.gather([1.0], c)),
    ("all_reduce_coalesced", lambda c: comm.all_reduce_coalesced([torch.zeros(1), [1.0]], c)),
])
def test_a_non_tensor_is_a_type_error_naming_the_collective_and_the_rank(group, name, call):
    """Refused on every rank before any MPI call, so no rank waits in a collective."""
    with pytest.raises(TypeError) as raised:
        call(group.comm)
    assert str(raised.value) == (f"{name}: expected a torch.Tensor, got list "
                                 f"(rank {group.rank})")


def test_bad_counts_name_the_rank(group):
    with pytest.raises(ValueError, match=f"rank {group.rank}"):
        comm.all_gather_v(torch.zeros(3), [1] * (group.size + 1), group.comm)
    with pytest.raises(TypeError, match="cannot be communicated"):
        comm.all_reduce(torch.zeros(2, dtype=torch.uint16), group.comm)
    with pytest.raises(ValueError, match="sparse"):
        comm.all_reduce(torch.zeros(2).to_sparse(), group.comm)
