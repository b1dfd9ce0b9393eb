"""Where each tensor of a checkpoint lies, and every attribute below the root: the file's index.

HDF5 creates datasets and attributes one at a time, a fraction of a millisecond each, so a model
of many small parameters would spend minutes on metadata. A file therefore
keeps tensors of fewer than :data:`PACK_BYTES` bytes back to back in one dataset per stored
dtype (``/packed/<dtype>``), the larger ones in their own datasets, and an index in three
datasets that cost the same to read for any number of tensors:

- ``/catalog``: a JSON document of strings only: the tensors' names, the table of their dtypes,
  and the attributes of every node but the root;
- ``/catalog_columns``: ``int64``, a row per tensor: its offset in its packed dataset (``-1``
  for a dataset of its own, named as the tensor), its number of elements, its dtype (a position
  in the table), the CRC-32 of its raw bytes and its number of dimensions;
- ``/catalog_shapes``: ``int64``, the tensors' sizes, one tensor after another.

Files of format version 3 (one JSON list per tensor) and of versions 1 and 2 (a dataset per
tensor, HDF5 attributes) are read into the same columns.
"""
from __future__ import annotations

import json
import math
from functools import cached_property, lru_cache
from itertools import chain
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Set, Tuple

import h5py
import numpy as np

from . import format as fmt

__all__ = ["CATALOG", "COLUMNS", "Catalog", "Entry", "PACK_BYTES", "Row", "SHAPES",
           "packed_dataset", "stored_dtype"]

PACK_BYTES = 1 << 16
CATALOG = "catalog"
COLUMNS = "catalog_columns"
SHAPES = "catalog_shapes"
OFFSET, NUMEL, DTYPE, CRC, NDIM = range(5)


@lru_cache(maxsize=None)
def packed_dataset(stored_dtype: np.dtype) -> str:
    return f"packed/{np.dtype(stored_dtype).name}"


@lru_cache(maxsize=None)
def stored_dtype(dtype_name: str) -> np.dtype:
    """The numpy dtype a tensor of torch dtype ``dtype_name`` is stored as."""
    return fmt.numpy_dtype(fmt.torch_dtype(dtype_name))


class Entry(NamedTuple):
    """A tensor in the file: ``offset`` (in elements) is ``None`` for a dataset of its own."""

    dataset: str
    offset: Optional[int]
    shape: Tuple[int, ...]
    numel: int
    dtype: str
    crc32: int


class Row(NamedTuple):
    """A tensor as files of versions 1 to 3 describe it."""

    name: str
    offset: Optional[int]
    shape: Tuple[int, ...]
    dtype: str
    crc32: int


def _plain(value: Any) -> Any:
    """An attribute value as JSON holds it (HDF5 hands back numpy scalars)."""
    return value.item() if isinstance(value, np.generic) else value


def _columns(offsets: Any, numels: Any, dtypes: Any, crcs: Any,
             shapes: Sequence[Sequence[int]]) -> Tuple[np.ndarray, np.ndarray]:
    """The columns and the flat sizes of tensors described column by column."""
    ndims = [len(shape) for shape in shapes]
    columns = np.stack([np.asarray(c, dtype=np.int64).reshape(-1)
                        for c in (offsets, numels, dtypes, crcs, ndims)], axis=1)
    return columns, np.fromiter(chain.from_iterable(shapes), dtype=np.int64, count=sum(ndims))


class Catalog:
    """The tensors (``names`` and their ``columns``) and the attributes (node -> {key: value})
    of a file. Collective nowhere: every rank holds the same catalog."""

    def __init__(self, names: List[str], dtypes: List[str], columns: np.ndarray,
                 shapes: np.ndarray, attributes: Dict[str, Dict[str, Any]]) -> None:
        self.names = names
        self.dtypes = dtypes
        self.columns = columns
        self.shapes = shapes
        self.attributes = attributes
        self._children: Optional[Dict[str, Set[str]]] = None

    # -- building ------------------------------------------------------------------------

    @classmethod
    def lay_out(cls, names: List[str], shapes: Sequence[Tuple[int, ...]],
                dtypes: Sequence[str], crcs: Sequence[int],
                attributes: Dict[str, Dict[str, Any]]) -> "Catalog":
        """Place the tensors in order (name, shape, torch dtype name and CRC-32 of each): the
        small ones one after another in their stored dtype's packed dataset."""
        table = sorted(set(dtypes))
        code = {name: i for i, name in enumerate(table)}
        dtype_column = np.array([code[d] for d in dtypes], dtype=np.int64)
        stored = [stored_dtype(d) for d in table]
        numel = np.array([math.prod(shape) for shape in shapes], dtype=np.int64)
        itemsize = np.array([s.itemsize for s in stored], dtype=np.int64)
        packed = numel * itemsize[dtype_column] < PACK_BYTES
        offset = np.full(len(names), -1, dtype=np.int64)
        for kind in {s.name for s in stored}:
            same = [i for i, s in enumerate(stored) if s.name == kind]
            chosen = packed & np.isin(dtype_column, same)
            counts = numel[chosen]
            offset[chosen] = np.cumsum(counts) - counts
        columns, sizes = _columns(offset, numel, dtype_column, crcs, shapes)
        return cls(list(names), table, columns, sizes,
                   {node: dict(attrs) for node, attrs in attributes.items() if node})

    @classmethod
    def _from_rows(cls, rows: List[Row], attributes: Dict[str, Dict[str, Any]]) -> "Catalog":
        table = sorted({row.dtype for row in rows})
        code = {name: i for i, name in enumerate(table)}
        columns, sizes = _columns([-1 if row.offset is None else row.offset for row in rows],
                                  [math.prod(row.shape) for row in rows],
                                  [code[row.dtype] for row in rows], [row.crc32 for row in rows],
                                  [row.shape for row in rows])
        return cls([row.name for row in rows], table, columns, sizes, attributes)

    # -- looking up ----------------------------------------------------------------------

    @cached_property
    def index(self) -> Dict[str, int]:
        """The row of each tensor name."""
        return {name: i for i, name in enumerate(self.names)}

    @cached_property
    def _shape_list(self) -> List[Tuple[int, ...]]:
        """Every tensor's shape, decoded a group of equal dimensions at a time."""
        ndims = self.columns[:, NDIM]
        starts = np.cumsum(ndims) - ndims
        found: List[Tuple[int, ...]] = [()] * len(self.names)
        for ndim in np.unique(ndims[ndims > 0]).tolist():
            rows = np.flatnonzero(ndims == ndim)
            sizes = self.shapes[starts[rows, None] + np.arange(ndim)]
            for row, shape in zip(rows.tolist(), map(tuple, sizes.tolist())):
                found[row] = shape
        return found

    def shape(self, row: int) -> Tuple[int, ...]:
        return self._shape_list[row]

    def dataset(self, row: int) -> str:
        """The dataset holding row ``row``'s values."""
        if self.columns[row, OFFSET] < 0:
            return self.names[row]
        return packed_dataset(stored_dtype(self.dtypes[self.columns[row, DTYPE]]))

    def entry(self, name: str) -> Optional[Entry]:
        """Tensor ``name``'s entry, ``None`` if there is no such tensor."""
        row = self.index.get(name)
        if row is None:
            return None
        offset, numel, dtype, crc, _ = self.columns[row].tolist()
        return Entry(self.dataset(row), None if offset < 0 else offset, self.shape(row), numel,
                     self.dtypes[dtype], crc)

    def entries(self) -> Iterator[Entry]:
        return (self.entry(name) for name in self.names)

    @cached_property
    def datasets(self) -> Dict[str, Tuple[Tuple[int, ...], np.dtype]]:
        """Every dataset the tensors need, with its shape and stored dtype."""
        found: Dict[str, Tuple[Tuple[int, ...], np.dtype]] = {}
        offset, numel, dtype = (self.columns[:, c] for c in (OFFSET, NUMEL, DTYPE))
        for row in np.flatnonzero(offset < 0).tolist():
            found[self.names[row]] = (self.shape(row), stored_dtype(self.dtypes[dtype[row]]))
        packed = offset >= 0
        for code, name in enumerate(self.dtypes):
            chosen = packed & (dtype == code)
            if chosen.any():
                stored = stored_dtype(name)
                dataset = packed_dataset(stored)
                end = int((offset[chosen] + numel[chosen]).max())
                end = max(end, found.get(dataset, ((0,), stored))[0][0])
                found[dataset] = ((end,), stored)
        return found

    # -- the file's copy -----------------------------------------------------------------

    @cached_property
    def _document(self) -> np.ndarray:
        """The JSON document of names, dtypes and attributes, as bytes (made once: the writer's
        metadata checksum and its layout both need it)."""
        document = {"names": self.names, "dtypes": self.dtypes, "attributes": self.attributes}
        text = json.dumps(document, default=_plain, separators=(",", ":"))
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def encode(self) -> Dict[str, np.ndarray]:
        """The datasets that hold the catalog in a file, by name."""
        return {CATALOG: self._document, COLUMNS: self.columns, SHAPES: self.shapes}

    @classmethod
    def read(cls, f: h5py.File, path: str, version: int,
             check: Optional[Callable[[np.ndarray, np.ndarray, np.ndarray], None]] = None
             ) -> "Catalog":
        """The catalog of an open file of format ``version``; ``check`` (version 4 on) is given
        the catalog's datasets as read (document bytes, shapes, columns) before they are
        decoded, and raises if they are damaged."""
        if version < 3:
            return cls._from_hdf5(f)
        for dataset in (CATALOG,) if version == 3 else (CATALOG, COLUMNS, SHAPES):
            if dataset not in f:
                raise fmt.CheckpointError(f"{path}: the checkpoint lacks its catalog (dataset "
                                          f"{dataset!r}): the file is damaged")
        try:
            raw = f[CATALOG][()]
            if version > 3:
                columns, shapes = f[COLUMNS][()], f[SHAPES][()]
                if check is not None:
                    check(raw, shapes, columns)
            document = json.loads(raw.tobytes().decode("utf-8"))
            attributes = document["attributes"]
            if not isinstance(attributes, dict):
                raise ValueError("the attributes are not a mapping")
            if version == 3:
                return cls._from_rows(_version3_rows(document["tensors"], path), attributes)
            catalog = cls(document["names"], document["dtypes"], columns, shapes, attributes)
            catalog._validate()
            return catalog
        except (OSError, ValueError, KeyError, TypeError, IndexError) as error:
            raise fmt.CheckpointError(f"{path}: the checkpoint's catalog is damaged "
                                      f"({type(error).__name__}: {error})") from None

    def _validate(self) -> None:
        """Raise ``ValueError`` unless the columns and shapes fit the names and each other."""
        if not (isinstance(self.names, list) and all(isinstance(n, str) for n in self.names)):
            raise ValueError("the names are not a list of strings")
        for name in self.dtypes:
            try:
                stored_dtype(name)
            except fmt.CheckpointError as error:
                raise ValueError(str(error)) from None
        count = len(self.names)
        if self.columns.dtype != np.int64 or self.columns.shape != (count, 5):
            raise ValueError(f"columns of shape {self.columns.shape} for {count} tensors")
        codes, ndims = self.columns[:, DTYPE], self.columns[:, NDIM]
        if ((codes < 0) | (codes >= len(self.dtypes)) | (ndims < 0)).any():
            raise ValueError("a dtype outside the table or a negative number of dimensions")
        if self.shapes.dtype != np.int64 or self.shapes.shape != (int(ndims.sum()),):
            raise ValueError(f"{self.shapes.size} sizes for tensors of {int(ndims.sum())} "
                             "dimensions in all")
        numels = np.array([math.prod(s) for s in self._shape_list], dtype=np.int64)
        if not np.array_equal(numels, self.columns[:, NUMEL]):
            raise ValueError("a tensor's element count differs from its shape")

    @classmethod
    def _from_hdf5(cls, f: h5py.File) -> "Catalog":
        rows: List[Row] = []
        attributes: Dict[str, Dict[str, Any]] = {}

        def visit(name: str, node: Any) -> None:
            attrs = {key: _plain(value) for key, value in node.attrs.items()}
            if isinstance(node, h5py.Dataset):
                rows.append(Row(name, None, tuple(node.shape), attrs.pop("torch_dtype", ""),
                                int(attrs.pop("crc32", -1))))
            if attrs:
                attributes[name] = attrs

        f.visititems(visit)
        return cls._from_rows(rows, attributes)

    # -- the tree of names ---------------------------------------------------------------

    def has(self, name: str) -> bool:
        """Whether ``name`` is a tensor or a node holding tensors or attributes."""
        return name in self.index or name in self.attributes or name in self._tree()

    def children(self, node: str) -> List[str]:
        """The names directly below ``node``."""
        return sorted(self._tree().get(node, ()))

    def _tree(self) -> Dict[str, Set[str]]:
        if self._children is None:
            tree: Dict[str, Set[str]] = {}
            for name in (*self.names, *self.attributes):
                while "/" in name:
                    name, _, child = name.rpartition("/")
                    known = name in tree
                    tree.setdefault(name, set()).add(child)
                    if known:              # its ancestors are in the tree already
                        break
            self._children = tree
        return self._children


def _version3_rows(tensors: Dict[str, Any], path: str) -> List[Row]:
    """The rows of a version 3 catalog: ``{name: [dataset, offset, shape, numel, dtype, crc]}``."""
    rows = []
    for name, entry in tensors.items():
        try:
            dataset, offset, shape, numel, dtype, crc = entry
            shape = tuple(int(d) for d in shape)
            expected = name if offset is None else packed_dataset(stored_dtype(dtype))
            if dataset != expected or numel != math.prod(shape):
                raise ValueError(dataset)
            rows.append(Row(name, None if offset is None else int(offset), shape, dtype,
                            int(crc)))
        except (TypeError, ValueError, fmt.CheckpointError):
            raise fmt.CheckpointError(f"{path}: the catalog's entry of {name!r} is "
                                      "damaged") from None
    return rows
