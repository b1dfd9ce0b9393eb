"""The simulated cluster is faithful: what Open MPI sees across its nodes is what it sees across
real machines connected by TCP."""
import json

from launch import mpiexec, only_in_single_rank_run

pytestmark = only_in_single_rank_run


def probe(nodes, *flags: str):
    return mpiexec(4, ["tests/support/node_probe.py"], nodes=nodes, flags=flags, timeout=120)


def test_ranks_see_two_nodes_of_two(simulated_nodes):
    result = probe(simulated_nodes)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert [r["node_size"] for r in seen] == [2, 2, 2, 2]
    assert [r["processor"] for r in seen] == ["n1", "n1", "n2", "n2"]
    assert [r["hostname"] for r in seen] == ["n1", "n1", "n2", "n2"]
    assert [r["shared_window_over_world"] for r in seen] == [False] * 4


def test_shared_memory_alone_cannot_reach_the_other_node(simulated_nodes):
    result = probe(simulated_nodes, "--mca", "btl", "self,vader")
    assert result.returncode != 0
    assert "unable to reach each other" in result.stderr


def test_tcp_alone_reaches_every_rank(simulated_nodes):
    result = probe(simulated_nodes, "--mca", "btl", "self,tcp")
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout.strip().splitlines()[-1])) == 4
