"""``tensorplay-hpc bench`` (also ``python -m tensorplay_hpc.bench``): run benchmarks under
mpiexec or srun; each comparison is printed as a JSON line, and a table at the end."""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import warnings
from typing import List

import tensorplay_hpc.bench as package

__all__ = ["DESCRIPTION", "add_arguments", "available", "run"]

DESCRIPTION = """\
Run benchmarks on every rank of the launch (mpiexec -n N tensorplay-hpc bench NAME...). Each
comparison is printed as one JSON object per line as it is measured (ours against PyTorch over
gloo or RPC, and against raw mpi4py of the same bytes), then a table."""

_NOT_BENCHMARKS = {"cli", "report", "timing", "gloo", "models", "network"}


def available() -> List[str]:
    """The names of the benchmarks (the modules of this package, ``_`` written ``-``)."""
    return sorted(m.name.replace("_", "-") for m in pkgutil.iter_modules(package.__path__)
                  if m.name not in _NOT_BENCHMARKS and not m.name.startswith("_"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``bench``."""
    names = available()
    parser.add_argument("benchmarks", nargs="+", choices=names, metavar="NAME",
                        help="one or more of: " + ", ".join(names))
    parser.add_argument("--repeat", type=int, default=7,
                        help="timed runs per case, the median is reported (default %(default)s)")
    parser.add_argument("--project", action="store_true",
                        help="cost-model: also evaluate the model from 64 to 10,000 ranks")


def run(args: argparse.Namespace) -> int:
    """Run the benchmarks named in ``args``. Collective over ``MPI.COMM_WORLD``."""
    from tensorplay_hpc.bench.report import Report
    report = Report(repeat=args.repeat)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name in args.benchmarks:
            module = importlib.import_module(f"tensorplay_hpc.bench.{name.replace('-', '_')}")
            if name == "cost-model":
                module.run(report, project_too=args.project)
            else:
                module.run(report)
    report.print_table()
    # Warnings (mostly from the PyTorch baselines) once each after the tables, not amid them.
    seen = dict.fromkeys(f"{w.category.__name__}: {w.message}" for w in caught)
    if seen and report.rank == 0:
        print(f"\n{len(seen)} distinct warnings while measuring:")
        for text in seen:
            print(f"  {text.splitlines()[0][:200]}")
    return 0
