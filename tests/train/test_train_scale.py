"""The training job at 16 ranks over 4 simulated nodes of 4, stopped by SIGUSR1 and resumed,
gives the losses of an uninterrupted run exactly. Runs in the 1-rank pass (it launches its own
jobs).

A 16-rank job costs about a minute of this machine's two cores (most of it each rank's start),
so the program runs at 16 ranks with ``--optimizer hsdp``, the one whose layout follows the
nodes most (a replica per node, shards within it); the in-process resume tests of every
optimizer are marked ``resume_smoke`` and run at 16 ranks over 4 nodes too."""
from pathlib import Path
from typing import List

import pytest

from launch import only_in_single_rank_run
from simulated_nodes import NodesUnavailable, SimulatedNodes
from train_launch import cross_node_bytes, losses, preempt_program, restarts, run_program

RANKS, NODES = 16, 4
STEPS, EVERY = 8, 2
SMOKED = ("hsdp",)
OPTIONS = ["--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--batch-size", "16"]
"""A background checkpoint is reported when the next one starts, so SIGUSR1 comes two to three
steps after the first."""


def _resumes_exactly(cluster: SimulatedNodes, folder: Path, optimizer: str) -> List[str]:
    """Run ``optimizer`` to the end, then stopped after its first checkpoint and resumed; return
    what differs from the uninterrupted run (nothing when the resume is exact)."""
    options = ["--optimizer", optimizer, *OPTIONS]
    whole, parts = folder / optimizer / "whole", folder / optimizer / "parts"
    output = run_program(folder, RANKS, whole, *options, nodes=cluster).stdout
    expected, crossed = losses(whole), cross_node_bytes(whole)   # counted at each checkpoint
    preempt_program(folder, RANKS, parts, EVERY, *options, nodes=cluster)
    stopped_at = len(losses(parts))
    run_program(folder, RANKS, parts, *options, "--resume", nodes=cluster)
    wrong = []
    if f"{RANKS} ranks" not in output or len(expected) != STEPS:
        wrong.append(f"{optimizer}: {len(expected)} steps of {STEPS}:\n{output}")
    if optimizer == "hsdp" and f"hsdp: {NODES} replicas (one per node) of 4 shards" not in output:
        wrong.append(f"hsdp: not one replica per node:\n{output}")
    if list(crossed) != list(range(EVERY, STEPS + 1, EVERY)) or \
            not 0 < crossed[EVERY] < crossed[2 * EVERY] < crossed[STEPS]:
        wrong.append(f"{optimizer}: bytes between nodes by checkpoint {crossed}")
    if not EVERY < stopped_at < STEPS:
        wrong.append(f"{optimizer}: stopped at step {stopped_at}")
    if losses(parts) != expected or restarts(parts) != [stopped_at + 1]:
        wrong.append(f"{optimizer}: resumed at {restarts(parts)} after a stop at {stopped_at}: "
                     f"losses {losses(parts)} instead of {expected}")
    return wrong


@only_in_single_rank_run
@pytest.mark.timeout(900)
def test_16_ranks_over_4_nodes_resume_exactly_after_sigusr1(tmp_path):
    try:
        with SimulatedNodes(nodes=NODES, slots=RANKS // NODES) as cluster:
            wrong = [line for name in SMOKED for line in _resumes_exactly(cluster, tmp_path, name)]
    except NodesUnavailable as reason:
        pytest.skip(f"no simulated nodes: {reason}")
    assert not wrong, "\n".join(wrong)
