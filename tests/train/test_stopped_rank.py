"""A rank that stops (``SIGSTOP``) at any point of a training step, or stalls before a checkpoint,
ends the job through the watchdog (at 5 s), which names that rank, instead of leaving the others
waiting: in the forward and backward hooks, DDP's bucket allreduce, ZeroRedundancyOptimizer's
parameter allgather and its consistency check, a checkpoint's write; a 40 s stall before
``checkpoint.save`` and ``checkpoint.load``, and before the library's first collective.

Each case is a job of ``stopped_rank_job.py``; they run side by side."""
import re

import pytest

from concurrent_jobs import run_side_by_side
from launch import SUPPORT, only_in_single_rank_run
from stopped_rank_job import CASES, STALL_S

JOB = str(SUPPORT / "stopped_rank_job.py")
WITHIN_S = 20
"""How soon after the stop or the stall's start a job must have ended."""
EARLY_S = 0.5
"""How much earlier than 5 s after the stall's start a job may end: the other rank may enter the
collective it waits in a moment before the stalling rank prints the time."""


def _reported(case: str, err: str) -> bool:
    """Whether rank 0's report names rank 1 as a stopped rank does not answer, or a stalled one
    has not arrived (before the library's first collective, no rank can be named)."""
    if case == "stall_first_collective":
        missing = r"the ranks not arrived cannot be named"
    elif case.startswith("stop_"):
        missing = r"ranks not arrived: (none|\[1\]); ranks not answering: \[1\]"
    else:
        missing = r"ranks not arrived: \[1\]"
    return re.search(r"\[rank 0\] collective timeout: .*has waited \d+ s \(limit 5 s\); "
                     + missing, err) is not None


@only_in_single_rank_run
@pytest.mark.timeout(240)
def test_a_stopped_or_stalled_rank_ends_the_job_naming_it(tmp_path):
    assert WITHIN_S < STALL_S
    results = run_side_by_side(JOB, list(CASES), 2, tmp_path, moment="ing at", at_once=len(CASES),
                               env={"TENSORPLAY_HPC_COLLECTIVE_TIMEOUT": "5"})
    problems = [f"{case}: return code {ended.code}, {ended.seconds:.1f} s after the fault\n"
                f"{ended.out}{ended.err[-3000:]}" for case, ended in results.items()
                if ended.code == 0 or "not reached" in ended.out or not _reported(case, ended.err)
                or not 5 - EARLY_S <= ended.seconds < WITHIN_S]
    assert not problems, "\n\n".join(problems)
