"""Checking that every rank of a group agrees before it starts collectives that would hang or
corrupt data if the ranks disagreed (different models, optimizers or message sizes)."""
from __future__ import annotations

import hashlib
import os
from typing import Any, Iterable, List, Sequence, Tuple

import numpy as np
import torch

from .environment import read_once
from .mpi import MPI
from .small_collectives import all_gather_array, all_gather_object

__all__ = ["DEBUG_ENV", "Item", "check_collective", "check_consistent", "debug_enabled",
           "gather_digests", "tensor_signature"]

DEBUG_ENV = "TENSORPLAY_HPC_DEBUG"

Item = Tuple[str, Any]
_DIGEST_BYTES = hashlib.sha1().digest_size


@read_once
def debug_enabled() -> bool:
    """Whether every collective checks its arguments across ranks first (slow; for debugging;
    read on first use, see :mod:`.environment`)."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def tensor_signature(names: Iterable[str], tensors: Iterable[torch.Tensor]) -> List[Item]:
    """``(name, (shape, dtype, device type))`` for each tensor: what must match across ranks."""
    return [(name, (tuple(t.shape), str(t.dtype).replace("torch.", ""), t.device.type))
            for name, t in zip(names, tensors)]


def _digest(items: Sequence[Item]) -> bytes:
    return hashlib.sha1(repr(list(items)).encode()).digest()


def gather_digests(comm: MPI.Intracomm, digest: bytes) -> List[bytes]:
    """Every rank's 20-byte ``digest``, in rank order. Collective: one allgather of a flat
    buffer."""
    mine = np.frombuffer(digest, dtype=np.uint8)
    if mine.size != _DIGEST_BYTES:
        raise ValueError(f"a digest has {_DIGEST_BYTES} bytes, got {mine.size} "
                         f"(rank {comm.Get_rank()})")
    return [row.tobytes() for row in all_gather_array(mine, comm)]


def check_consistent(comm: MPI.Intracomm, what: str, items: Sequence[Item]) -> None:
    """Raise ``ValueError`` on every rank unless all ranks pass equal ``items``. Collective.

    One allgather of a 20-byte digest when the ranks agree; on a mismatch the items
    themselves are gathered so that the message names the ranks and the first item that
    differs.
    """
    digests = gather_digests(comm, _digest(items))
    if len(set(digests)) == 1:
        return
    everyone = all_gather_object(list(items), comm)
    reference = everyone[0]
    differing = [r for r, d in enumerate(digests) if d != digests[0]]
    rank = differing[0]
    theirs = everyone[rank]
    index = next(i for i in range(max(len(reference), len(theirs)) + 1)
                 if i >= min(len(reference), len(theirs)) or reference[i] != theirs[i])
    def entry(found: List[Item]) -> str:
        return repr(found[index]) if index < len(found) else "nothing"
    raise ValueError(
        f"{what}: ranks {differing} differ from rank 0 ({len(differing)} of {comm.Get_size()} "
        f"ranks disagree); rank {rank} has {len(theirs)} entries against rank 0's "
        f"{len(reference)}, the first difference is at position {index}: rank 0 has "
        f"{entry(reference)}, rank {rank} has {entry(theirs)}")


def check_collective(comm: MPI.Intracomm, collective: str, **arguments: Any) -> None:
    """Check that every rank enters the same collective with the same arguments (sizes, dtype,
    root...); called in debug mode (:func:`debug_enabled`) only."""
    check_consistent(comm, f"collective {collective}",
                     sorted((key, str(value)) for key, value in arguments.items()))
