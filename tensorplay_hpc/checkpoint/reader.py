"""Reading a checkpoint file: validation, checksummed tensors and attributes. Not collective:
each rank opens the file read-only and reads only what it needs; :attr:`Reader.bytes_read`
counts the bytes of tensor values it read. HDF5 locks the file only where the file system
takes locks (see :mod:`.locking`). Small tensors read together are read from their
packed dataset in a few long stretches, however many there are."""
from __future__ import annotations

import functools
import os
from typing import Any, Dict, Iterator, List, Sequence, Tuple

import h5py
import numpy as np
import torch

from . import format as fmt
from . import locking, metadata_checksums, values
from .catalog import CRC, DTYPE, NUMEL, OFFSET, Catalog, packed_dataset, stored_dtype

__all__ = ["Reader"]

_MIN_GAP = 1 << 12
_SPAN_ELEMENTS = 1 << 22
_VERIFY_BATCH = 1 << 14


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
            self.file = h5py.File(self.path, "r", locking=locking.file_locking(self.path))
        except OSError as error:
            raise fmt.CheckpointError(f"{self.path}: not a readable HDF5 file (truncated or "
                                      f"corrupted?): {error}") from None
        try:
            self.version = self._format_version()
            expected = None
            if self.version >= metadata_checksums.FIRST_VERSION:
                expected = metadata_checksums.check_root(self.path, self.file.attrs)
            self.catalog = Catalog.read(self.file, self.path, self.version, functools.partial(
                metadata_checksums.check_catalog, self.path, expected))
        except fmt.CheckpointError:
            self.close()
            raise

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

    def _row(self, name: str) -> int:
        row = self.catalog.index.get(name)
        if row is None:
            raise fmt.CheckpointError(f"{self.path}: the checkpoint lacks dataset {name!r}")
        return row

    def describe(self, name: str) -> Tuple[Tuple[int, ...], torch.dtype]:
        """The shape and dtype of tensor ``name`` (from the catalog, no values read)."""
        row = self._row(name)
        return self.catalog.shape(row), fmt.torch_dtype(self.catalog.dtypes[
            self.catalog.columns[row, DTYPE]])

    def shapes(self, names: Sequence[str]) -> List[Tuple[int, ...]]:
        """The shapes of the tensors ``names`` (from the catalog, no values read)."""
        return [self.catalog.shape(self._row(name)) for name in names]

    def _values(self, names: Sequence[str]) -> Iterator[Tuple[int, int, np.ndarray]]:
        """``(position in names, row, flat stored values)`` of every tensor of ``names``, checksums
        verified. Tensors of their own dataset are read one by one; packed ones in file order,
        neighbours together in spans (see :func:`_spans`), each value a view of its span."""
        rows = [self._row(name) for name in names]
        columns = self.catalog.columns[rows]
        offsets, numels, codes, crcs = (columns[:, c] for c in (OFFSET, NUMEL, DTYPE, CRC))
        stored = [stored_dtype(name) for name in self.catalog.dtypes]
        for position in np.flatnonzero(offsets < 0).tolist():
            row = rows[position]
            values = np.empty(self.catalog.shape(row), dtype=stored[codes[position]])
            self._read(names[position], values)
            yield position, row, self._checked(names[position], values.reshape(-1),
                                               crcs[position])
        packed = np.flatnonzero(offsets >= 0)
        kinds = [s.name for s in stored]
        for kind in sorted({kinds[code] for code in np.unique(codes[packed]).tolist()}):
            same = [code for code, name in enumerate(kinds) if name == kind]
            chosen = packed[np.isin(codes[packed], same)]
            chosen = chosen[np.argsort(offsets[chosen], kind="stable")]
            dataset = packed_dataset(stored[same[0]])
            starts, ends = offsets[chosen].tolist(), (offsets[chosen] + numels[chosen]).tolist()
            for first, last in _spans(starts, ends):
                low, high = starts[first], max(ends[first:last])
                span = np.empty(high - low, dtype=stored[same[0]])
                self._read(dataset, span, np.s_[low:high])
                for i in range(first, last):
                    position = int(chosen[i])
                    values = span[starts[i] - low:ends[i] - low]
                    yield position, rows[position], self._checked(names[position], values,
                                                                  crcs[position])

    def _read(self, dataset: str, out: np.ndarray, selection: Any = None) -> None:
        try:
            if out.size:
                self.file[dataset].read_direct(out, source_sel=selection)
        except (OSError, KeyError, ValueError, TypeError) as error:
            raise fmt.CheckpointError(f"{self.path}: cannot read dataset {dataset!r} (truncated "
                                      f"file?): {error}") from None

    def _checked(self, name: str, values: np.ndarray, crc32: int) -> np.ndarray:
        self.bytes_read += values.nbytes
        if fmt.crc32(values) != crc32:
            raise fmt.CheckpointError(f"{self.path}: checksum mismatch in dataset {name!r}: the "
                                      "file is corrupted")
        return values

    def read_all_into(self, names: Sequence[str], outs: Sequence[np.ndarray]) -> None:
        """Read each tensor of ``names`` into the array of ``outs`` at the same position (its
        shape and stored dtype), verifying checksums."""
        for position, _, values in self._values(names):
            outs[position].reshape(-1)[...] = values

    def tensors(self, names: Sequence[str]) -> Dict[str, torch.Tensor]:
        """Read the tensors ``names``, verifying checksums. Small tensors read together share
        the memory of the stretch of the file they came from."""
        dtypes = [fmt.torch_dtype(name) for name in self.catalog.dtypes]
        codes = self.catalog.columns[:, DTYPE]
        found: Dict[str, torch.Tensor] = {}
        for position, row, values in self._values(names):
            found[names[position]] = fmt.from_numpy(values.reshape(self.catalog.shape(row)),
                                                    dtypes[codes[row]])
        return found

    def tensor(self, name: str) -> torch.Tensor:
        """Read tensor ``name``, verifying its checksum."""
        return self.tensors([name])[name]

    def verify(self) -> int:
        """Read every tensor and check its checksum; return how many there are."""
        names = self.catalog.names
        for start in range(0, len(names), _VERIFY_BATCH):
            for _ in self._values(names[start:start + _VERIFY_BATCH]):
                pass
        return len(names)


def _spans(starts: List[int], ends: List[int]) -> Iterator[Tuple[int, int]]:
    """Runs ``[first, last)`` of the (sorted) stretches ``starts``/``ends`` to read at once: a
    run grows over a gap no longer than what it already holds (or :data:`_MIN_GAP`), so at most
    about twice the wanted elements are read, and up to :data:`_SPAN_ELEMENTS` elements."""
    first, low, end, wanted = 0, 0, 0, 0
    for i, (start, stop) in enumerate(zip(starts, ends)):
        if i > first and (start - end > max(_MIN_GAP, wanted) or stop - low > _SPAN_ELEMENTS):
            yield first, i
            first = i
        if i == first:
            low, end, wanted = start, stop, 0
        end = max(end, stop)
        wanted += stop - start
    if starts:
        yield first, len(starts)
