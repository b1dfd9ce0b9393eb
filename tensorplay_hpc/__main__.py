"""The ``tensorplay-hpc`` command (also ``python -m tensorplay_hpc``).

Subcommands:
    train   train a character-level transformer data parallel over MPI, with checkpoints,
            preemption and resume (``tensorplay-hpc train --help``).
    bench   run the benchmarks (``tensorplay-hpc bench --help``).
    checkpoint  inspect, list and convert checkpoints (``tensorplay-hpc checkpoint --help``).
    env     what this installation and launch can do (``tensorplay-hpc env --help``).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

import tensorplay_hpc
from tensorplay_hpc.bench import cli as bench_cli
from tensorplay_hpc.checkpoint import cli as checkpoint_cli
from tensorplay_hpc.diagnostics import cli as env_cli
from tensorplay_hpc.train import cli as train_cli

# Each launcher tells a process its rank in the job, before MPI is initialized.
_RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")


def _launch_rank() -> int:
    for name in _RANK_VARIABLES:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


class _Parser(argparse.ArgumentParser):
    """Under a launcher, help, version and usage errors are printed by the first rank only."""

    def _print_message(self, message: str, file=None) -> None:
        if _launch_rank() == 0:
            super()._print_message(message, file)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="tensorplay-hpc", description="MPI-native distributed training tools for PyTorch.")
    version = f"tensorplay-hpc {tensorplay_hpc.__version__}"
    parser.add_argument("--version", action="version", version=version)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module, summary in (
            ("train", train_cli, "train a character-level transformer over MPI"),
            ("bench", bench_cli, "run the benchmarks under mpiexec or srun"),
            ("checkpoint", checkpoint_cli, "inspect, list and convert checkpoints (info, list, "
             "export, import)"),
            ("env", env_cli, "what this installation and launch can do (for bug reports)")):
        command = commands.add_parser(name, help=summary, description=module.DESCRIPTION)
        command.add_argument("--version", action="version", version=version)
        module.add_arguments(command)
        command.set_defaults(handler=module.run)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Parse the command line and run the subcommand; returns its exit status."""
    args = _parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
