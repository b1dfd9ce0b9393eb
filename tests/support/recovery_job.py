"""``tensorplay-hpc train`` in which ranks die: ``recovery_job.py RANKS STEP TRAIN-OPTIONS``.

Each world rank of RANKS (one, or several joined by commas: a whole node) kills itself with SIGKILL
in step STEP + 1 (after committing step STEP, once its partner copies have arrived), as a crash
would end it; with STEP given as ``N/validation``, in the validation after step N instead; as
``N/copies``, in step N + 1 with its copies of step N held back (their exchange not begun); as
``N/commit``, at its commit of step N + 1 (every collective of that step done) with the bytes of
its copies of step N held back (their size sent): the partner waits for them, and the ranks whose
copies do not wait on the partner commit step N + 1, one step further. RANKS ``A>B`` kills A so,
and B when the survivors have shrunk their communicator the first time (in the recovery); ``A>>B``
kills B when the survivors start rebuilding their groups. Every rank prints ``kept S`` once it has
kept the state of step S, ``committed S DIGEST`` after each step it commits, and ``restored S
DIGEST`` once recovery has put back the state of step S, where DIGEST is a SHA-256 of its model and
optimizer state and of the communication hook's state but its error feedback (every tensor's
bytes); with PowerSGD's error feedback, also ``committed errors S SUM`` and ``restored errors S
SUM``, the sum of its elements (in float64). The kill prints ``killing at T`` with the time
(``time.time()``), the first step of the process ``first step at T`` and the first step after
recovery ``first step after recovery at T``. RANKS -1 kills no rank.
"""
import hashlib
import os
import signal
import sys
import time
from typing import List, Optional

import torch

from tensorplay_hpc.__main__ import main
from tensorplay_hpc.checkpoint.sharded_tensors import is_sharded
from tensorplay_hpc.comm import fault_tolerance, point_to_point
from tensorplay_hpc.comm.mpi import MPI
from tensorplay_hpc.comm.partner_copies import PartnerCopies
from tensorplay_hpc.comm.work import Work
from tensorplay_hpc.distributed.optim import ZeroRedundancyOptimizer
from tensorplay_hpc.train import loop, recovery


def error_sum(strategy) -> Optional[float]:
    """The sum of PowerSGD's error feedback, every element in float64 (``None`` without
    PowerSGD or before it compresses)."""
    errors = [v for k, v in strategy.hook_extra().items() if ".error_dict." in k]
    return sum(e.double().sum().item() for e in errors) if errors else None


def digest(strategy) -> str:
    """A SHA-256 of the model's, the optimizer's and the hook's state (but its error feedback,
    which a recovery changes), bit for bit: every tensor's dtype,
    shape and bytes, and every other value, in a fixed order (not ``torch.save``'s bytes, which
    depend on how tensors share storage). A ZeRO optimizer's whole state is consolidated on its
    rank 0 (collective), where it goes in; the other ranks' digests cover the model only."""
    hashed = hashlib.sha256()
    optimizer = strategy.optimizer
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer.consolidate_state_dict(to=0)
        whole = optimizer.state_dict() if optimizer.rank == 0 else "on rank 0"
    else:
        whole = optimizer.state_dict()

    def add(value) -> None:
        if is_sharded(value):   # FSDP2's: whole (collective over its mesh)
            value = value.full_tensor()
        if isinstance(value, torch.Tensor):
            data = value.detach().cpu().contiguous()
            hashed.update(f"{data.dtype}{tuple(data.shape)}".encode())
            hashed.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(value, dict):
            for key in sorted(value, key=str):
                hashed.update(repr(key).encode())
                add(value[key])
        elif isinstance(value, (list, tuple)):
            for item in value:
                add(item)
        else:
            hashed.update(repr(value).encode())

    hook = {k: v for k, v in strategy.hook_extra().items() if ".error_dict." not in k}
    add({"model": strategy.module.state_dict(), "optimizer": whole, "hook": hook})
    return hashed.hexdigest()


def say(line: str) -> None:
    """Print ``line`` in one write, so that the lines of several ranks never run together."""
    sys.stdout.write(f"[world rank {MPI.COMM_WORLD.Get_rank()}] {line}\n")
    sys.stdout.flush()


def patch(kill_ranks: List[int], kill_step: int, during: str, in_recovery: List[int],
          in_rebuild: List[int]) -> None:
    """Kill ``kill_ranks`` in their step ``kill_step + 1`` (``during`` is ``"step"``, or
    ``"copies"`` with their copies of step ``kill_step`` held back), at their commit of that step
    with those copies held back (``"commit"``) or in the validation after step ``kill_step``
    (``"validation"``), ``in_recovery`` after the survivors' first shrink and
    ``in_rebuild`` when they start rebuilding their groups; report commits and restores."""
    killed_here = MPI.COMM_WORLD.Get_rank() in kill_ranks
    held_back = during in ("copies", "commit") and killed_here
    keep, send = PartnerCopies.keep, point_to_point.send
    withheld: List[torch.Tensor] = []
    if during == "copies":
        during = "step"
    step, commit, build = loop.Run.train_step, recovery.Rollback.commit, loop.Run._build
    restore, validate = recovery.Rollback.restore, loop.Run._validate
    shrink = fault_tolerance.shrink
    recovered, started, builds = [], [], []

    def shrinking(comm):
        shrunk = shrink(comm)
        if MPI.COMM_WORLD.Get_rank() in in_recovery:
            say(f"killing in the recovery at {time.time():.6f}")
            os.kill(os.getpid(), signal.SIGKILL)
        return shrunk

    def building(run, world):
        if builds and MPI.COMM_WORLD.Get_rank() in in_rebuild:
            say(f"killing in the rebuild at {time.time():.6f}")
            os.kill(os.getpid(), signal.SIGKILL)
        builds.append(world)
        return build(run, world)

    def holding_back(copies, number, payload):
        if number != kill_step:   # those of kill_step never leave: the kill comes first
            keep(copies, number, payload)
        elif during == "commit":   # their size leaves, their bytes do not
            withheld.append(payload)
            keep(copies, number, payload)

    def sending(tensor, *args, **kwargs):
        return Work() if any(tensor is t for t in withheld) else send(tensor, *args, **kwargs)

    def kill_at(run, number: int, now: str) -> None:
        if (number, now) == (kill_step, during) and MPI.COMM_WORLD.Get_rank() in kill_ranks:
            if not held_back and run._rollback is not None:   # its copies arrive first
                run._rollback.settle()
            say(f"killing at {time.time():.6f}")
            os.kill(os.getpid(), signal.SIGKILL)

    def validating(run):
        kill_at(run, run.history.step, "validation")
        return validate(run)

    def stepping(run, number):
        kill_at(run, number, "step")
        loss = step(run, number)
        if not started:
            say(f"first step at {time.time():.6f}")
            started.append(number)
        if recovered:
            say(f"first step after recovery at {time.time():.6f}")
            recovered.clear()
        return loss

    def committing(rollback, number, strategy):
        if during == "commit" and number == kill_step + 1 and killed_here:
            time.sleep(3)   # meanwhile the other ranks go on to their commits
            kill_at(None, kill_step, "commit")
        commit(rollback, number, strategy)
        say(f"kept {number}")
        say(f"committed {number} {digest(strategy)}")
        if error_sum(strategy) is not None:
            say(f"committed errors {number} {error_sum(strategy)!r}")

    def restoring(rollback, number, strategy):
        restore(rollback, number, strategy)
        say(f"restored {number} {digest(strategy)}")
        if error_sum(strategy) is not None:
            say(f"restored errors {number} {error_sum(strategy)!r}")
        recovered.append(number)

    loop.Run.train_step, loop.Run._validate, loop.Run._build = stepping, validating, building
    recovery.Rollback.commit, recovery.Rollback.restore = committing, restoring
    fault_tolerance.shrink = shrinking
    if held_back:
        PartnerCopies.keep, point_to_point.send = holding_back, sending


def ranks(listed: str) -> List[int]:
    return [int(rank) for rank in listed.split(",") if rank]


if __name__ == "__main__":
    first, _, later = sys.argv[1].partition(">")
    rebuild = later.startswith(">")
    at, _, during = sys.argv[2].partition("/")
    patch(ranks(first), int(at), during or "step", [] if rebuild else ranks(later),
          ranks(later[1:]) if rebuild else [])
    sys.exit(main(["train", *sys.argv[3:]]))
