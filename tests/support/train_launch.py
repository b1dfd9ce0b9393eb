"""Helpers of the tests that launch ``tensorplay-hpc train`` and the job scripts as programs."""
from __future__ import annotations

import csv
import os
import signal
import subprocess
from pathlib import Path
from typing import Dict, List, Optional

from launch import clean_env, mpiexec_prefix
from tensorplay_hpc.train.preemption import EXIT_PREEMPTED
from simulated_nodes import SimulatedNodes

TINY = ["--layers", "1", "--width", "32", "--heads", "2", "--context", "16", "--batch-size", "8",
        "--eval-every", "0", "--eval-batches", "1", "--no-progress", "--threads", "1"]
"""A model and batch small enough that a step takes milliseconds."""


def train_command(ranks: int, *options: str, nodes: Optional[SimulatedNodes] = None) -> List[str]:
    """``mpiexec -n RANKS python -m tensorplay_hpc train TINY OPTIONS``, on this node or across
    the simulated ``nodes`` (run from a folder they all see, such as ``tmp_path``)."""
    return [*mpiexec_prefix(nodes), "-n", str(ranks), "python", "-m", "tensorplay_hpc", "train",
            *TINY, *options]


def on_read_only_mount(folder: Path, command: List[str]) -> List[str]:
    """``command`` run in a mount namespace of its own in which ``folder`` is a read-only file
    system (a read-only bind mount of itself): read-only for root too, unlike ``chmod``. Root
    may mount; another user is mapped to root in a user namespace."""
    unshare = ["unshare", "--mount", *([] if os.geteuid() == 0 else ["--map-root-user"])]
    return [*unshare, "sh", "-c", 'mount --bind -o ro "$0" "$0" && exec "$@"', str(folder),
            *command]


def losses(run_dir: Path) -> List[str]:
    """The loss column of a run's metrics.csv, as written (exact text)."""
    with open(run_dir / "metrics.csv", newline="") as f:
        return [row["loss"] for row in csv.DictReader(f)]


def restarts(run_dir: Path) -> List[int]:
    """The steps of metrics.csv marked as the first after a restart."""
    with open(run_dir / "metrics.csv", newline="") as f:
        return [int(row["step"]) for row in csv.DictReader(f) if row["restart"] == "1"]


def cross_node_bytes(run_dir: Path) -> Dict[int, int]:
    """The bytes that had crossed between nodes, by the steps of metrics.csv that counted them."""
    with open(run_dir / "metrics.csv", newline="") as f:
        return {int(row["step"]): int(row["cross_node_bytes"]) for row in csv.DictReader(f)
                if row["cross_node_bytes"]}


def run_program(cwd: Path, ranks: int, run_dir: Path, *options: str,
                nodes: Optional[SimulatedNodes] = None) -> subprocess.CompletedProcess:
    """Run the program with ``options`` on ``ranks`` ranks (across ``nodes`` when given) to its
    end; it must succeed."""
    result = subprocess.run(train_command(ranks, *options, "--run-dir", str(run_dir),
                                          nodes=nodes),
                            cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def preempt_program(cwd: Path, ranks: int, run_dir: Path, step: int, *options: str,
                    nodes: Optional[SimulatedNodes] = None) -> str:
    """Run the program (across ``nodes`` when given), send SIGUSR1 to mpiexec (which forwards
    it to every rank) once the checkpoint of ``step`` is written; return its output. It must
    stop with a checkpoint."""
    job = subprocess.Popen(train_command(ranks, *options, "--run-dir", str(run_dir), nodes=nodes),
                           cwd=cwd, env=clean_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in job.stdout:
        seen.append(line)
        if f"checkpoint at step {step} " in line:
            job.send_signal(signal.SIGUSR1)
            break
    seen.extend(job.stdout)
    output = "".join(seen)
    assert job.wait(timeout=300) == EXIT_PREEMPTED, output
    assert "SIGUSR1: stopping at step" in output and "(preempted)" in output
    return output
