"""Jobs launched with fault tolerance on (ULFM), under the ``openmpi5`` lane's ``mpiexec
--with-ft ulfm`` (``scripts/env.sh`` gives the launch)."""
import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import List, Optional

import lanes
from launch import REPO, clean_env, mpiexec_prefix
from simulated_nodes import SimulatedNodes

LANE = "openmpi5"
LANE_ENV = REPO / f".venv-{LANE}"
HEARTBEAT = ["--mca", "mpi_ft_detector", "true", "--mca", "mpi_ft_detector_period", "0.5",
             "--mca", "mpi_ft_detector_timeout", "2"]
"""ULFM's heartbeat on (it is off by default), suspecting a rank silent for 2 s."""


def missing() -> Optional[str]:
    """Why the ULFM jobs are not launched here (``None``: they are): they run in the 1-rank
    pass of the ``openmpi5`` lane (``scripts/test.sh``), once, and need its environment."""
    if lanes.LANE != LANE:
        return (f"launches jobs under Open MPI 5 with ULFM: runs in the {LANE} lane "
                f"(TENSORPLAY_MPI={LANE}), in its 1-rank pass")
    if not (LANE_ENV / "bin" / "mpiexec").exists():
        return (f"the {LANE} lane (Open MPI 5 with ULFM) is not set up: "
                f"TENSORPLAY_MPI={LANE} bash scripts/setup.sh")
    return None


def command(ranks: int, args: List[str], nodes: Optional[SimulatedNodes] = None,
            ft: bool = True, heartbeat: bool = False) -> List[str]:
    """``mpiexec --with-ft ulfm -n RANKS python ARGS`` of the Open MPI 5 lane (without
    ``--with-ft ulfm`` when not ``ft``; with :data:`HEARTBEAT` when ``heartbeat``), on this
    node or over the simulated ``nodes`` (the tests run in that lane then)."""
    flags = (["--with-ft", "ulfm"] if ft else []) + (HEARTBEAT if heartbeat else [])
    if nodes is not None:
        return [*mpiexec_prefix(nodes), *flags, "-n", str(ranks), "python", *args]
    launch = 'source scripts/env.sh && exec "${MPIEXEC[@]}" "$@"'
    return ["bash", "-c", launch, "ulfm", *flags, "-n", str(ranks), "python", *args]


def start(ranks: int, args: List[str], out, err, nodes: Optional[SimulatedNodes] = None,
          heartbeat: bool = False) -> subprocess.Popen:
    """Start the job (over ``nodes`` when given) in a session of its own, its output to the
    files ``out`` and ``err``."""
    return subprocess.Popen(command(ranks, args, nodes, heartbeat=heartbeat),
                            env=clean_env(TENSORPLAY_MPI=LANE, PYTHONFAULTHANDLER="1"), cwd=REPO,
                            stdout=out, stderr=err, start_new_session=True)


STILL_RUNNING = -1000
"""What :func:`wait` returns for a job that had not ended in time (and was killed)."""


def wait(job: subprocess.Popen, timeout: float) -> int:
    """The exit status of ``job`` (from :func:`start`), waited for up to ``timeout`` s. A job
    still running then gets SIGABRT first, on which the Python of each rank writes its threads'
    stacks to the job's ``err``, then is ended (:func:`end`), and :data:`STILL_RUNNING` is
    returned, so that the test's check of the status fails showing the job's output."""
    try:
        return job.wait(timeout=max(timeout, 0))
    except subprocess.TimeoutExpired:
        _signal_session(job.pid, signal.SIGABRT)
        time.sleep(3)
        end(job)
        return STILL_RUNNING


def end(job: subprocess.Popen) -> None:
    """Kill every process of ``job``'s session (Open MPI 5 gives each rank a process group of
    its own, so ``killpg`` of the launcher's would miss the ranks) and wait for it."""
    _signal_session(job.pid, signal.SIGKILL)
    job.wait()


def _signal_session(sid: int, sig: int) -> None:
    """Send ``sig`` to every process of session ``sid`` (found in ``/proc``), its leader last."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid:    # the fields after the name: state, ppid, pgrp, session
                members.append(int(stat.parent.name))
    for pid in sorted(members, key=lambda pid: pid == sid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
