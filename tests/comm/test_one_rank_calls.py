"""A collective entry point called on one rank only (the others gone on to a barrier of their
own) ends the job through the watchdog, with a report naming the ranks that did not arrive,
instead of hanging: ZeroRedundancyOptimizer, DistributedDataParallel, an averager, rma.share,
checkpoints, the trace and the wait of a nonblocking coalesced allreduce. The entry points that
are not collective return on that rank.

Each case is a job of its own (``one_rank_call_job.py``); the jobs run a few at a time."""
import re
from typing import Dict, List, Optional

import pytest

from concurrent_jobs import Ended, run_side_by_side
from launch import SUPPORT, only_in_single_rank_run
from one_rank_call_job import COLLECTIVE, LOCAL, caller

JOB = str(SUPPORT / "one_rank_call_job.py")
TIMEOUT_S = 5
"""The watchdog's limit in these jobs."""
WITHIN_S = 15
"""How soon after the call a job must have ended."""
AT_ONCE = 4
"""Jobs running at the same time on one node. Over simulated nodes they run one at a time: with
three 4-rank jobs started at once on 2 cores, one now and then printed nothing within 120 s, or
a rank was still importing when the others' first collective reached the 5 s limit."""


def _run_all(cases: List[str], ranks: int, folder, nodes=None) -> Dict[str, Ended]:
    return run_side_by_side(JOB, cases, ranks, folder, "calling at",
                            AT_ONCE if nodes is None else 1,
                            {"TENSORPLAY_HPC_COLLECTIVE_TIMEOUT": str(TIMEOUT_S)}, nodes)


def _check(results, ranks: int, cases: Optional[List[str]] = None) -> None:
    problems = []
    for case in (COLLECTIVE if cases is None else cases):
        late = [rank for rank in range(ranks) if rank != caller(case, ranks)]
        out, err, code, seconds = results[case]
        report = re.search(r"collective timeout: .*?; ranks not arrived: (\[[0-9, ]*\])", err)
        if (code == 0 or "returned" in out or report is None or report.group(1) != str(late)
                or not TIMEOUT_S <= seconds < WITHIN_S):
            problems.append(f"{case}: return code {code}, {seconds:.1f} s after the call, "
                            f"report {report.group(0) if report else None!r}\n{out}{err[-3000:]}")
    for case in (LOCAL if cases is None else []):
        out, err, code, seconds = results[case]
        if code != 0 or "returned" not in out:
            problems.append(f"{case}: return code {code}\n{out}{err[-3000:]}")
    assert not problems, "\n\n".join(problems)


@only_in_single_rank_run
@pytest.mark.timeout(600)
def test_one_rank_calls_end_the_job_naming_the_missing_rank(tmp_path):
    _check(_run_all(list(COLLECTIVE + LOCAL), 2, tmp_path), 2)


@only_in_single_rank_run
@pytest.mark.timeout(300)
def test_one_rank_calls_across_nodes(simulated_nodes, tmp_path):
    """A few cases at 4 ranks over 2 simulated nodes (the late ranks on both)."""
    cases = ["zero_step", "ddp_forward", "checkpoint_save"]
    _check(_run_all(cases, 4, tmp_path, simulated_nodes), 4, cases)
