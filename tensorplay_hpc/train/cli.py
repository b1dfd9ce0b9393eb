"""``tensorplay-hpc train``: the command-line options, mapped onto :class:`TrainConfig`."""
from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

from .config import DEVICES, INNER_OPTIMIZERS, OPTIMIZERS, TrainConfig
from .preemption import EXIT_PREEMPTED, Preemption

DESCRIPTION = f"""\
Train a small character-level transformer on the source of Python's standard library, data
parallel over MPI: launch one process per rank with mpiexec or srun. SIGTERM or SIGUSR1 make
every rank finish its step, write a checkpoint and exit with status {EXIT_PREEMPTED}; --resume
continues from the newest checkpoint with the losses of an uninterrupted run."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``train``, with :class:`TrainConfig`'s defaults."""
    d = TrainConfig()
    what = parser.add_argument_group("training")
    what.add_argument("--optimizer", choices=OPTIMIZERS, default=d.optimizer,
                      help="zero: DDP + ZeroRedundancyOptimizer; postlocal: post-local SGD with "
                      "periodic model averaging; ddp: DDP + a plain optimizer; local: a plain "
                      "optimizer, gradients averaged by one allreduce (default %(default)s)")
    what.add_argument("--inner", choices=INNER_OPTIMIZERS, default=d.inner,
                      help="the torch.optim optimizer inside (default %(default)s)")
    what.add_argument("--lr", type=float, default=d.lr, help="learning rate (default %(default)s)")
    what.add_argument("--batch-size", type=int, default=d.batch_size,
                      help="sequences per step over all ranks, a multiple of the number of "
                      "ranks (default %(default)s)")
    what.add_argument("--steps", type=int, default=d.steps, help="optimizer steps (default %(default)s)")
    what.add_argument("--seed", type=int, default=d.seed, help="seed of weights and batches (default %(default)s)")
    what.add_argument("--average-period", type=int, default=d.average_period,
                      help="postlocal: steps between model averagings (default %(default)s)")
    what.add_argument("--warmup-steps", type=int, default=d.warmup_steps,
                      help="postlocal: steps of global gradient averaging first (default %(default)s)")
    model = parser.add_argument_group("model")
    model.add_argument("--layers", type=int, default=d.layers, help="transformer blocks (default %(default)s)")
    model.add_argument("--width", type=int, default=d.width, help="embedding width (default %(default)s)")
    model.add_argument("--heads", type=int, default=d.heads, help="attention heads (default %(default)s)")
    model.add_argument("--context", type=int, default=d.context, help="bytes per sequence (default %(default)s)")
    files = parser.add_argument_group("files and checkpoints")
    files.add_argument("--run-dir", type=Path, default=d.run_dir,
                       help="where metrics.csv and loss.png go (default %(default)s)")
    files.add_argument("--checkpoint-dir", type=Path, default=None,
                       help="where checkpoints go (default RUN_DIR/checkpoints)")
    files.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every,
                       help="steps between checkpoints, 0 for only at the end and on a signal "
                       "(default %(default)s)")
    files.add_argument("--keep", type=int, default=d.keep,
                       help="checkpoints kept, 0 for all (default %(default)s)")
    files.add_argument("--resume", action="store_true",
                       help="continue from the newest good checkpoint (start afresh if none)")
    files.add_argument("--eval-every", type=int, default=d.eval_every,
                       help="steps between validation losses, 0 for only at the end (default %(default)s)")
    files.add_argument("--eval-batches", type=int, default=d.eval_batches,
                       help="validation batches each time (default %(default)s)")
    machine = parser.add_argument_group("machine")
    machine.add_argument("--device", choices=DEVICES, default=d.device,
                         help="cuda: one GPU per node-local rank (default %(default)s)")
    machine.add_argument("--threads", type=int, default=d.threads,
                         help="torch threads per rank, 0 for the node's cores over its ranks "
                         "(default %(default)s)")
    machine.add_argument("--no-progress", dest="progress", action="store_false",
                         help="no progress bar, only event lines (for batch logs)")


def config_from(args: argparse.Namespace) -> TrainConfig:
    """The :class:`TrainConfig` of parsed ``train`` options."""
    names = set(TrainConfig.__dataclass_fields__)
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in names})


def run(args: argparse.Namespace) -> int:
    """Run ``train`` on every rank; return the exit status. A failure on one rank prints its
    traceback with the rank and aborts the whole job, so no rank waits forever."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    try:
        config = config_from(args)
    except ValueError as error:
        if world.Get_rank() == 0:
            print(f"tensorplay-hpc train: error: {error}", file=sys.stderr)
        return 2
    try:
        with Preemption() as preemption:  # before the slow setup: a signal then still counts
            from .loop import train
            return train(config, world, preemption).exit_code
    except BaseException as error:  # noqa: B036 - any failure must take the whole job down
        if world.Get_size() == 1 or isinstance(error, SystemExit):
            raise
        sys.stderr.write(f"tensorplay-hpc train: rank {world.Get_rank()} failed:\n"
                         f"{traceback.format_exc()}")
        sys.stderr.flush()
        world.Abort(1)
        return 1

