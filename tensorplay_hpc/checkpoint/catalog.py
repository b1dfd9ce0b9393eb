"""Where each tensor of a checkpoint lies, and every attribute below the root: the file's index.

HDF5 creates datasets and attributes collectively and one at a time, a fraction of a millisecond
each, so a model of many small parameters would spend minutes on metadata. A file therefore
keeps tensors of fewer than :data:`PACK_BYTES` bytes back to back in one dataset per stored
dtype (``/packed/<dtype>``), the larger ones in their own datasets, and one JSON document,
``/catalog``, that says for every tensor its dataset, offset, shape, dtype and checksum, and
holds the attributes of every node but the root. Files of format versions 1 and 2 (a dataset per
tensor, HDF5 attributes) are read through the same interface.
"""
from __future__ import annotations

import json
import math
from functools import cached_property, lru_cache
from typing import (Any, Dict, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Set,
                    Tuple)

import h5py
import numpy as np

from . import format as fmt

PACK_BYTES = 1 << 16
CATALOG = "catalog"


@lru_cache(maxsize=None)
def packed_dataset(stored_dtype: np.dtype) -> str:
    return f"packed/{np.dtype(stored_dtype).name}"


class Entry(NamedTuple):
    """A tensor in the file: ``offset`` (in elements) is ``None`` for a dataset of its own."""

    dataset: str
    offset: Optional[int]
    shape: Tuple[int, ...]
    numel: int
    dtype: str
    crc32: int


def _plain(value: Any) -> Any:
    """An attribute value as JSON holds it (HDF5 hands back numpy scalars)."""
    return value.item() if isinstance(value, np.generic) else value


class Catalog:
    """The tensors (name -> entry) and the attributes (node -> {key: value}) of a file.

    Entries read from a file stay the JSON lists they were until :meth:`entry` asks for one,
    since a load needs only some of them.
    """

    def __init__(self, tensors: Dict[str, Sequence[Any]],
                 attributes: Dict[str, Dict[str, Any]]) -> None:
        self.tensors = tensors
        self.attributes = attributes
        self._children: Optional[Dict[str, Set[str]]] = None

    def entry(self, name: str) -> Optional[Entry]:
        """Tensor ``name``'s entry, ``None`` if there is no such tensor."""
        row = self.tensors.get(name)
        if row is None or isinstance(row, Entry):
            return row
        dataset, offset, shape, numel, dtype, crc = row
        return Entry(dataset, offset, tuple(shape), int(numel), dtype, int(crc))

    def entries(self) -> Iterator[Entry]:
        return (self.entry(name) for name in self.tensors)

    @classmethod
    def lay_out(cls, layout: Iterable[Tuple[str, Sequence[int], str, int]],
                attributes: Dict[str, Dict[str, Any]]) -> "Catalog":
        """Place the tensors of ``layout`` (name, shape, torch dtype name, crc32), in order: the
        small ones one after another in their dtype's packed dataset."""
        tensors: Dict[str, Entry] = {}
        filled: Dict[str, int] = {}
        for name, shape, dtype, crc in layout:
            stored = fmt.numpy_dtype(fmt.torch_dtype(dtype))
            numel = math.prod(shape)
            if numel * stored.itemsize < PACK_BYTES:
                dataset = packed_dataset(stored)
                offset = filled.get(dataset, 0)
                filled[dataset] = offset + numel
                tensors[name] = Entry(dataset, offset, tuple(shape), numel, dtype, crc)
            else:
                tensors[name] = Entry(name, None, tuple(shape), numel, dtype, crc)
        return cls(tensors, {node: dict(attrs) for node, attrs in attributes.items() if node})

    @cached_property
    def datasets(self) -> Dict[str, Tuple[Tuple[int, ...], np.dtype]]:
        """Every dataset the tensors need, with its shape and stored dtype."""
        found: Dict[str, Tuple[Tuple[int, ...], np.dtype]] = {}
        packed_ends: Dict[str, int] = {}
        for entry in self.entries():
            stored = fmt.numpy_dtype(fmt.torch_dtype(entry.dtype))
            if entry.offset is None:
                found[entry.dataset] = (entry.shape, stored)
            else:
                end = max(packed_ends.get(entry.dataset, 0), entry.offset + entry.numel)
                packed_ends[entry.dataset] = end
                found[entry.dataset] = ((end,), stored)
        return found

    def to_bytes(self) -> np.ndarray:
        document = {"tensors": self.tensors, "attributes": self.attributes}   # entries as lists
        text = json.dumps(document, default=_plain, separators=(",", ":"))
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    @classmethod
    def read(cls, f: h5py.File, path: str, version: int) -> "Catalog":
        """The catalog of an open file of format ``version``: its ``/catalog``, or one built
        from the HDF5 layout of versions 1 and 2."""
        if version < 3:
            return cls._from_hdf5(f)
        if CATALOG not in f:
            raise fmt.CheckpointError(f"{path}: the checkpoint lacks its catalog (dataset "
                                      f"{CATALOG!r}): the file is damaged")
        try:
            document = json.loads(f[CATALOG][()].tobytes().decode("utf-8"))
            tensors, attributes = document["tensors"], document["attributes"]
            if not (isinstance(tensors, dict) and isinstance(attributes, dict)):
                raise ValueError("not a catalog of tensors and attributes")
            return cls(tensors, attributes)
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise fmt.CheckpointError(f"{path}: the checkpoint's catalog is damaged "
                                      f"({type(error).__name__}: {error})") from None

    @classmethod
    def _from_hdf5(cls, f: h5py.File) -> "Catalog":
        tensors: Dict[str, Entry] = {}
        attributes: Dict[str, Dict[str, Any]] = {}

        def visit(name: str, node: Any) -> None:
            attrs = {key: _plain(value) for key, value in node.attrs.items()}
            if isinstance(node, h5py.Dataset):
                tensors[name] = Entry(name, None, tuple(node.shape), math.prod(node.shape),
                                      attrs.pop("torch_dtype", ""), int(attrs.pop("crc32", -1)))
            if attrs:
                attributes[name] = attrs

        f.visititems(visit)
        return cls(tensors, attributes)

    def has(self, name: str) -> bool:
        """Whether ``name`` is a tensor or a node holding tensors or attributes."""
        return name in self.tensors or name in self.attributes or name in self._tree()

    def children(self, node: str) -> List[str]:
        """The names directly below ``node``."""
        return sorted(self._tree().get(node, ()))

    def _tree(self) -> Dict[str, Set[str]]:
        if self._children is None:
            tree: Dict[str, Set[str]] = {}
            for name in (*self.tensors, *self.attributes):
                while "/" in name:
                    name, _, child = name.rpartition("/")
                    known = name in tree
                    tree.setdefault(name, set()).add(child)
                    if known:              # its ancestors are in the tree already
                        break
            self._children = tree
        return self._children
