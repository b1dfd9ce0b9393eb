"""Whether HDF5 locks a checkpoint file it opens. HDF5 takes a ``flock`` on every file it opens
and fails on a file system that has none (some Lustre and NFS mounts); the setting
:data:`LOCKING_ENV` says ``on``, ``off`` or ``auto`` (the default: ``HDF5_USE_FILE_LOCKING``
when it is set, else try a shared ``flock`` on the file and lock only where that works). Local.
"""
from __future__ import annotations

import errno
import fcntl
import os

__all__ = ["LOCKING_ENV", "file_locking"]

LOCKING_ENV = "TENSORPLAY_HPC_CHECKPOINT_LOCKING"

_UNSUPPORTED = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL}


def _flock_works(path: str) -> bool:
    """Whether the file system of the existing file ``path`` takes a shared ``flock``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as failure:
        return failure.errno not in _UNSUPPORTED    # held elsewhere: locks exist there
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True
    finally:
        os.close(fd)


def file_locking(path: str) -> bool:
    """Whether to open the existing file ``path`` with HDF5's file locking (h5py's
    ``locking=``), as :data:`LOCKING_ENV` says.

    Raises:
        ValueError: the setting is none of ``on``, ``off``, ``auto``.
    """
    setting = os.environ.get(LOCKING_ENV, "auto").strip().lower() or "auto"
    if setting not in ("on", "off", "auto"):
        raise ValueError(f"{LOCKING_ENV}={setting!r}: expected on, off or auto")
    if setting != "auto":
        return setting == "on"
    inherited = os.environ.get("HDF5_USE_FILE_LOCKING", "").strip().upper()
    if inherited in ("FALSE", "0"):
        return False
    if inherited in ("TRUE", "1", "BEST_EFFORT"):
        return True
    return _flock_works(path)
