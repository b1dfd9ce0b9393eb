"""The ``tensorplay-hpc`` command (also ``python -m tensorplay_hpc``).

Subcommands:
    train   train a character-level transformer data parallel over MPI, with checkpoints,
            preemption and resume (``tensorplay-hpc train --help``).
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from tensorplay_hpc.train import cli as train_cli


def main(argv: Optional[List[str]] = None) -> int:
    """Parse the command line and run the subcommand; returns its exit status."""
    parser = argparse.ArgumentParser(
        prog="tensorplay-hpc", description="MPI-native distributed training tools for PyTorch.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    train = commands.add_parser("train", help="train a character-level transformer over MPI",
                                description=train_cli.DESCRIPTION)
    train_cli.add_arguments(train)
    train.set_defaults(handler=train_cli.run)
    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
