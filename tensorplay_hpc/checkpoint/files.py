"""Checkpoint files on disk: temporary names, the atomic rename, pruning and finding the newest."""
from __future__ import annotations

import errno
import os
import shutil
import uuid
from typing import List, Optional

import h5py

from . import format as fmt

TEMP_MARK = ".tmp-"


def temporary_name(path: str) -> str:
    """A fresh name in the same folder, so the final rename stays on one file system."""
    return f"{path}{TEMP_MARK}{uuid.uuid4().hex[:12]}"


def check_space(path: str, nbytes: int) -> None:
    """Fail now, with the system's error, if a file of ``nbytes`` cannot be written next to
    ``path`` (full disk, quota, file-size limit): the space is reserved, then given back.

    HDF5's MPI-IO driver does not report a write that fails for lack of space reliably (it can
    spin in the collective close), so a save checks before it writes.
    """
    probe = f"{path}{TEMP_MARK}space"
    fd = os.open(probe, os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, max(nbytes, 1))
        except OSError as error:
            if error.errno in (errno.EOPNOTSUPP, errno.EINVAL):   # no fallocate: compare free space
                free = shutil.disk_usage(os.path.dirname(path) or ".").free
                if free < nbytes:
                    raise OSError(errno.ENOSPC, f"{nbytes} bytes needed, {free} free") from None
            else:
                raise OSError(error.errno, f"cannot reserve {nbytes} bytes for the checkpoint: "
                                           f"{os.strerror(error.errno)}") from None
    finally:
        os.close(fd)
        os.remove(probe)


def _fsync(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(temporary: str, path: str) -> None:
    """Make a completely written file the checkpoint at ``path``, atomically and durably."""
    _fsync(temporary)
    os.replace(temporary, path)
    _fsync(os.path.dirname(os.path.abspath(path)) or ".", directory=True)


def discard(temporary: str) -> None:
    try:
        os.remove(temporary)
    except FileNotFoundError:
        pass


def _is_checkpoint(path: str) -> bool:
    try:
        with h5py.File(path, "r") as f:
            return (f.attrs.get("format") == fmt.FORMAT
                    and int(f.attrs.get("format_version", -1)) <= fmt.FORMAT_VERSION)
    except (OSError, KeyError, ValueError):
        return False


def checkpoints(directory: str) -> List[str]:
    """The readable checkpoint files in ``directory``, oldest first (by step, then time)."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if name.endswith(fmt.SUFFIX) and TEMP_MARK not in name and _is_checkpoint(path):
            with h5py.File(path, "r") as f:
                step = int(f.attrs.get("step", -1))
            found.append((step, os.path.getmtime(path), path))
    return [path for _, _, path in sorted(found)]


def latest(directory: str, verify: bool = True) -> Optional[str]:
    """The newest good checkpoint in ``directory``, or ``None``. Not collective.

    With ``verify`` (the default) every checksum of a candidate is checked, newest first, so a
    damaged file is passed over for the one before it.
    """
    from .reader import Reader
    for path in reversed(checkpoints(directory)):
        if not verify:
            return path
        try:
            with Reader(path) as reader:
                reader.verify()
            return path
        except fmt.CheckpointError:
            continue
    return None


def prune(directory: str, keep: int) -> List[str]:
    """Delete all but the newest ``keep`` checkpoints in ``directory``; return those deleted."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    old = checkpoints(directory)[:-keep]
    for path in old:
        os.remove(path)
    return old
