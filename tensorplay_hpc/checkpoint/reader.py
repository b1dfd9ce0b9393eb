"""Reading a checkpoint file: validation, checksummed tensors and attributes. Not collective:
each rank opens the file read-only and reads only what it needs; :attr:`Reader.bytes_read`
counts the bytes of tensor values it read. Small tensors are read from their packed dataset a
block at a time, so reading many of them in file order costs a few reads."""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any, Dict, List, Tuple

import h5py
import numpy as np
import torch

from . import format as fmt
from . import values
from .catalog import Catalog, Entry

_BLOCK_ELEMENTS = 1 << 20
_BLOCKS_CACHED = 8


class Reader:
    """An open checkpoint. Raises :class:`~.format.CheckpointError` for a missing, unreadable
    (truncated, corrupted) or foreign file, and for a dataset whose checksum does not match.

    Attributes:
        bytes_read: the bytes of dataset values read so far.
        version: the file's format version.
    """

    def __init__(self, path: str) -> None:
        if path is None:
            raise fmt.CheckpointError("no checkpoint to read: the path is None (checkpoint."
                                      "latest(folder) gives None for a folder without a good "
                                      "checkpoint)")
        self.path = os.path.abspath(path)
        self.bytes_read = 0
        if not os.path.exists(self.path):
            raise fmt.CheckpointError(f"{self.path}: no such checkpoint file")
        try:
            self.file = h5py.File(self.path, "r")
        except OSError as error:
            raise fmt.CheckpointError(f"{self.path}: not a readable HDF5 file (truncated or "
                                      f"corrupted?): {error}") from None
        try:
            self.version = self._format_version()
            self.catalog = Catalog.read(self.file, self.path, self.version)
        except fmt.CheckpointError:
            self.close()
            raise
        self._blocks: "OrderedDict[Tuple[str, int], np.ndarray]" = OrderedDict()

    def _format_version(self) -> int:
        found = self.file.attrs.get("format")
        if found != fmt.FORMAT:
            raise fmt.CheckpointError(f"{self.path}: not a tensorplay_hpc checkpoint "
                                      f"(format attribute is {found!r})")
        try:
            version = int(self.file.attrs["format_version"])
        except (KeyError, TypeError, ValueError):
            raise fmt.CheckpointError(f"{self.path}: attribute 'format_version' is missing or "
                                      "damaged") from None
        if version > fmt.FORMAT_VERSION:
            raise fmt.CheckpointError(f"{self.path}: format version {version} is newer than this "
                                      f"package reads ({fmt.FORMAT_VERSION})")
        return version

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
        return self.catalog.has(name)

    def names(self, group: str) -> List[str]:
        """The members of ``group`` (empty if it does not exist)."""
        return self.catalog.children(group)

    def attribute(self, node: str, key: str, default: Any = None) -> Any:
        """Attribute ``key`` of ``node`` (``""``: the file's own attributes)."""
        attributes = self.file.attrs if not node else self.catalog.attributes.get(node, {})
        return attributes[key] if key in attributes else default

    def decoded(self, node: str, key: str = "values", default: Any = None) -> Any:
        """An attribute holding JSON values (see :mod:`.values`)."""
        text = self.attribute(node, key)
        if text is None:
            return default
        try:
            return values.loads(text)
        except (TypeError, ValueError) as error:
            raise fmt.CheckpointError(f"{self.path}: attribute {key!r} of {node or '/'!r} is "
                                      f"damaged ({error})") from None

    def required(self, node: str, key: str) -> Any:
        """Attribute ``key`` of ``node``, decoded from JSON; a clear error if it is missing."""
        if self.attribute(node, key) is None:
            raise fmt.CheckpointError(f"{self.path}: the checkpoint lacks attribute {key!r} of "
                                      f"{node or '/'!r}")
        return self.decoded(node, key)

    def verify(self) -> int:
        """Read every tensor and check its checksum; return how many there are."""
        for name in self.catalog.tensors:
            self.tensor(name)
        return len(self.catalog.tensors)

    def _entry(self, name: str) -> Entry:
        try:
            entry = self.catalog.entry(name)
        except (TypeError, ValueError):
            raise fmt.CheckpointError(f"{self.path}: the catalog's entry of {name!r} is "
                                      "damaged") from None
        if entry is None:
            raise fmt.CheckpointError(f"{self.path}: the checkpoint lacks dataset {name!r}")
        return entry

    def describe(self, name: str) -> Tuple[Tuple[int, ...], torch.dtype]:
        """The shape and dtype of tensor ``name`` (from the catalog, no values read)."""
        entry = self._entry(name)
        return entry.shape, fmt.torch_dtype(entry.dtype)

    def _block(self, dataset: str, index: int) -> np.ndarray:
        """Block ``index`` of a packed dataset, from the cache of the last few read."""
        key = (dataset, index)
        block = self._blocks.get(key)
        if block is None:
            block = self.file[dataset][index * _BLOCK_ELEMENTS:(index + 1) * _BLOCK_ELEMENTS]
            if len(self._blocks) >= _BLOCKS_CACHED:
                self._blocks.popitem(last=False)
            self._blocks[key] = block
        elif key != next(reversed(self._blocks)):
            self._blocks.move_to_end(key)
        return block

    def _read_packed(self, entry: Entry, out: np.ndarray) -> None:
        flat, position, end = out.reshape(-1), entry.offset, entry.offset + entry.numel
        while position < end:
            index, start = divmod(position, _BLOCK_ELEMENTS)
            block = self._block(entry.dataset, index)
            piece = block[start:start + end - position]
            if not piece.size:
                raise OSError(f"the packed dataset {entry.dataset!r} ends early")
            flat[position - entry.offset:position - entry.offset + piece.size] = piece
            position += piece.size

    def read_into(self, name: str, out: np.ndarray) -> None:
        """Read tensor ``name`` into ``out`` (its shape and stored dtype), verifying its
        checksum."""
        entry = self._entry(name)
        try:
            if entry.offset is not None:
                self._read_packed(entry, out)
            elif out.size:
                self.file[entry.dataset].read_direct(out)
        except (OSError, KeyError, ValueError) as error:
            raise fmt.CheckpointError(f"{self.path}: cannot read dataset {name!r} (truncated "
                                      f"file?): {error}") from None
        self.bytes_read += out.nbytes
        if fmt.checksum(out) != entry.crc32:
            raise fmt.CheckpointError(f"{self.path}: checksum mismatch in dataset {name!r}: the "
                                      "file is corrupted")

    def tensor(self, name: str) -> torch.Tensor:
        """Read tensor ``name``, verifying its checksum."""
        shape, dtype = self.describe(name)
        out = np.empty(shape, dtype=fmt.numpy_dtype(dtype))
        self.read_into(name, out)
        return fmt.from_numpy(out, dtype)
