"""A fault on one rank of a training loop ends the whole job promptly (2 ranks, watchdog at 5 s):
an uncaught exception in a ZeroRedundancyOptimizer or a DistributedDataParallel loop, a
communication hook that raises, a collective checkpoint saved on rank 0 only. The job script
installs nothing itself (no ``abort_on_exception``). The cases run side by side, a job each."""
import os
import re

import pytest

from concurrent_jobs import Ended, run_side_by_side
from launch import SUPPORT, only_in_single_rank_run

JOB = str(SUPPORT / "training_fault_job.py")
RAISING = ("zero", "ddp", "hook")
"""The loops in which the last rank raises."""
WITHIN_S = 15
"""How soon after the fault a job must have ended."""


def _problems(case: str, ended: Ended, folder) -> list:
    """What is wrong with how ``case``'s job ended (nothing when it ended as it must)."""
    problems = []
    if ended.code == 0 or "not reached" in ended.out or not ended.seconds < WITHIN_S:
        problems.append(f"return code {ended.code}, {ended.seconds:.1f} s after the fault")
    if case in RAISING:
        expected = ["[rank 1] uncaught exception, aborting the job",
                    f"RuntimeError: deliberate failure in the {case} loop"]
        problems += [f"no {text!r}" for text in expected if text not in ended.err]
    else:   # the watchdog reports the save waiting for rank 1, and nothing is written
        if not re.search(r"\[rank 0\] collective timeout: .* has waited \d+ s \(limit 5 s\); "
                         r"ranks not arrived: \[1\]\. Aborting the job", ended.err):
            problems.append("no report naming rank 1")
        if not re.search(r"\[rank 0\]   \w+ .* for checkpoint\.save \[MainThread\]: running for",
                         ended.err):
            problems.append("no running operation of checkpoint.save in the report")
        if os.listdir(folder / case):
            problems.append(f"files written: {os.listdir(folder / case)}")
    return [f"{case}: {problem}\n{ended.out}{ended.err[-3000:]}" for problem in problems]


@only_in_single_rank_run
@pytest.mark.timeout(150)
def test_a_fault_on_one_rank_ends_the_job(tmp_path):
    """``save``: PyTorch's ``if rank == 0: torch.save(...)`` then a barrier, moved to the
    collective ``checkpoint.save``."""
    cases = [*RAISING, "save"]
    results = run_side_by_side(JOB, cases, 2, tmp_path, "failing at", len(cases),
                               {"TENSORPLAY_HPC_COLLECTIVE_TIMEOUT": "5"})
    problems = [p for case in cases for p in _problems(case, results[case], tmp_path)]
    assert not problems, "\n\n".join(problems)
