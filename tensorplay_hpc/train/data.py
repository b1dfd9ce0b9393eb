"""The corpus: the source files of Python's own standard library, as bytes.

Every Python install ships it, so training needs no download. The file list is sorted and split
by position (every tenth file is validation text), so every rank and every run sees the same
train and validation text. A batch is drawn from a generator seeded by the run's seed and the
step, so a resumed run sees the same batches as one that never stopped.
"""
from __future__ import annotations

import functools
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import List, Tuple

import torch

from .config import UsageError

__all__ = ["Batch", "Corpus", "VALIDATION_EVERY", "VOCAB_SIZE", "batch_for_rank", "check_context",
           "split_files", "stdlib_files", "validation_batches"]

VOCAB_SIZE = 256
"""Tokens are bytes: a character-level model over UTF-8 source text."""

VALIDATION_EVERY = 10
"""The file at sorted position ``i`` is validation text when ``i % VALIDATION_EVERY == 9``."""

_SKIPPED_FOLDERS = {"site-packages", "dist-packages", "test", "tests", "idle_test"}


def stdlib_files(root: Path | None = None) -> List[Path]:
    """The ``.py`` files of the standard library, sorted, without third-party packages and tests."""
    return list(_python_files(Path(root or sysconfig.get_paths()["stdlib"])))


@functools.lru_cache(maxsize=None)
def _python_files(root: Path) -> Tuple[Path, ...]:
    """The ``.py`` files under ``root`` outside :data:`_SKIPPED_FOLDERS`, sorted by their path
    from ``root``; listed once per process (the skipped folders are not walked)."""
    found = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in _SKIPPED_FOLDERS]
        found += [Path(folder, name) for name in names if name.endswith(".py")]
    if not found:
        raise FileNotFoundError(f"no Python source files under {root}")
    return tuple(sorted(found, key=lambda path: path.relative_to(root).as_posix()))


@dataclass
class Corpus:
    """Train and validation text as flat ``uint8`` tensors."""

    train: torch.Tensor
    validation: torch.Tensor
    files: int

    @classmethod
    def from_stdlib(cls, root: Path | None = None) -> "Corpus":
        """Read and split the standard library's sources (deterministic)."""
        parts = split_files(stdlib_files(root))
        train, validation = (torch.frombuffer(bytearray(b"".join(p.read_bytes() for p in part)),
                                              dtype=torch.uint8) for part in parts)
        return cls(train=train, validation=validation, files=sum(map(len, parts)))


def split_files(files: List[Path]) -> Tuple[List[Path], List[Path]]:
    """``(train, validation)``: every :data:`VALIDATION_EVERY`-th file is validation text."""
    parts: Tuple[List[Path], List[Path]] = ([], [])
    for index, path in enumerate(files):
        parts[index % VALIDATION_EVERY == VALIDATION_EVERY - 1].append(path)
    return parts


def check_context(context: int, root: Path | None = None) -> None:
    """Raise :class:`UsageError` when the train or the validation text is too short for
    :func:`batch_for_rank` to draw windows of ``context + 1`` bytes from it. Reads only the
    files' sizes. Not collective."""
    sizes = [sum(path.stat().st_size for path in part)
             for part in split_files(stdlib_files(root))]
    name, shortest = min(zip(("train", "validation"), sizes), key=lambda item: item[1])
    if context > shortest - 2:
        raise UsageError(f"--context {context} is longer than the {name} text allows: it holds "
                         f"{shortest:,} bytes of Python's standard library, so --context can be "
                         f"at most {shortest - 2:,}")


Batch = Tuple[torch.Tensor, torch.Tensor]
"""``(inputs, targets)``: token windows and the same windows shifted by one byte."""


def _windows(text: torch.Tensor, starts: torch.Tensor, context: int) -> Batch:
    index = starts.unsqueeze(1) + torch.arange(context + 1).unsqueeze(0)
    window = text[index].long()
    return window[:, :-1], window[:, 1:]


def batch_for_rank(text: torch.Tensor, *, seed: int, step: int, batch_size: int, context: int,
                   rank: int, world_size: int) -> Batch:
    """This rank's slice of the global batch of ``step``: ``(inputs, targets)`` of shape
    ``(batch_size // world_size, context)``.

    The global batch's window starts are drawn from a generator seeded by ``(seed, step)``;
    rank ``r`` takes the ``r``-th contiguous slice. Not collective.

    Raises:
        ValueError: ``batch_size`` is not a multiple of ``world_size``.
    """
    if batch_size % world_size:
        raise ValueError(f"--batch-size {batch_size} is not a multiple of the {world_size} ranks "
                         f"(rank {rank})")
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, text.numel() - context - 1, (batch_size,), generator=generator)
    share = batch_size // world_size
    return _windows(text, starts[rank * share:(rank + 1) * share], context)


def validation_batches(text: torch.Tensor, *, seed: int, batches: int, batch_size: int,
                       context: int, rank: int, world_size: int) -> List[Batch]:
    """A fixed set of validation batches, this rank's slice of each (same on every call)."""
    return [batch_for_rank(text, seed=seed + 1, step=-1 - b, batch_size=batch_size, context=context,
                           rank=rank, world_size=world_size) for b in range(batches)]
