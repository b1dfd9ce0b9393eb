"""Reading a checkpoint file: validation, checksummed tensors and attributes. Not collective:
each rank opens the file read-only and reads only what it needs; :attr:`Reader.bytes_read`
counts the dataset bytes it read."""
from __future__ import annotations

import os
from typing import Any, Dict, List, Tuple

import h5py
import numpy as np
import torch

from . import format as fmt
from . import values


class Reader:
    """An open checkpoint. Raises :class:`~.format.CheckpointError` for a missing, unreadable
    (truncated, corrupted) or foreign file, and for a dataset whose checksum does not match.

    Attributes:
        bytes_read: the bytes of dataset values read so far.
        version: the file's format version.
    """

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        self.bytes_read = 0
        if not os.path.exists(self.path):
            raise fmt.CheckpointError(f"{self.path}: no such checkpoint file")
        try:
            self.file = h5py.File(self.path, "r")
        except OSError as error:
            raise fmt.CheckpointError(f"{self.path}: not a readable HDF5 file (truncated or "
                                      f"corrupted?): {error}") from None
        found = self.file.attrs.get("format")
        if found != fmt.FORMAT:
            self.close()
            raise fmt.CheckpointError(f"{self.path}: not a tensorplay_hpc checkpoint "
                                      f"(format attribute is {found!r})")
        version = self.version = int(self.file.attrs.get("format_version", -1))
        if version > fmt.FORMAT_VERSION:
            self.close()
            raise fmt.CheckpointError(f"{self.path}: format version {version} is newer than this "
                                      f"package reads ({fmt.FORMAT_VERSION})")

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def metadata(self) -> Dict[str, Any]:
        return {k: (v.item() if hasattr(v, "item") else v) for k, v in self.file.attrs.items()}

    def has(self, name: str) -> bool:
        return name in self.file

    def names(self, group: str) -> List[str]:
        """The members of ``group`` (empty if it does not exist)."""
        node = self.file.get(group)
        return list(node.keys()) if isinstance(node, h5py.Group) else []

    def attribute(self, node: str, key: str, default: Any = None) -> Any:
        obj = self.file.get(node) if node else self.file
        if obj is None or key not in obj.attrs:
            return default
        return obj.attrs[key]

    def decoded(self, node: str, key: str = "values", default: Any = None) -> Any:
        """An attribute holding JSON values (see :mod:`.values`)."""
        text = self.attribute(node, key)
        return default if text is None else values.loads(text)

    def shape(self, name: str) -> tuple:
        return self.file[name].shape

    def verify(self) -> int:
        """Read every dataset and check its checksum; return how many there are."""
        names: List[str] = []
        self.file.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
        for name in names:
            self.tensor(name)
        return len(names)

    def describe(self, name: str) -> Tuple[Tuple[int, ...], torch.dtype]:
        """The shape and dtype of dataset ``name`` (metadata only, no values read)."""
        try:
            dataset = self.file[name]
        except KeyError:
            raise fmt.CheckpointError(f"{self.path}: the checkpoint lacks dataset {name!r}") from None
        return tuple(dataset.shape), fmt.torch_dtype(dataset.attrs["torch_dtype"])

    def read_into(self, name: str, out: np.ndarray) -> None:
        """Read dataset ``name`` into ``out`` (its shape and stored dtype), verifying its
        checksum."""
        try:
            dataset = self.file[name]
            if out.size:
                dataset.read_direct(out)
        except (OSError, KeyError) as error:
            raise fmt.CheckpointError(f"{self.path}: cannot read dataset {name!r} (truncated "
                                      f"file?): {error}") from None
        self.bytes_read += out.nbytes
        if fmt.checksum(out) != int(dataset.attrs["crc32"]):
            raise fmt.CheckpointError(f"{self.path}: checksum mismatch in dataset {name!r}: the "
                                      "file is corrupted")

    def tensor(self, name: str) -> torch.Tensor:
        """Read dataset ``name`` as a tensor, verifying its checksum."""
        shape, dtype = self.describe(name)
        out = np.empty(shape, dtype=fmt.numpy_dtype(dtype))
        self.read_into(name, out)
        return fmt.from_numpy(out, dtype)
