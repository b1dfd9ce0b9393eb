"""Running many small jobs of one script side by side, each bounded, and timing each from the
moment its script says the fault (or the call under test) happened to the job's end.

Used by the watchdog tests, whose cases are jobs that must end by themselves within seconds.
"""
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional

from launch import clean_env, mpiexec_command
from simulated_nodes import SimulatedNodes


class Ended(NamedTuple):
    """How one job ended: its output, its return code, and the seconds from the moment its
    output names to its end (``inf`` when it names none)."""
    out: str
    err: str
    code: int
    seconds: float


def run_side_by_side(script: str, cases: List[str], ranks: int, folder: Path, moment: str,
                     at_once: int, env: Dict[str, str], nodes: Optional[SimulatedNodes] = None,
                     limit_s: float = 120) -> Dict[str, Ended]:
    """Run ``python SCRIPT CASE FOLDER/CASE`` on ``ranks`` ranks for every case, ``at_once`` at a
    time, its output kept in ``FOLDER/CASE.out`` and ``.err``; ``moment`` is the text before the
    time (``time.time()``) that the script prints. A job still running after ``limit_s`` is
    killed with its ranks (it hung)."""
    env = clean_env(**env)
    waiting, running, results = list(cases), {}, {}
    while waiting or running:
        while waiting and len(running) < at_once:
            case = waiting.pop(0)
            place = folder / case
            os.makedirs(place)
            with open(f"{place}.out", "w") as out, open(f"{place}.err", "w") as err:
                job = subprocess.Popen(
                    mpiexec_command(ranks, [script, case, str(place)], nodes), env=env,
                    stdout=out, stderr=err, start_new_session=True)
            running[case] = (job, time.time())
        time.sleep(0.1)
        for case, (job, started) in list(running.items()):
            if job.poll() is None and time.time() - started < limit_s:
                continue
            ended = time.time()
            if job.poll() is None:      # a hang: end the launcher and its ranks
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
            del running[case]
            out, err = (Path(f"{folder / case}.{name}").read_text() for name in ("out", "err"))
            said = re.search(re.escape(moment) + r" ([0-9.]+)", out)
            results[case] = Ended(out, err, job.returncode,
                                  ended - float(said.group(1)) if said else float("inf"))
    return results
