"""The cost model: its formulas against numbers worked out by hand, its limits, Young/Daly's
interval, the projection, and a short run of ``bench cost-model`` at the launch's size."""
import math

import pytest
from mpi4py import MPI

from tensorplay_hpc.bench import cost_model as cm
from tensorplay_hpc.bench.cli import available
from tensorplay_hpc.bench.report import Report

LINK = cm.Link(alpha=1e-6, beta=1e-9)
GAMMA = 1e-10
MACHINE = cm.Machine(name="test", alpha_inter=10e-6, beta_inter=1e-9, alpha_intra=1e-6,
                     beta_intra=0.5e-9, gamma=1e-10, update=2e-10, ranks_per_node=4, fs_write=1e9,
                     fs_read=2e9, fs_latency=1e-3, node_mtbf_s=1e8)


def test_allreduce_variants_at_4_ranks_of_a_megabyte():
    # ring: 2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma
    assert cm.ring_allreduce(4, 1e6, LINK, GAMMA) == pytest.approx(6e-6 + 1.575e-3)
    assert cm.halving_doubling_allreduce(4, 1e6, LINK, GAMMA) == pytest.approx(4e-6 + 1.575e-3)
    assert cm.recursive_doubling_allreduce(4, 1e6, LINK, GAMMA) == pytest.approx(2.202e-3)
    assert cm.allreduce(4, 1e6, LINK, GAMMA) == pytest.approx(1.579e-3)
    # 8 bytes: recursive doubling's 2 messages beat the others' 4 and 6
    assert cm.allreduce(4, 8, LINK, GAMMA) == pytest.approx(2 * (1e-6 + 8 * 1.1e-9))


def test_other_collectives_at_4_ranks_of_a_megabyte():
    assert cm.reduce_scatter(4, 1e6, LINK, GAMMA) == pytest.approx(2e-6 + 8.25e-4)
    assert cm.allgather(4, 1e6, LINK) == pytest.approx(7.52e-4)
    # scatter + allgather (5 alpha, 1.5 n beta) beats the binomial tree (2 alpha, 2 n beta)
    assert cm.broadcast(4, 1e6, LINK) == pytest.approx(1.505e-3)
    assert cm.broadcast(4, 8, LINK) == pytest.approx(2 * (1e-6 + 8e-9))
    assert cm.small_collective(6, LINK) == pytest.approx(3e-6)   # ceil(log2 6) steps


def test_one_rank_communicates_nothing_and_costs_grow_with_bytes_and_ranks():
    for cost in (cm.ring_allreduce, cm.halving_doubling_allreduce, cm.reduce_scatter):
        assert cost(1, 1e6, LINK, GAMMA) == 0.0
    assert cm.allgather(1, 1e6, LINK) == cm.broadcast(1, 1e6, LINK) == 0.0
    sizes, ranks = [2**k for k in range(3, 30, 3)], [2**k for k in range(1, 15)]
    for p in (2, 64, 4096):
        costs = [cm.allreduce(p, n, LINK, GAMMA) for n in sizes]
        assert costs == sorted(costs) and len(set(costs)) == len(costs)
    costs = [cm.ring_allreduce(p, 1e8, LINK, GAMMA) for p in ranks]
    assert costs == sorted(costs)
    # the ring's bandwidth term tends to 2 n beta + n gamma: no more bytes per rank with scale
    limit = 1e8 * (2 * LINK.beta + GAMMA)
    assert cm.ring_allreduce(10**6, 1e8, cm.Link(0.0, LINK.beta), GAMMA) == pytest.approx(
        limit, rel=1e-5)


def test_machine_picks_the_link_by_whether_the_ranks_span_nodes():
    assert MACHINE.link(4) == cm.Link(1e-6, 0.5e-9)
    assert MACHINE.link(5) == cm.Link(10e-6, 1e-9)
    assert MACHINE.nodes(9) == 3


def test_hierarchical_hook_on_two_nodes_of_four():
    # reduce-scatter in the node 4.52e-4, allreduce of n/4 between 2 nodes 2.825e-4,
    # allgather in the node 3.77e-4, the division 2e-4
    assert cm.hierarchical_allreduce(MACHINE, 8, 1e6) == pytest.approx(1.3115e-3)


def test_ddp_zero_and_averaging():
    update = MACHINE.update
    bucket = cm.allreduce(4, 1e6, MACHINE.link(4), GAMMA) + 1e6 * update
    assert cm.ddp_step(MACHINE, 4, 2.5e6, 1e6) == pytest.approx(
        2 * bucket + cm.allreduce(4, 0.5e6, MACHINE.link(4), GAMMA) + 0.5e6 * update)
    ring = cm.ring_allreduce(4, 1e6, MACHINE.link(4), GAMMA) + 1e6 * update
    assert cm.ddp_step(MACHINE, 4, 2e6, 1e6, cm.ring_allreduce) == pytest.approx(2 * ring)
    link = MACHINE.link(8)
    gathered = cm.allgather(8, 1e6, link) + 1e6 * update + 1e6 / 8 * update
    assert cm.zero_step(MACHINE, 8, 1e6, 1) == pytest.approx(
        cm.allreduce(8, 1e6, link, GAMMA) + gathered)
    assert cm.zero_step(MACHINE, 8, 1e6, 2) == pytest.approx(
        cm.reduce_scatter(8, 1e6, link, GAMMA) + gathered)
    assert cm.zero_step(MACHINE, 8, 1e6, 2) < cm.zero_step(MACHINE, 8, 1e6, 1)
    with pytest.raises(ValueError, match="stage 3"):
        cm.zero_step(MACHINE, 8, 1e6, 3)
    assert cm.averaging(MACHINE, 8, 1e6) == pytest.approx(
        cm.allgather(8, 320, link) + cm.allreduce(8, 1e6, link, GAMMA) + 3e6 * update)


def test_distributed_optimizer_round_trips():
    # served, 2 tensors, SGD: 6 + 2 * 3 = 12 round trips, 4 one-way puts, 3 MB moved
    assert cm.distributed_optimizer_step(MACHINE, "served", 1e6, 2) == pytest.approx(
        28 * 10e-6 + 3e-3 + 2e-4)
    # MPI windows, Adam (2 state entries): 7 round trips, 7 MB moved, 3 passes
    assert cm.distributed_optimizer_step(MACHINE, "mpi", 1e6, 2, state_entries=2) == (
        pytest.approx(14 * 10e-6 + 7e-3 + 6e-4))
    assert cm.distributed_optimizer_step(MACHINE, "shared", 1e6, 2) == pytest.approx(2.06e-4)
    # trainers wait for each other on the owner's exclusive lock
    assert cm.distributed_optimizer_step(MACHINE, "served", 1e6, 2, trainers=3) == (
        pytest.approx(3 * (28 * 10e-6 + 3e-3 + 2e-4)))
    with pytest.raises(ValueError, match="transport 'tcp'"):
        cm.distributed_optimizer_step(MACHINE, "tcp", 1e6, 2)


def test_checkpoint_save_load_and_young_daly():
    # latency 1 ms, 1 GB at 1 GB/s, 21 small collectives of 3 steps at 10 us, 3,600 catalog
    # bytes gathered (7/8 cross), the gather's own 3 steps
    assert cm.checkpoint_save(MACHINE, 8, 1e9, 100) == pytest.approx(
        1e-3 + 1.0 + 21 * 3e-5 + 7 / 8 * 3600 * 1e-9 + 3e-5)
    link = MACHINE.link(8)
    assert cm.checkpoint_load(MACHINE, 8, 1e9, 100, 2e8) == pytest.approx(
        1e-3 + 0.5 + 14 * 3e-5 + cm.broadcast(8, 2e8, link) + cm.broadcast(8, 3600, link))
    assert cm.checkpoint_interval(50.0, 1e6) == pytest.approx(1e4)
    assert cm.checkpoint_interval(200.0, 1e6) == pytest.approx(2e4)   # sqrt: 4x cost, 2x


def test_latency_share_and_where_scaling_stops():
    def small(m, p):
        return cm.allreduce(p, 1024, m.link(p), m.gamma)

    def large(m, p):
        return cm.allreduce(p, 1e9, m.link(p), m.gamma)
    assert cm.latency_share(small, cm.SLINGSHOT, 1024) > 0.9
    assert cm.latency_share(large, cm.SLINGSHOT, 1024) < 0.01
    assert cm.stops_scaling_at(small, cm.SLINGSHOT) == 8   # from two nodes of 4 on

    def serialized(m, p):
        return cm.distributed_optimizer_step(m, "mpi", 1e6, 1, trainers=p - 1)
    assert cm.stops_scaling_at(large, cm.SLINGSHOT) is None
    assert cm.stops_scaling_at(serialized, cm.SLINGSHOT) == 16   # 15 trainers > 2 x 7


def test_projection_covers_every_operation_rank_count_and_machine():
    lines = []
    rows = cm.project(emit=lines.append)
    assert len(rows) == 2 * 9 * len(cm.PROJECTED_RANKS)
    assert {row["ranks"] for row in rows} == {64, 256, 1024, 4096, 10000}
    assert all(row["predicted_s"] > 0 and 0 <= row["latency_share"] <= 1 for row in rows)
    assert sum("Young/Daly" in line for line in lines) == 2 * len(cm.PROJECTED_RANKS)


@pytest.mark.mpi
def test_bench_rows_have_positive_times_and_a_consistent_error():
    assert "cost-model" in available()
    report = Report(repeat=1)
    cm.run(report, width=32, file_bytes=2**20)
    size = MPI.COMM_WORLD.Get_size()
    cases = [row["case"] for row in report.rows]
    assert "checkpoint.save" in cases and "average_parameters" in cases
    assert any(case.startswith("DistributedOptimizer") for case in cases) == (size > 1)
    for row in report.rows:
        assert row["bench"] == "cost-model" and row["ranks"] == size
        assert row["predicted_s"] > 0 and row["measured_s"] > 0, row
        assert row["error"] == pytest.approx(row["measured_s"] / row["predicted_s"] - 1)
        assert math.isfinite(row["error"])
