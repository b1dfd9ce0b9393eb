"""Bytes to loss: the training job's char-LM at 4 ranks over 2 simulated nodes whose link is
throttled, for DDP, post-local SGD and DiLoCo (a replica per rank, or per node with
``--node-local``), the same seed and batches for each, and the same steps but for two DiLoCo
runs of twice as many (a faster method may take more steps to reach the same loss).

Every case runs ``tensorplay-hpc train`` as a job of its own across the nodes of
``tests/support/simulated_nodes.py`` (Linux namespaces, TCP between them, each node's link
limited to :data:`LINK` by ``tc``), so it needs root and the repository's checkout. A case reports its final
validation loss, the bytes the nodes sent each other (``cross_node_bytes`` of ``metrics.csv``)
and its training time (the steps alone, from the job's own throughput; startup, validation and
checkpoints left out), each against DDP's, and the bytes and time at its first validation within
:data:`REACHED` of DDP's final loss. The table, one JSON object per case and a plot of
validation loss against bytes and against time go to :data:`OUTPUT` in the working folder.

Run it as one process: ``python -m tensorplay_hpc.bench local-sgd``.
"""
from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import tensorplay_hpc
from tensorplay_hpc.bench.report import Report
from tensorplay_hpc.comm.mpi import MPI

__all__ = ["CASES", "COMMON", "LINK", "OUTPUT", "RANKS", "REACHED", "STEPS", "Case", "Curve",
           "run"]

LINK = "100mbit"
"""The rate each node may send at (``tc ... tbf``); this kernel has no ``netem``, so no delay."""
RANKS, NODES = 4, 2
OUTPUT = Path("local-sgd")
"""Where the table (``table.md``), the JSON lines (``results.jsonl``), the plot
(``local-sgd.png``) and each case's ``metrics.csv`` (as ``CASE.csv``) go."""
STEPS = 512
"""The steps of a case, unless it says otherwise."""
REACHED = 0.02
"""A case reaches DDP's loss at its first validation at most this fraction above DDP's final."""
COMMON = ["--layers", "2", "--width", "64", "--heads", "4", "--context", "64",
          "--batch-size", "32", "--inner", "adamw", "--lr", "0.003", "--seed", "0",
          "--eval-every", "64", "--eval-batches", "8", "--checkpoint-every", "0",
          "--warmup-steps", "32", "--threads", "1", "--no-progress", "--log-every", "64"]
"""The settings every case shares."""


@dataclass(frozen=True)
class Case:
    """One training run: a name for the table and the options that make it."""

    name: str
    options: Tuple[str, ...]
    steps: int = STEPS


def _diloco(sync: int, fragments: int = 1, dtype: str = "float32",
            node_local: bool = False, steps: int = STEPS) -> Case:
    name = f"diloco H={sync}" + (f" fragments={fragments}" if fragments > 1 else "") + (
        f" {dtype}" if dtype != "float32" else "") + (" node-local" if node_local else "") + (
        f" {steps} steps" if steps != STEPS else "")
    return Case(name, ("--optimizer", "diloco", "--sync-every", str(sync), "--fragments",
                       str(fragments), "--delta-dtype", dtype,
                       *(("--node-local",) if node_local else ())), steps)


CASES: Sequence[Case] = (
    Case("ddp", ("--optimizer", "ddp")),
    Case("postlocal period=4", ("--optimizer", "postlocal", "--average-period", "4")),
    Case("postlocal period=16", ("--optimizer", "postlocal", "--average-period", "16")),
    _diloco(16), _diloco(64), _diloco(256), _diloco(16, dtype="bfloat16"),
    _diloco(64, fragments=4), _diloco(64, fragments=4, dtype="bfloat16"),
    _diloco(16, dtype="bfloat16", node_local=True), _diloco(64, node_local=True),
    _diloco(64, steps=2 * STEPS), _diloco(64, node_local=True, steps=2 * STEPS))


@dataclass
class Curve:
    """What a finished case's ``metrics.csv`` says: at each validation, the step, the loss, the
    cross-node bytes and the training seconds so far."""

    steps: List[int]
    losses: List[float]
    crossed: List[int]
    seconds: List[float]

    @classmethod
    def read(cls, metrics: Path, tokens_per_step: int) -> "Curve":
        curve = cls([], [], [], [])
        with open(metrics, newline="") as f:
            for row in csv.DictReader(f):
                if row["validation_loss"]:
                    step = int(row["step"])
                    curve.steps.append(step)
                    curve.losses.append(float(row["validation_loss"]))
                    curve.crossed.append(int(row["cross_node_bytes"]))
                    curve.seconds.append(step * tokens_per_step / float(row["tokens_per_second"]))
        return curve

    def first_within(self, loss: float) -> Optional[int]:
        """The position of the first validation at or below ``loss``; ``None`` if none is."""
        return next((i for i, value in enumerate(self.losses) if value <= loss), None)


def _support_folder() -> Path:
    """The checkout's ``tests/support`` folder, which holds the simulated nodes."""
    support = Path(tensorplay_hpc.__file__).resolve().parents[1] / "tests" / "support"
    if not (support / "simulated_nodes.py").exists():
        raise RuntimeError(f"local-sgd runs its jobs on the simulated nodes of the repository's "
                           f"tests/support/simulated_nodes.py, which is not in {support}: run it "
                           "from a checkout (pip install -e .)")
    return support


def _run_case(case: Case, cluster, launch) -> Curve:
    """Train ``case`` across the nodes of ``cluster`` (its run folder on the cluster's shared
    scratch, its ``metrics.csv`` then kept in :data:`OUTPUT`); its validation curve."""
    folder = case.name.replace(" ", "_").replace("=", "")
    run_dir = cluster.scratch / folder
    command = [*launch.mpiexec_prefix(cluster), "-n", str(RANKS), sys.executable, "-m",
               "tensorplay_hpc", "train", *COMMON, "--steps", str(case.steps), *case.options,
               "--run-dir", str(run_dir)]
    started = time.perf_counter()
    result = subprocess.run(command, env=launch.clean_env(), capture_output=True, text=True,
                            timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"local-sgd: the case {case.name!r} failed ({result.returncode}):\n"
                           f"{result.stdout[-3000:]}{result.stderr[-3000:]}")
    print(f"  {case.name}: {time.perf_counter() - started:.0f} s", flush=True)
    tokens = int(COMMON[COMMON.index("--batch-size") + 1]) * int(
        COMMON[COMMON.index("--context") + 1])
    kept = OUTPUT / f"{folder}.csv"
    shutil.copyfile(run_dir / "metrics.csv", kept)
    return Curve.read(kept, tokens)


def _plot(curves: Dict[str, Curve], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, (by_bytes, by_time) = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    colors = plt.get_cmap("tab20").colors   # more cases than the default cycle's 10 colors
    for (name, curve), color in zip(curves.items(), colors[::2] + colors[1::2]):
        style = dict(linestyle="-" if name.startswith("diloco") else "--", marker=".",
                     color=color, label=name)
        by_bytes.plot([max(b, 1) / 1e6 for b in curve.crossed], curve.losses, **style)
        by_time.plot(curve.seconds, curve.losses, **style)
    by_bytes.set_xscale("log")
    by_bytes.set_xlabel("MB sent between the nodes (log scale)")
    by_bytes.set_ylabel("validation loss (nats per byte)")
    by_time.set_xlabel("training time (s)")
    by_time.legend(fontsize="small")
    figure.suptitle(f"char-LM, {RANKS} ranks on {NODES} simulated nodes, link {LINK}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _table(rows: List[dict]) -> str:
    lines = ["| case | steps | validation loss | vs DDP | MB between nodes | vs DDP | training s | "
             f"vs DDP | DDP's loss +{REACHED:.0%} reached at: step, MB, s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        reached = ("not reached" if r["reached_step"] is None else
                   f"{r['reached_step']}, {r['reached_bytes'] / 1e6:.1f}, {r['reached_s']:.1f}")
        lines.append(f"| {r['case']} | {r['steps']} | {r['validation_loss']:.4f} | "
                     f"{r['loss_ratio']:.3f} | {r['bytes'] / 1e6:.1f} | {r['bytes_ratio']:.4f} | "
                     f"{r['ours_s']:.1f} | {r['ours_s'] / r['baseline_s']:.2f} | {reached} |")
    return "\n".join(lines) + "\n"


def _reached(curve: Curve, loss: float) -> Dict[str, Optional[float]]:
    """The step, bytes and seconds at ``curve``'s first validation at or below ``loss``."""
    at = curve.first_within(loss)
    if at is None:
        return {"reached_step": None, "reached_bytes": None, "reached_s": None}
    return {"reached_step": curve.steps[at], "reached_bytes": curve.crossed[at],
            "reached_s": curve.seconds[at]}


def run(report: Report) -> None:
    """Run every case in turn on one process (it launches the jobs) and write the outputs."""
    if MPI.COMM_WORLD.Get_size() != 1:
        raise RuntimeError("local-sgd launches jobs of its own across simulated nodes: run it as "
                           "one process (python -m tensorplay_hpc.bench local-sgd), not under "
                           f"mpiexec -n {MPI.COMM_WORLD.Get_size()}")
    sys.path.insert(0, str(_support_folder()))
    import launch
    from simulated_nodes import SimulatedNodes
    OUTPUT.mkdir(parents=True, exist_ok=True)
    curves: Dict[str, Curve] = {}
    print(f"local-sgd: {len(CASES)} cases, {RANKS} ranks on {NODES} simulated nodes, link "
          f"{LINK}; outputs in {OUTPUT.resolve()}", flush=True)
    with SimulatedNodes(NODES, RANKS // NODES, throttle=LINK) as cluster:
        for case in CASES:
            curves[case.name] = _run_case(case, cluster, launch)
    ddp = curves[CASES[0].name]
    rows = [report.add("local-sgd", name, curve.seconds[-1], CASES[0].name, ddp.seconds[-1],
                       nbytes=curve.crossed[-1], ranks=RANKS, link=LINK,
                       steps=curve.steps[-1], validation_loss=curve.losses[-1],
                       loss_ratio=curve.losses[-1] / ddp.losses[-1],
                       bytes_ratio=curve.crossed[-1] / ddp.crossed[-1],
                       **_reached(curve, ddp.losses[-1] * (1 + REACHED)))
            for name, curve in curves.items()]
    (OUTPUT / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (OUTPUT / "table.md").write_text(_table(rows))
    _plot(curves, OUTPUT / "local-sgd.png")
    print(f"\n{_table(rows)}\nplot: {OUTPUT / 'local-sgd.png'}", flush=True)
