"""The figures of docs/reliability.md: the seconds from killing one rank (SIGKILL) of a 4-rank
training job to the survivors' first step after it, with ``--recover`` (ULFM, in the job) and
as today (the job ends, is launched again and resumes from its HDF5 checkpoint of the step
before; the wait in the batch queue not counted). Both under the ``openmpi5`` lane, with
``recovery_job.py``'s model; the median of ``--repeats`` runs of each.

    TENSORPLAY_MPI=openmpi5 source scripts/env.sh
    python tests/support/recovery_figures.py [--repeats 3] [--step 9] [--nodes]
    python tests/support/recovery_figures.py --redundancy [--repeats 3] [--train "OPTIONS"]

``--nodes`` (as root) runs the jobs over 2 simulated nodes of 2 ranks and kills the second
node's two ranks instead of one rank.

``--redundancy`` measures instead what ``--recover`` costs a 4-rank ``--optimizer zero`` job
(the training job's default model, Adam; ``--train`` gives other training options, such as
``"--optimizer fsdp"``) while nothing fails: its mean step time and the bytes each rank sends
per step, without it, with a commit every step and every 4 steps, runs alternating.

The requeued job writes a checkpoint every 3 steps (in the background), resumes from the newest
complete one and repeats the steps after it, as a requeued job does; the recovered one writes
none (it needs none, and a rank lost while a checkpoint is being written slows the recovery).
"""
import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Optional

import ulfm_lane
from launch import REPO, SUPPORT, clean_env
from simulated_nodes import SimulatedNodes
from tensorplay_hpc.train.config import TrainConfig

JOB = str(SUPPORT / "recovery_job.py")
MODEL = ["--optimizer", "ddp", "--inner", "adam", "--batch-size", "12", "--layers", "2",
         "--width", "64", "--heads", "2", "--context", "64", "--eval-every", "0",
         "--eval-batches", "1", "--no-progress", "--log-every", "0", "--threads", "1"]


def _run(args, ft: bool, nodes: Optional[SimulatedNodes] = None) -> str:
    command = ulfm_lane.command(4, args, nodes, ft)
    done = subprocess.run(command, env=clean_env(TENSORPLAY_MPI=ulfm_lane.LANE), cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    return done.stdout + done.stderr


def _time(output: str, what: str) -> float:
    return min(float(t) for t in re.findall(rf"{what} at ([0-9.]+)", output))


def _killed(nodes: Optional[SimulatedNodes]) -> str:
    """The ranks to kill: world rank 2, or the second node's (2 and 3) over ``nodes``."""
    return "2" if nodes is None else "2,3"


def recovered(step: int, steps: int, folder: Path, nodes: Optional[SimulatedNodes]) -> float:
    output = _run([JOB, _killed(nodes), str(step), "--steps", str(steps), "--run-dir",
                   str(folder), "--checkpoint-every", "0", "--recover", *MODEL], True, nodes)
    return _time(output, "first step after recovery") - _time(output, "killing")


def requeued(step: int, steps: int, folder: Path, nodes: Optional[SimulatedNodes]) -> float:
    common = ["--steps", str(steps), "--run-dir", str(folder), "--checkpoint-every", "3", *MODEL]
    killed = _time(_run([JOB, _killed(nodes), str(step), *common], False, nodes), "killing")
    again = _run([JOB, "-1", "0", "--resume", *common], False, nodes)
    if "resumed from" not in again:
        raise RuntimeError(f"the second run did not resume:\n{again[-3000:]}")
    return _time(again, "first step") - killed


REDUNDANCY = {"without": [], "every step": ["--recover"],
              "every 4 steps": ["--recover", "--recover-every", "4"]}


def step_cost(options: list, steps: int, folder: Path) -> tuple:
    """The mean step time (s) and the mean bytes rank 0 sends per step of a 4-rank job (ZeRO
    unless ``options`` say otherwise) with ``options``, without failures, from its
    ``metrics.csv`` (the last row's tokens/s is the whole run's)."""
    args = ["-m", "tensorplay_hpc", "train", "--optimizer", "zero", "--inner", "adam",
            "--steps", str(steps), "--run-dir", str(folder), "--checkpoint-every", "0",
            "--eval-every", "0", "--eval-batches", "1", "--no-progress", "--log-every", "0",
            "--threads", "1", *options]
    output = _run(args, ft=True)
    metrics = folder / "metrics.csv"
    if not metrics.exists():
        raise RuntimeError(f"the job wrote no metrics:\n{output[-3000:]}")
    rows = [line.split(",") for line in metrics.read_text().splitlines()[1:]]
    defaults = TrainConfig()
    tokens_per_step = defaults.batch_size * defaults.context
    return tokens_per_step / float(rows[-1][3]), statistics.mean(int(r[4]) for r in rows)


def redundancy(repeats: int, train: list) -> None:
    samples = {case: [] for case in REDUNDANCY}
    for repeat in range(repeats):
        for case, options in REDUNDANCY.items():
            with tempfile.TemporaryDirectory(dir="/var/tmp") as folder:
                samples[case].append(step_cost([*train, *options], 40, Path(folder)))
            print(f"--recover {case} {repeat}: {samples[case][-1][0] * 1e3:.1f} ms per step, "
                  f"{samples[case][-1][1]:.0f} bytes per rank and step", flush=True)
    times = {case: [t for t, _ in values] for case, values in samples.items()}
    baseline = statistics.median(times["without"])
    for case in list(REDUNDANCY)[1:]:
        ours = statistics.median(times[case])
        print(json.dumps({"bench": "recovery", "case": f"step, --recover {case}",
                          "train": " ".join(train),
                          "ranks": 4, "ours_s": ours, "baseline": "no --recover",
                          "baseline_s": baseline, "cost": ours / baseline - 1,
                          "bytes_per_rank_step": {c: v[0][1] for c, v in samples.items()},
                          "samples": times, "at": time.strftime("%Y-%m-%d %H:%M")}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--step", type=int, default=9)
    parser.add_argument("--redundancy", action="store_true",
                        help="measure the cost of --recover without failures instead")
    parser.add_argument("--train", default="",
                        help="--redundancy: training options (default: --optimizer zero)")
    parser.add_argument("--nodes", action="store_true",
                        help="over 2 simulated nodes, killing the second node's ranks")
    options = parser.parse_args()
    if ulfm_lane.missing():
        sys.exit(ulfm_lane.missing())
    if options.redundancy:
        return redundancy(options.repeats, options.train.split())
    with SimulatedNodes(nodes=2, slots=2) if options.nodes else nullcontext() as nodes:
        times = {"recover": [], "requeue": []}
        for repeat in range(options.repeats):
            for case, measure in (("recover", recovered), ("requeue", requeued)):
                with tempfile.TemporaryDirectory(dir="/var/tmp") as folder:
                    times[case].append(measure(options.step, options.step + 3, Path(folder),
                                               nodes))
                print(f"{case} {repeat}: {times[case][-1]:.2f} s", flush=True)
    ours, baseline = statistics.median(times["recover"]), statistics.median(times["requeue"])
    lost = "one of 4 ranks" if nodes is None else "one of 2 simulated nodes of 2 ranks"
    print(json.dumps({"bench": "recovery", "case": f"kill {lost} to the next step",
                      "ranks": 4, "ours_s": ours, "baseline": "requeue + HDF5 reload",
                      "baseline_s": baseline, "speedup": baseline / ours,
                      "samples": times, "at": time.strftime("%Y-%m-%d %H:%M")}))


if __name__ == "__main__":
    main()
