"""How a checkpoint file meets a parallel file system: the boundary its large datasets start on,
the stripes of a new file, and the MPI-IO hints that carry both. Local everywhere.

The boundary is :data:`ALIGN_ENV` when set, else the stripe size asked for, else the stripe size
of the folder's file system where it can be read (Lustre through ``lfs getstripe``, GPFS's block
size through ``statvfs``, BeeGFS's chunk size through ``beegfs-ctl``), else
:data:`DEFAULT_BOUNDARY`. Only datasets of at least one boundary are aligned (HDF5's
``H5Pset_alignment`` with that threshold), so a file grows by less than its large datasets'
bytes and a checkpoint of small tensors keeps its size.

Stripes are left to the file system unless :data:`STRIPE_COUNT_ENV` or :data:`STRIPE_SIZE_ENV`
is set; then the temporary file is created by ``lfs setstripe`` where ``lfs`` exists, and every
MPI-IO open of it carries ROMIO's ``striping_factor`` and ``striping_unit`` hints (ROMIO applies
them on file systems that take them when it creates a file).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import Dict, Optional

from . import files

__all__ = ["ALIGN_ENV", "DEFAULT_BOUNDARY", "STRIPE_COUNT_ENV", "STRIPE_SIZE_ENV", "boundary",
           "create", "file_system", "hints", "stripe_size"]

ALIGN_ENV = "TENSORPLAY_HPC_CHECKPOINT_ALIGN"
STRIPE_COUNT_ENV = "TENSORPLAY_HPC_CHECKPOINT_STRIPE_COUNT"
STRIPE_SIZE_ENV = "TENSORPLAY_HPC_CHECKPOINT_STRIPE_SIZE"
DEFAULT_BOUNDARY = 4 << 20

_TOOL_SECONDS = 10
_SIZE = re.compile(r"(\d+)\s*([KMG]?)", re.IGNORECASE)


def _setting(name: str) -> Optional[int]:
    """The positive whole number in variable ``name``; ``None`` when it is unset or empty."""
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name}={text!r}: expected a positive whole number of "
                         f"{'stripes' if name == STRIPE_COUNT_ENV else 'bytes'}")
    return value


def file_system(folder: str) -> str:
    """The type of the file system holding ``folder`` (``lustre``, ``gpfs``, ``ext4``...), as
    the system's mount table names it; ``""`` when it cannot be told."""
    folder = os.path.realpath(folder)
    found, longest = "", -1
    try:
        with open("/proc/self/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                inside = folder == point or folder.startswith(point.rstrip("/") + "/")
                if inside and len(point) > longest:
                    found, longest = fields[2], len(point)
    except OSError:
        return ""
    return found


def _tool(command: list) -> str:
    """What ``command`` prints, ``""`` when it is missing or fails."""
    if shutil.which(command[0]) is None:
        return ""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=_TOOL_SECONDS)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout if done.returncode == 0 else ""


def _bytes(text: str) -> Optional[int]:
    """The first size in ``text`` (``1048576``, ``512K``, ``4M``) in bytes."""
    match = _SIZE.search(text)
    if match is None:
        return None
    return int(match.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[match.group(2).upper()]


def stripe_size(folder: str) -> Optional[int]:
    """The stripe (or block) size that new files in ``folder`` get, where the file system says:
    Lustre's default layout of the folder, GPFS's block size, BeeGFS's chunk size; else
    ``None``."""
    kind = file_system(folder)
    if kind == "lustre":
        return _bytes(_tool(["lfs", "getstripe", "-d", "-S", folder]))
    if kind == "gpfs":
        return os.statvfs(folder).f_bsize
    if kind.startswith("beegfs"):
        text = _tool(["beegfs-ctl", "--getentryinfo", "--nomappings", folder])
        chunk = re.search(r"chunksize:\s*(\S+)", text, re.IGNORECASE)
        return _bytes(chunk.group(1)) if chunk else None
    return None


def boundary(folder: str) -> int:
    """The byte boundary a new checkpoint's large datasets start on, in ``folder`` (see the
    module's description)."""
    for chosen in (_setting(ALIGN_ENV), _setting(STRIPE_SIZE_ENV), stripe_size(folder)):
        if chosen:
            return chosen
    return DEFAULT_BOUNDARY


def create(path: str) -> None:
    """Create the empty file ``path``, failing if it exists: with the stripes asked for
    (``lfs setstripe``) when some are and ``lfs`` exists, else as the folder's default."""
    count, size = _setting(STRIPE_COUNT_ENV), _setting(STRIPE_SIZE_ENV)
    if (count or size) and shutil.which("lfs") is not None:
        command = ["lfs", "setstripe"]
        command += ["-c", str(count)] if count else []
        command += ["-S", str(size)] if size else []
        done = subprocess.run(command + [path], capture_output=True, text=True,
                              timeout=_TOOL_SECONDS)
        if done.returncode == 0:
            return
        raise OSError(f"lfs setstripe could not create {path}: {done.stderr.strip()}")
    files.create_empty(path)


def hints(collective: bool) -> Dict[str, str]:
    """The MPI-IO hints of an open for writing a checkpoint: the stripes asked for and, for the
    collective path, ROMIO's collective buffering (with one aggregator per stripe and a buffer
    of one stripe when stripes are asked for)."""
    count, size = _setting(STRIPE_COUNT_ENV), _setting(STRIPE_SIZE_ENV)
    found: Dict[str, str] = {}
    if count:
        found["striping_factor"] = str(count)
    if size:
        found["striping_unit"] = str(size)
    if collective:
        found["romio_cb_write"] = "enable"
        if count:
            found["cb_nodes"] = str(count)
        if size:
            found["cb_buffer_size"] = str(size)
    return found

