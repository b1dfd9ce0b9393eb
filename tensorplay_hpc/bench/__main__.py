"""Entry point: ``mpiexec -n 2 python -m tensorplay_hpc.bench comm zero ...``."""
import argparse
import importlib
import pkgutil

import tensorplay_hpc.bench as package
from tensorplay_hpc.bench.report import Report

_HELPERS = {"report", "timing", "gloo", "models"}


def available() -> list:
    return sorted(m.name for m in pkgutil.iter_modules(package.__path__)
                  if m.name not in _HELPERS and not m.name.startswith("_"))


def main(argv=None) -> None:
    names = available()
    parser = argparse.ArgumentParser(prog="python -m tensorplay_hpc.bench",
                                     description="Run benchmarks under mpiexec.")
    parser.add_argument("benchmarks", nargs="+", choices=names, metavar="NAME",
                        help="one or more of: " + ", ".join(names))
    parser.add_argument("--repeat", type=int, default=7, help="timed runs per case (median)")
    args = parser.parse_args(argv)
    report = Report(repeat=args.repeat)
    for name in args.benchmarks:
        importlib.import_module(f"tensorplay_hpc.bench.{name}").run(report)
    report.print_table()


if __name__ == "__main__":
    main()
