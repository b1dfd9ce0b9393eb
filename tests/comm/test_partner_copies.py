"""Partner copies: each rank's bytes held by a rank on the next node (or the next rank on one
node), for the newest steps only, sent in the background."""
import time

import pytest
import torch
from mpi4py import MPI

from tensorplay_hpc.comm import NodeLayout, worker
from tensorplay_hpc.comm.partner_copies import PartnerCopies, partner_of


def test_partners_sit_on_the_next_node():
    assert [partner_of([[0, 1, 2]], r) for r in range(3)] == [1, 2, 0]
    assert [partner_of([[0, 1], [2, 3]], r) for r in range(4)] == [2, 3, 0, 1]
    assert [partner_of([[0, 2], [1, 3], [4, 5]], r) for r in range(6)] == [1, 4, 3, 5, 0, 2]
    assert [partner_of([[0, 1, 2], [3]], r) for r in range(4)] == [3, 3, 3, 0]   # uneven


def _payload(rank: int, step: int) -> torch.Tensor:
    """Different bytes and sizes for each rank and step (rank 0's of step 2 are empty)."""
    size = 0 if (rank, step) == (0, 2) else 1000 * rank + 7 * step + 3
    return (torch.arange(size, dtype=torch.int64) * (step + 1) + rank).to(torch.uint8)


@pytest.mark.mpi(min_size=2)
@pytest.mark.scale
def test_each_rank_holds_its_backed_ranks_bytes_of_the_newest_steps():
    world = MPI.COMM_WORLD
    layout = NodeLayout(world)
    copies = PartnerCopies(world, depth=2)
    try:
        nodes = [list(ranks) for ranks in layout.nodes]
        assert copies.partner == partner_of(nodes, world.rank)
        assert copies.backed == [r for r in range(world.size) if partner_of(nodes, r) == world.rank]
        if len(nodes) > 1:   # the copy survives the loss of this rank's node
            assert not set(nodes[layout.node]) & {copies.partner}
        for step in (1, 2, 3):
            copies.keep(step, _payload(world.rank, step))
        copies.settle()   # step 3's bytes travel in the background until then
        assert copies.steps == [2, 3]
        for rank in copies.backed:
            for step in (2, 3):
                assert torch.equal(copies.held(rank, step), _payload(rank, step))
            assert copies.held(rank, 1) is None
        assert copies.held(world.rank, 3) is None   # its own bytes are its partner's to hold
    finally:
        copies.close()


def test_one_rank_has_no_partner():
    with pytest.raises(ValueError, match="PartnerCopies needs two ranks or more, not 1"):
        PartnerCopies(MPI.COMM_SELF)


@pytest.mark.mpi(min_size=2)
def test_keep_returns_while_the_bytes_travel():
    """Every rank but 0 starts its exchange half a second late: where threads may call MPI,
    rank 0's ``keep`` returns at once all the same, and ``settle`` waits for the bytes."""
    world = MPI.COMM_WORLD
    copies = PartnerCopies(world)
    try:
        if world.rank:
            time.sleep(0.5)
        started = time.perf_counter()
        copies.keep(1, _payload(world.rank, 1))
        returned = time.perf_counter() - started
        copies.settle()
        if world.rank == 0 and worker.available():
            assert returned < 0.25, f"keep waited {returned:.2f} s for the partner"
            assert time.perf_counter() - started > 0.3
        for rank in copies.backed:
            assert torch.equal(copies.held(rank, 1), _payload(rank, 1))
    finally:
        copies.close()


@pytest.mark.mpi(min_size=2)
def test_a_payload_that_is_not_bytes_is_refused_at_once():
    world = MPI.COMM_WORLD
    copies = PartnerCopies(world)
    try:
        with pytest.raises(TypeError, match=rf"payload of step 4 must be a 1-D uint8 CPU tensor, "
                                            rf"got a 1-D torch.float32 tensor on cpu \(world rank "
                                            rf"{world.rank}\)"):
            copies.keep(4, torch.ones(3))
        assert copies.steps == []
    finally:
        copies.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_close_right_after_keep_lets_the_bytes_arrive():
    """Rank 0 closes at once after ``keep``, while its bytes may not have left (the other ranks
    start half a second late): its partner still gets them, and the copies held stay
    readable after ``close``."""
    world = MPI.COMM_WORLD
    copies = PartnerCopies(world)
    if world.rank:
        time.sleep(0.5)
    copies.keep(1, _payload(world.rank, 1))
    copies.close()
    for rank in copies.backed:
        assert torch.equal(copies.held(rank, 1), _payload(rank, 1))
