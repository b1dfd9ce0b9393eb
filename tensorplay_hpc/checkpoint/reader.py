"""Reading a checkpoint file: validation, checksummed tensors and attributes. Not collective:
each rank opens the file read-only and reads only what it needs."""
from __future__ import annotations

import os
from typing import Any, Dict, List

import h5py
import torch

from . import format as fmt
from . import values


class Reader:
    """An open checkpoint. Raises :class:`~.format.CheckpointError` for a missing, unreadable
    (truncated, corrupted) or foreign file, and for a dataset whose checksum does not match."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
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
        version = int(self.file.attrs.get("format_version", -1))
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

    def tensor(self, name: str) -> torch.Tensor:
        """Read dataset ``name`` as a tensor, verifying its checksum."""
        try:
            dataset = self.file[name]
            array = dataset[()]
        except (OSError, KeyError) as error:
            raise fmt.CheckpointError(f"{self.path}: cannot read dataset {name!r} (truncated "
                                      f"file?): {error}") from None
        expected = int(dataset.attrs["crc32"])
        if fmt.checksum(array) != expected:
            raise fmt.CheckpointError(f"{self.path}: checksum mismatch in dataset {name!r}: the "
                                      "file is corrupted")
        return fmt.from_numpy(array, fmt.torch_dtype(dataset.attrs["torch_dtype"]))
