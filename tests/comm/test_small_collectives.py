"""The collectives on small values (objects, flags, counts, digests) and the making of
communicators: their results on every rank, and their entries in the trace (0 bytes: control
traffic)."""
import numpy as np
import pytest
from mpi4py import MPI

from tensorplay_hpc.comm import communicators, trace
from tensorplay_hpc.comm import small_collectives as small


def test_objects_and_arrays_on_every_rank(world):
    rank, size = world.Get_rank(), world.Get_size()
    assert small.all_gather_object(("rank", rank), world) == [("rank", r) for r in range(size)]
    assert small.broadcast_object({"from": rank}, world, root=size - 1) == {"from": size - 1}
    assert small.all_reduce_object(rank + 1, world) == size * (size + 1) // 2
    assert small.all_reduce_object(rank, world, MPI.MAX) == size - 1
    gathered = small.gather_object(rank * 10, world, root=0)
    assert gathered == ([10 * r for r in range(size)] if rank == 0 else None)
    every = small.all_gather_array(np.array([rank, -rank], dtype=np.int64), world)
    assert every.tolist() == [[r, -r] for r in range(size)]
    flags = small.all_reduce_array(np.array([rank == 0, True], dtype=np.int32), world)
    assert flags.tolist() == [1, size]
    values = small.broadcast_array(np.full(3, rank, dtype=np.float64), world, root=size - 1)
    assert values.tolist() == [size - 1] * 3
    parts = small.gather_array(np.arange(rank + 1, dtype=np.int64), range(1, size + 1), world)
    assert (parts.tolist() == [i for r in range(size) for i in range(r + 1)] if rank == 0
            else parts is None)
    small.barrier(world)
    small.quiet_barrier(world)


def test_communicators_are_made_and_traced(world, tmp_path):
    rank, size = world.Get_rank(), world.Get_size()
    trace.enable(tmp_path)
    try:
        copy = communicators.duplicate(world)
        halves = communicators.split(world, rank % 2, key=-rank)
        node = communicators.split_by_node(world)
        assert (copy.Get_size(), halves.Get_size()) == (size, len(range(rank % 2, size, 2)))
        assert halves.Get_rank() == len(range(rank % 2, size, 2)) - 1 - rank // 2
        assert node.Get_size() >= 1
        for made in (copy, halves, node):
            made.Free()
        recent = [(op.name, op.nbytes) for op in trace.recent()[-3:]]
        assert recent == [("Dup", 0), ("Split", 0), ("Split_type", 0)]
    finally:
        trace.disable()


@pytest.mark.mpi(min_size=2)
def test_create_group_on_its_ranks_only(world):
    rank = world.Get_rank()
    members = world.Get_group().Incl([0, 1])
    made = communicators.create_group(world, members) if rank < 2 else MPI.COMM_NULL
    members.Free()
    if rank < 2:
        assert (made.Get_size(), made.Get_rank()) == (2, rank)
        made.Free()
