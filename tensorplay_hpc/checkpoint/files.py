"""Checkpoint files on disk: temporary names, the atomic rename, their order, pruning and
finding the newest.

Checkpoints are ordered by the creation time recorded inside them (the ``created`` attribute),
then by the recorded ``step``, then by modification time and name; never by name alone. A run's
checkpoints are those in the same folder whose names differ only in their last number (see
:func:`run_of`).
"""
from __future__ import annotations

import ctypes
import datetime
import errno
import functools
import os
import re
import shutil
import socket
import uuid
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import format as fmt
from .reader import Reader

__all__ = ["Order", "TEMP_MARK", "check_space", "check_visible", "checkpoints", "commit",
           "create_empty", "discard", "latest", "order", "prune", "remove_dead_temporaries",
           "run_of", "start_writeback", "temporary_name"]

TEMP_MARK = ".tmp-"

Order = Tuple[float, int, int, str]

# Files this process committed or verified, with their (inode, size, mtime) then: while
# unchanged they are not read again.
_good: Dict[str, Tuple[int, int, int]] = {}


_TEMPORARY = re.compile(r"\.tmp-(?P<host>[^/]+)\.(?P<pids>\d+)\.(?P<pid>\d+)\.[0-9a-f]{8}"
                        r"(\.space)?$")
"""A temporary of :func:`temporary_name` (or its space probe): who made it."""


@functools.lru_cache(maxsize=None)
def _pid_namespace() -> int:
    """The inode of this process's pid namespace (``0`` where ``/proc`` does not say): two
    processes of one host name see each other's pids only within one such namespace."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def temporary_name(path: str) -> str:
    """A fresh name in the same folder (so the final rename stays on one file system) that
    names the process writing it: ``<path>.tmp-<host>.<pid namespace>.<pid>.<random>``."""
    return (f"{path}{TEMP_MARK}{socket.gethostname()}.{_pid_namespace()}.{os.getpid()}."
            f"{uuid.uuid4().hex[:8]}")


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this pid namespace runs (an ended one not yet reaped by its
    parent, a zombie, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:       # another user's process
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def remove_dead_temporaries(path: str) -> List[str]:
    """Delete the temporary files in ``path``'s folder left by saves that are certainly dead;
    return those deleted. Local: the first rank of a save calls it.

    A temporary is certainly dead when its name (see :func:`temporary_name`) says it was made
    on this host, in this pid namespace, by a process that no longer runs (gone, or a zombie).
    A save's first rank makes, renames or deletes its temporary, so a save whose first rank is
    gone can never finish (its other ranks fail with it, or the job ends). Anything else is left alone: temporaries made on other hosts
    (their pids cannot be checked from here; a save whose first rank runs there removes them),
    in another pid namespace, by a process still alive (or a new one with the same pid), and
    temporaries named otherwise (of older versions).
    """
    directory = os.path.dirname(os.path.abspath(path))
    host, namespace = socket.gethostname(), _pid_namespace()
    removed = []
    for name in sorted(os.listdir(directory)):
        found = _TEMPORARY.search(name)
        if (found is None or found["host"] != host or int(found["pids"]) != namespace
                or namespace == 0 or _alive(int(found["pid"]))):
            continue
        try:
            os.remove(os.path.join(directory, name))
        except OSError:      # removed by another save meanwhile, or not ours to remove
            continue
        removed.append(os.path.join(directory, name))
    return removed


def create_empty(path: str) -> None:
    """Create ``path``, empty, failing if it exists."""
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))


def check_visible(temporary: str) -> None:
    """Raise ``OSError`` unless this rank sees ``temporary``, which the first rank has just
    created. On a folder that is not one file system for every rank (a node-local ``/tmp``),
    the save then fails on every rank, naming those ranks, before anything is written."""
    if not os.path.exists(temporary):
        raise OSError(errno.ENOENT, f"this rank does not see {temporary}, which rank 0 has just "
                                    "created: the folder is not on a file system that every "
                                    "rank shares (a node-local path such as /tmp?)")


def check_space(temporary: str, nbytes: int) -> None:
    """Fail now, with the system's error, if a file of ``nbytes`` cannot be written next to
    ``temporary`` (full disk, quota, file-size limit): the space is reserved in a probe file of
    this save's own (``<temporary>.space``), then given back.

    A save checks before it writes, so that a full disk fails it before any rank has written.
    """
    probe = f"{temporary}.space"
    fd = os.open(probe, os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, max(nbytes, 1))
        except OSError as error:
            if error.errno in (errno.EOPNOTSUPP, errno.EINVAL):   # no fallocate: compare free space
                free = shutil.disk_usage(os.path.dirname(temporary) or ".").free
                if free < nbytes:
                    raise OSError(errno.ENOSPC, f"{nbytes} bytes needed, {free} free") from None
            else:
                raise OSError(error.errno, f"cannot reserve {nbytes} bytes for the checkpoint: "
                                           f"{os.strerror(error.errno)}") from None
    finally:
        os.close(fd)
        os.remove(probe)


_SYNC_FILE_RANGE_WRITE = 2


@functools.lru_cache(maxsize=None)
def _sync_file_range() -> Optional[Callable[..., int]]:
    """Linux's ``sync_file_range``, or ``None`` where the C library lacks it."""
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Have the system start writing bytes ``offset`` to ``offset + nbytes`` of the open file
    ``fd`` to the disk, without waiting for them (Linux; elsewhere nothing). The ``fsync`` of
    :func:`commit` then waits for less. A hint: a failure is ignored."""
    function = _sync_file_range()
    if function is not None:
        function(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


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
    path = os.path.abspath(path)
    _fsync(os.path.dirname(path), directory=True)
    _good[path] = _signature(path)


def discard(temporary: str) -> None:
    try:
        os.remove(temporary)
    except FileNotFoundError:
        pass


def _signature(path: str) -> Tuple[int, int, int]:
    status = os.stat(path)
    return status.st_ino, status.st_size, status.st_mtime_ns


def run_of(name: str) -> str:
    """The run a checkpoint file name belongs to: the name with its last number (before the
    suffix) replaced by ``#``. ``step-0001600.h5`` and ``step-0001700.h5`` are one run,
    ``old-run-final.h5`` is a run of its own, ``a1-step5.h5`` and ``a2-step5.h5`` are two."""
    return re.sub(r"\d+(?=\D*$)", "#", name.removesuffix(fmt.SUFFIX)) + fmt.SUFFIX


def _files(directory: str) -> List[str]:
    """Every file of ``directory`` named like a finished checkpoint (no temporary files)."""
    if not os.path.isdir(directory):
        return []
    return [os.path.join(directory, name) for name in sorted(os.listdir(directory))
            if name.endswith(fmt.SUFFIX) and TEMP_MARK not in name]


def _recorded(reader: Reader, key: str, convert: Callable[[Any], Any]) -> Any:
    value = reader.attribute("", key)
    if value is None:
        raise fmt.CheckpointError(f"{reader.path}: the checkpoint lacks attribute {key!r}")
    try:
        return convert(value)
    except (TypeError, ValueError):
        raise fmt.CheckpointError(f"{reader.path}: attribute {key!r} is damaged ({value!r})") from None


def _created(value: Any) -> float:
    return datetime.datetime.fromisoformat(str(value)).timestamp()


def order(path: str) -> Order:
    """The sort key of checkpoint ``path``: its recorded creation time, its recorded step, its
    modification time, its name. Reads attributes only.

    Raises:
        CheckpointError: if ``path`` is not a readable checkpoint (truncated, foreign, garbage,
            a newer format, a missing or damaged ``created`` or ``step``).
    """
    with Reader(path) as reader:
        created = _recorded(reader, "created", _created)
        step = _recorded(reader, "step", int)
    return created, step, os.stat(path).st_mtime_ns, os.path.basename(path)


def checkpoints(directory: str) -> List[str]:
    """The readable checkpoint files in ``directory``, oldest first (see :func:`order`). Not
    collective; checksums are not checked."""
    found = []
    for path in _files(directory):
        try:
            found.append((order(path), path))
        except fmt.CheckpointError:
            continue
    return [path for _, path in sorted(found)]


def latest(directory: str, verify: bool = True) -> Optional[str]:
    """The newest good checkpoint in ``directory``, or ``None``. Not collective.

    Every checkpoint of the folder is a candidate, newest first by :func:`order`. With
    ``verify`` (the default) every checksum of a candidate is checked, so a damaged file is
    passed over for the one before it.
    """
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


def _verify(path: str) -> None:
    """Check every checksum of ``path``, unless this process wrote or verified it unchanged."""
    signature = _signature(path)
    if _good.get(path) == signature:
        return
    with Reader(path) as reader:
        reader.verify()
    _good[path] = signature


def _leave(path: str, keep: int, reason: Exception) -> None:
    text = str(reason).removeprefix(f"{path}: ")
    warnings.warn(f"keep={keep}: {path} is left alone, neither counted nor deleted: {text}",
                  RuntimeWarning, stacklevel=3)


def prune(written: str, keep: int) -> List[str]:
    """Delete the checkpoints of ``written``'s run beyond the newest ``keep`` good ones; return
    those deleted. Not collective: one process calls it, after a save.

    ``written`` is the checkpoint just saved: it is never deleted and is the first of the
    ``keep``. The others of its run (its folder's files of the same :func:`run_of`) follow
    newest first (see :func:`order`). Only a checkpoint whose checksums all verify is counted or
    deleted; any other file of the run is left alone, with a warning naming it. Files of other
    runs are not looked at.
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    written = os.path.abspath(written)
    directory = os.path.dirname(written)
    run = run_of(os.path.basename(written))
    found = []
    for path in _files(directory):
        if path != written and run_of(os.path.basename(path)) == run:
            try:
                found.append((order(path), path))
            except Exception as error:   # anything we cannot vouch for stays
                _leave(path, keep, error)
    kept, deleted = 1, []
    for _, path in sorted(found, reverse=True):
        try:
            _verify(path)
            if kept < keep:
                kept += 1
                continue
            os.remove(path)
        except Exception as error:
            _leave(path, keep, error)
            continue
        _good.pop(path, None)
        deleted.append(path)
    return deleted
