"""Checking, before any rank writes or reads, that every rank is in the same checkpoint call, on
the same file, and (for a save without replica groups) holds the same replicated state.

``save`` and ``load`` are collective. Without these checks, a rank that names another file makes
a save write rank 0's name only (and return, on that rank, a path that does not exist) and a
load mix two checkpoints' shards; ranks whose replicated state differs (post-local SGD replicas
between averagings, saved without ``replica_group``) get a file that matches none of them; and
a call made on some ranks only (PyTorch's ``if rank == 0: torch.save(...)``) has its collectives
matched with whatever checkpoint call the other ranks make next, which then fails for a reason
that is not the real one.
"""
from __future__ import annotations

import hashlib
import os
from typing import Any, List, Optional, Sequence, Tuple

import torch

from tensorplay_hpc.comm.agreement import agree
from tensorplay_hpc.comm.consistency import gather_digests
from tensorplay_hpc.comm.mpi import MPI
from tensorplay_hpc.comm.small_collectives import all_gather_object

from . import format as fmt
from .optimizers import Checkpointable, adapter_for
from .sharded_tensors import is_sharded

__all__ = ["Entry", "LOAD", "SAVE", "check_call", "check_replicated", "check_save"]

SAVE, LOAD = "checkpoint.save", "checkpoint.load"

Entry = Tuple[str, Any]


def _digest(value: Any) -> bytes:
    return hashlib.sha1(repr(value).encode()).digest()


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {list(ranks)}"


def check_call(comm: MPI.Intracomm, call: str, path: Optional[str]) -> None:
    """Raise :class:`~.format.CheckpointError` on every rank of ``comm`` unless every rank is in
    ``call`` (:data:`SAVE` or :data:`LOAD`) on the same file (the same absolute path; a path
    that is not one, such as ``None``, is left for the call itself to refuse). Collective: one
    allgather of a 20-byte digest (and, after a mismatch, of every rank's call)."""
    mine = (call, os.path.abspath(path) if isinstance(path, (str, os.PathLike)) else path)
    digests = gather_digests(comm, _digest(mine))
    if len(set(digests)) == 1:
        return
    every = all_gather_object(mine, comm)
    elsewhere = [r for r, (c, _) in enumerate(every) if c != call]
    problems = []
    if elsewhere:
        calls = "; ".join(f"rank {r} in {every[r][0]}({every[r][1]!r})" for r in elsewhere)
        verb = "is" if len(elsewhere) == 1 else "are"
        problems.append(f"{_ranks(elsewhere)} of {comm.Get_size()} {verb} not in {call} but in "
                        f"another call ({calls}): it is collective, so every rank of the "
                        f"process group must call it (not only rank 0, as with torch.save)")
    in_call = [r for r, (c, _) in enumerate(every) if c == call]
    paths = list(dict.fromkeys(every[r][1] for r in in_call))     # in the order of their ranks
    if len(paths) > 1:
        named = "; ".join(f"{_ranks([r for r in in_call if every[r][1] == p])}: {p!r}"
                          for p in paths)
        problems.append(f"the ranks name different files ({named}): every rank must pass the "
                        "same path")
    outcome = "Nothing was written" if call == SAVE else "Nothing was loaded"
    raise fmt.CheckpointError(f"{call}({mine[1]!r}) on rank {comm.Get_rank()}: "
                              f"{'; '.join(problems)}. {outcome}.")


def _fingerprint(model: Optional[torch.nn.Module], optimizer: Optional[Checkpointable],
                 rank: int) -> List[Entry]:
    """``(entry, CRC-32 of its bytes)`` for every entry of the replicated state this rank
    holds: the model's and a replicated optimizer's state (each a whole copy). Local."""
    entries: List[Entry] = []
    model = fmt.unwrap_model(model)
    if model is not None:
        entries += [(f"model entry {key!r}", tensor)
                    for key, tensor in model.state_dict().items() if not is_sharded(tensor)]
    if optimizer is not None:
        adapter = adapter_for(optimizer)
        if adapter.replicated:
            for index, state in sorted(adapter.state_to_write(rank, (rank,)).items()):
                entries += [(f"optimizer state {index} {key!r}", value)
                            for key, value in state.items()]
    return [(name, fmt.checksum(fmt.to_numpy(value)) if isinstance(value, torch.Tensor)
             else repr(value)) for name, value in entries]


def check_replicated(comm: MPI.Intracomm, model: Optional[torch.nn.Module],
                     optimizer: Optional[Checkpointable], path: str) -> None:
    """Raise :class:`~.format.CheckpointError` on every rank of ``comm`` unless every rank holds
    the same replicated state (the model, a replicated optimizer's state), bit for bit: what a
    save without ``replica_group`` writes one copy of. Collective: each rank takes the CRC-32
    of its whole copy, then one allgather of a 20-byte digest (and, after a mismatch, of every
    rank's checksums)."""
    error, mine = None, []
    try:
        mine = _fingerprint(model, optimizer, comm.Get_rank())
    except Exception as failure:
        error = failure
    agree(comm, error, f"{SAVE}({os.path.abspath(path)!r})", fmt.CheckpointError)
    digests = gather_digests(comm, _digest(mine))
    if len(set(digests)) == 1:
        return
    every = all_gather_object(mine, comm)
    differing = [r for r, d in enumerate(digests) if d != digests[0]]
    first = every[differing[0]]
    entry = next((a[0] for a, b in zip(every[0], first) if a != b),
                 "the number of entries")
    raise fmt.CheckpointError(
        f"{SAVE}({os.path.abspath(path)!r}): the replicated state differs between the ranks: "
        f"{_ranks(differing)} of {comm.Get_size()} "
        f"{'holds' if len(differing) == 1 else 'hold'} another copy than rank 0 (first "
        f"difference: {entry}), and a save without replica_group writes one copy for all. Pass "
        "replica_group (the ranks holding each copy, such as post-local SGD's subgroup) to save "
        "every copy, or average the replicas first. Nothing was written.")


def check_save(comm: MPI.Intracomm, path: str, model: Optional[torch.nn.Module],
               optimizer: Optional[Checkpointable],
               replica_group: Optional[MPI.Intracomm]) -> None:
    """:func:`check_call` for a save of ``path``, then, without ``replica_group``,
    :func:`check_replicated`. Collective."""
    check_call(comm, SAVE, path)
    if replica_group is None:
        check_replicated(comm, model, optimizer, path)
