"""``tensorplay-hpc train``: the command-line options, mapped onto :class:`TrainConfig`."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .config import (COMM_HOOKS, DELTA_DTYPES, DEVICES, INNER_OPTIMIZERS, OPTIMIZERS, TrainConfig,
                     UsageError)
from .extras import require_train_extras
from .preemption import EXIT_PREEMPTED, Preemption
from .recovery import EXIT_UNRECOVERABLE, Unrecoverable

__all__ = ["DESCRIPTION", "add_arguments", "config_from", "run"]

DESCRIPTION = f"""\
Train a small character-level transformer on the source of Python's standard library, data
parallel over MPI: launch one process per rank with mpiexec or srun. SIGTERM or SIGUSR1 make
every rank finish its step, write a checkpoint and exit with status {EXIT_PREEMPTED}; --resume
continues from the newest checkpoint with the losses of an uninterrupted run."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``train``, with :class:`TrainConfig`'s defaults."""
    d = TrainConfig()

    def option(group, flag: str, help: str, **kwargs) -> None:
        if "default" not in kwargs and kwargs.get("action") is None:
            kwargs["default"] = getattr(d, flag[2:].replace("-", "_"))
        if "default" in kwargs and kwargs["default"] is not None:
            help += " (default %(default)s)"
        group.add_argument(flag, help=help, **kwargs)

    what = parser.add_argument_group("training")
    option(what, "--optimizer", "zero: DDP + ZeroRedundancyOptimizer; postlocal: post-local SGD "
           "with periodic model averaging; ddp: DDP + a plain optimizer; local: a plain "
           "optimizer, gradients averaged by one allreduce; fsdp: PyTorch's FSDP2 over MPI "
           "(ZeRO-3); hsdp: FSDP2 sharded within each node, replicated across nodes; diloco: "
           "each rank steps --inner on its own, and every --sync-every steps the ranks "
           "average their models' changes and an outer Nesterov SGD applies them",
           choices=OPTIMIZERS)
    option(what, "--inner", "the torch.optim optimizer inside", choices=INNER_OPTIMIZERS)
    option(what, "--lr", "learning rate", type=float)
    option(what, "--batch-size", "sequences per step over all ranks, a multiple of the number "
           "of ranks", type=int)
    option(what, "--steps", "optimizer steps in total", type=int)
    option(what, "--seed", "seed of the initial weights and of the batches", type=int)
    option(what, "--average-period", "postlocal: steps between model averagings", type=int)
    option(what, "--warmup-steps", "postlocal: steps of global gradient averaging first; "
           "powersgd: steps of plain averaging before compression (at least 2)", type=int)
    option(what, "--comm-hook", "zero and ddp: how gradients are averaged: none (allreduce), "
           "fp16 or bf16 (compressed to 16 bits), powersgd (low-rank compression with error "
           "feedback), hierarchical (within nodes, then across them)", choices=COMM_HOOKS)
    option(what, "--powersgd-rank", "powersgd: rank of the gradient approximation", type=int)
    option(what, "--sync-every", "diloco: inner steps between two syncs of each fragment",
           type=int)
    option(what, "--outer-lr", "diloco: learning rate of the outer SGD", type=float)
    option(what, "--outer-momentum", "diloco: Nesterov momentum of the outer SGD", type=float)
    option(what, "--fragments", "diloco: parts of the model synced in turn, each every "
           "--sync-every steps, staggered", type=int)
    option(what, "--delta-dtype", "diloco: the type the model changes are averaged in",
           choices=DELTA_DTYPES)
    option(what, "--overlap-steps", "diloco: inner steps a sync runs behind, overlapped with "
           "them, before it is applied (0: applied at once)", type=int)
    option(what, "--node-local", "diloco: the ranks of each node average their gradients at "
           "every step, and DiLoCo runs between the nodes (one replica per node)",
           action="store_true")
    model = parser.add_argument_group("model")
    option(model, "--layers", "transformer blocks", type=int)
    option(model, "--width", "embedding width", type=int)
    option(model, "--heads", "attention heads", type=int)
    option(model, "--context", "bytes per sequence", type=int)
    files = parser.add_argument_group("files and checkpoints")
    option(files, "--run-dir", "where metrics.csv and loss.png go", type=Path)
    option(files, "--checkpoint-dir", "where checkpoints go (default RUN_DIR/checkpoints)",
           type=Path, default=None)
    option(files, "--checkpoint-every", "steps between checkpoints, 0 for only at the end and "
           "on a signal", type=int)
    option(files, "--keep", "checkpoints kept, 0 for all", type=int)
    option(files, "--resume", "continue from the newest good checkpoint written with the same "
           "model shape and --inner (start afresh if there is no checkpoint; refuse if none "
           "fits)", action="store_true")
    option(files, "--eval-every", "steps between validation losses, 0 for only at the end",
           type=int)
    option(files, "--eval-batches", "validation batches each time", type=int)
    machine = parser.add_argument_group("machine")
    option(machine, "--device", "cuda: one GPU per node-local rank", choices=DEVICES)
    option(machine, "--threads", "torch threads per rank, 0 for the node's cores over its ranks",
           type=int)
    option(machine, "--recover", "survive a lost rank in the job (ULFM: Open MPI 5 launched "
           "with mpiexec --with-ft ulfm; every --optimizer and --comm-hook): the survivors roll "
           "back to the newest step all of them committed and go on with fewer ranks; where "
           f"they cannot, they exit with status {EXIT_UNRECOVERABLE} (requeue)",
           action="store_true")
    option(machine, "--recover-every", "--recover: steps between commits (a commit keeps the "
           "state in memory and sends what each rank alone holds, such as shards, to a partner "
           "rank); a recovery repeats the steps since the last commit", type=int)
    option(machine, "--min-ranks", "--recover: the fewest ranks to go on with", type=int)
    option(machine, "--collective-timeout", "seconds a collective may wait for the other ranks "
           "before the job is aborted with a report of the missing ranks, 0 for no watchdog",
           type=float)
    output = parser.add_argument_group("output")
    output.add_argument("--no-progress", dest="progress", action="store_false",
                        help="no progress bar: a line every --log-every steps instead (for batch "
                        "logs; also when standard output is not a terminal)")
    option(output, "--log-every", "steps between progress lines without a bar, 0 for only the "
           "last step and validation losses", type=int)
    option(output, "--trace", "write every collective and one-sided operation, with the compute "
           "of each step, as Chrome trace JSON to DIR (trace-rank<R>.json, trace.json for all "
           "ranks) and a timeline of the last steps to DIR/timeline.png",
           type=Path, default=None, metavar="DIR")


def config_from(args: argparse.Namespace) -> TrainConfig:
    """The :class:`TrainConfig` of parsed ``train`` options."""
    names = set(TrainConfig.__dataclass_fields__)
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in names})


def run(args: argparse.Namespace) -> int:
    """Run ``train`` on every rank; return the exit status. A failure on one rank prints its
    traceback with the rank and aborts the whole job, and a collective stalled past
    ``--collective-timeout`` is reported and aborted, so no rank waits forever."""
    # Catch the signals before the slow setup, so one sent during it still counts, and until the
    # process ends, so one sent just after the last step cannot kill a finished rank.
    preemption = Preemption().install()
    from tensorplay_hpc.comm.mpi import MPI

    from tensorplay_hpc.comm import abort_on_exception, fault_tolerance, watchdog

    world = MPI.COMM_WORLD
    try:
        require_train_extras()
    except ImportError as error:  # the same environment, so the same on every rank
        return _usage_error(error, world)
    try:
        config = config_from(args)
        config.check_ranks(world.Get_size())
    except ValueError as error:
        return _usage_error(error, world)
    if world.Get_size() > 1:
        abort_on_exception()
    if config.collective_timeout:
        watchdog.enable(config.collective_timeout)
    from .loop import train
    try:
        status = train(config, world, preemption).exit_code
    except UsageError as error:  # raised on every rank alike
        return _usage_error(error, world)
    except (Unrecoverable, fault_tolerance.RankLost) as error:   # on every survivor
        why = (error if isinstance(error, Unrecoverable) else
               f"--recover: a rank was lost outside a training step and its validation (in a "
               f"checkpoint, the setup or the end of the run), where the survivors do not go "
               f"on: {error}")
        print(f"tensorplay-hpc train: world rank {world.Get_rank()}: {why}; exiting with "
              f"status {EXIT_UNRECOVERABLE} to be requeued from the last checkpoint",
              file=sys.stderr, flush=True)
        _exit_without_finalize(EXIT_UNRECOVERABLE)
    if fault_tolerance.finalize_would_stall():   # the run went on without lost ranks
        _exit_without_finalize(status)
    return status


def _exit_without_finalize(status: int) -> None:
    """End the process at once with ``status``. With a rank lost, MPI_Finalize and the
    interpreter's teardown of objects holding revoked communicators (and operations that will
    never complete) can stall."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _usage_error(error: Exception, world) -> int:
    if world.Get_rank() == 0:
        print(f"tensorplay-hpc train: error: {error}", file=sys.stderr)
    return 2
