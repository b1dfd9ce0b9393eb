"""The temporary file as HDF5 lays it out: a write the system refuses never reaches HDF5.

When a write fails while HDF5 flushes its metadata (a disk that fills during a save), HDF5 1.10
keeps the file open with its metadata cache half flushed, and flushes it again when the library
shuts down, at the process's exit, where it crashes (a segmentation fault after "Disable slist
on flush dest failure"). HDF5 therefore writes through a :class:`GuardedFile` (h5py's file-object
driver), which keeps the first failure to itself, answers HDF5 as if every write had succeeded,
and raises that failure once HDF5 has closed the file.
"""
from __future__ import annotations

import errno
import os
from typing import Any, Optional

__all__ = ["GuardedFile"]


class GuardedFile:
    """A file opened for reading and writing, offered to HDF5 as a Python file object. Local.

    Use as a context manager around the ``h5py.File`` made on it: leaving it closes the file
    and raises the first ``OSError`` of a write or a truncation, if any."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR)
        self.position = 0
        self.failure: Optional[OSError] = None

    def _guard(self, operation: Any, *args: Any) -> None:
        """Run ``operation(*args)`` unless a failure came before; keep its failure."""
        if self.failure is not None:
            return
        try:
            operation(*args)
        except OSError as error:
            self.failure = error

    def _write_all(self, data: memoryview, at: int) -> None:
        while data:
            written = os.pwritev(self.fd, [data], at)
            if not written:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            data, at = data[written:], at + written

    # -- what HDF5's file-object driver calls ------------------------------------------------

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_SET:
            self.position = offset
        elif whence == os.SEEK_CUR:
            self.position += offset
        else:
            self.position = os.fstat(self.fd).st_size + offset
        return self.position

    def tell(self) -> int:
        return self.position

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = os.pread(self.fd, len(view), self.position)
        view[:len(data)] = data
        self.position += len(data)
        return len(data)

    def read(self, size: int = -1) -> bytes:
        if size < 0:
            size = max(os.fstat(self.fd).st_size - self.position, 0)
        data = os.pread(self.fd, size, self.position)
        self.position += len(data)
        return data

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._guard(self._write_all, view, self.position)
        self.position += len(view)
        return len(view)

    def truncate(self, size: Optional[int] = None) -> int:
        size = self.position if size is None else size
        self._guard(os.ftruncate, self.fd, size)
        return size

    def flush(self) -> None:
        """Nothing to do: every write went straight to the system."""

    # -- the file's lifetime -----------------------------------------------------------------

    def __enter__(self) -> "GuardedFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        os.close(self.fd)
        if self.failure is not None:      # the cause of any error HDF5 raised after it
            raise OSError(self.failure.errno, f"{self.failure.strerror}: writing the layout "
                                              f"of {self.path}")
