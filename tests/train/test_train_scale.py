"""The training job at 16 ranks over 4 simulated nodes of 4: every ``--optimizer``, stopped by
SIGUSR1 and resumed, gives the losses of an uninterrupted run exactly. Runs in the 1-rank pass
(it launches its own jobs), two optimizers side by side."""
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import List

import pytest

from launch import only_in_single_rank_run
from simulated_nodes import NodesUnavailable, SimulatedNodes
from tensorplay_hpc.train.config import OPTIMIZERS
from train_launch import (cross_node_bytes, losses, preempt_program, replicas_differ, restarts,
                          run_program)

RANKS, NODES = 16, 4
STEPS, EVERY = 8, 2
AT_ONCE = 2
"""Jobs running side by side: each of 16 ranks, on 2 cores, within the machine's memory."""
OPTIONS = ["--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--batch-size", "16",
           "--warmup-steps", "2", "--average-period", "4", "--sync-every", "4"]
"""Post-local SGD averages at steps 4 and 8 after 2 steps of warm-up, DiLoCo syncs at steps 4
and 8: a stop at step 3, 5, 6 or 7 falls between averagings. (A background checkpoint is reported
when the next one starts, so SIGUSR1 comes two to three steps after the first.)"""


def _resumes_exactly(cluster: SimulatedNodes, folder: Path, optimizer: str) -> List[str]:
    """Run ``optimizer`` to the end, then stopped after its first checkpoint and resumed; return
    what differs from the uninterrupted run (nothing when the resume is exact)."""
    options = ["--optimizer", optimizer, *OPTIONS]
    whole, parts = folder / optimizer / "whole", folder / optimizer / "parts"
    output = run_program(folder, RANKS, whole, *options, nodes=cluster).stdout
    expected, crossed = losses(whole), cross_node_bytes(whole)   # counted at each checkpoint
    preempt_program(folder, RANKS, parts, EVERY, *options, nodes=cluster)
    stopped_at = len(losses(parts))
    stopped = parts / "checkpoints" / f"step-{stopped_at:07d}.h5"
    between = optimizer == "postlocal" and stopped_at != 4 and not replicas_differ(stopped)
    run_program(folder, RANKS, parts, *options, "--resume", nodes=cluster)
    wrong = []
    if f"{RANKS} ranks" not in output or len(expected) != STEPS:
        wrong.append(f"{optimizer}: {len(expected)} steps of {STEPS}:\n{output}")
    if optimizer == "hsdp" and f"hsdp: {NODES} replicas (one per node) of 4 shards" not in output:
        wrong.append(f"hsdp: not one replica per node:\n{output}")
    if list(crossed) != list(range(EVERY, STEPS + 1, EVERY)) or \
            not 0 < crossed[EVERY] < crossed[2 * EVERY] < crossed[STEPS]:
        wrong.append(f"{optimizer}: bytes between nodes by checkpoint {crossed}")
    if not EVERY < stopped_at < STEPS or between:
        wrong.append(f"{optimizer}: stopped at step {stopped_at} (replicas differ: {not between})")
    if losses(parts) != expected or restarts(parts) != [stopped_at + 1]:
        wrong.append(f"{optimizer}: resumed at {restarts(parts)} after a stop at {stopped_at}: "
                     f"losses {losses(parts)} instead of {expected}")
    return wrong


@only_in_single_rank_run
@pytest.mark.timeout(1800)
def test_every_optimizer_at_16_ranks_over_4_nodes_resumes_exactly_after_sigusr1(tmp_path):
    try:
        with SimulatedNodes(nodes=NODES, slots=RANKS // NODES) as cluster, \
                ThreadPoolExecutor(AT_ONCE) as pool:
            found = pool.map(lambda name: _resumes_exactly(cluster, tmp_path, name), OPTIMIZERS)
            wrong = [line for lines in found for line in lines]
    except NodesUnavailable as reason:
        pytest.skip(f"no simulated nodes: {reason}")
    assert not wrong, "\n".join(wrong)
