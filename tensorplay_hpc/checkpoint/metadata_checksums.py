"""Checksums of a checkpoint's metadata (format version 5 on): the root's attributes and the
catalog, so that bit rot there is found as surely as in the tensors' values.

The root attribute :data:`KEY` holds one JSON object: the CRC-32 of each other root attribute
(of its value as JSON), and of the catalog's three datasets: ``catalog`` (its bytes: the tensors'
names, the dtype table and every attribute below the root), ``catalog_shapes`` (its ``int64``
values) and ``catalog_columns`` (its ``int64`` columns but for the tensors' own CRC-32 column,
which is written last and is checked against the values whenever they are read). The writer
seals the file before any rank writes; a reader checks on opening. Local.
"""
from __future__ import annotations

import json
from typing import Any, Dict, Mapping, Optional

import numpy as np

from . import format as fmt
from .catalog import CATALOG, COLUMNS, CRC, SHAPES, Catalog

__all__ = ["FIRST_VERSION", "KEY", "check_catalog", "check_root", "seal"]

KEY = "metadata_crc32"
FIRST_VERSION = 5
"""The first format version whose files carry :data:`KEY`; older ones have no metadata
checksums."""

_WHAT = {CATALOG: "the catalog's JSON document (tensor names, dtypes and every attribute below "
                  "the root; dataset 'catalog')",
         SHAPES: "the catalog's tensor shapes (dataset 'catalog_shapes')",
         COLUMNS: "the catalog's columns of tensor places and dtypes (dataset 'catalog_columns')"}


def _value_crc(value: Any) -> int:
    """The CRC-32 of an attribute's value written as JSON (HDF5 hands back numpy values)."""
    if isinstance(value, (np.generic, np.ndarray)):
        value = value.tolist()
    return fmt.crc32(json.dumps(value).encode("utf-8")) & 0xFFFFFFFF


def _crcs(document: np.ndarray, shapes: np.ndarray, columns: np.ndarray) -> Dict[str, int]:
    """The checksums of the catalog's datasets, as :func:`seal` records them (none for columns
    that are not five wide)."""
    found = {CATALOG: fmt.checksum(document), SHAPES: fmt.checksum(np.asarray(shapes, "<i8"))}
    if columns.ndim == 2 and columns.shape[1] == 5:
        described = np.delete(np.asarray(columns, dtype="<i8"), CRC, axis=1)
        found[COLUMNS] = fmt.checksum(np.ascontiguousarray(described))
    return found


def seal(catalog: Catalog, root_attributes: Mapping[str, Any]) -> Dict[str, Any]:
    """``root_attributes`` and, under :data:`KEY`, the checksums of every one of them and of
    ``catalog`` as :meth:`.Catalog.encode` writes it."""
    encoded = catalog.encode()
    table = {"attributes": {key: _value_crc(value) for key, value in root_attributes.items()},
             "catalog": _crcs(encoded[CATALOG], encoded[SHAPES], encoded[COLUMNS])}
    return {**root_attributes, KEY: json.dumps(table, separators=(",", ":"))}


def check_root(path: str, attributes: Mapping[str, Any]) -> Dict[str, int]:
    """Check the root's ``attributes`` (of a file of version :data:`FIRST_VERSION` or later)
    against their checksums; return the catalog's, for :func:`check_catalog`.

    Raises:
        CheckpointError: naming the file and the attribute that is damaged or missing.
    """
    try:
        table = json.loads(attributes[KEY])
        recorded, catalog = table["attributes"], table["catalog"]
        if not (isinstance(recorded, dict) and isinstance(catalog, dict)):
            raise TypeError("not a table of checksums")
    except (KeyError, TypeError, ValueError) as error:
        raise fmt.CheckpointError(f"{path}: the checksums of the checkpoint's metadata (root "
                                  f"attribute {KEY!r}) cannot be read ({type(error).__name__}: "
                                  f"{error}): the file is damaged") from None
    for key in sorted(set(attributes) - {KEY} | set(recorded)):
        if key not in attributes:
            raise fmt.CheckpointError(f"{path}: the checkpoint lacks root attribute {key!r}, "
                                      "which its metadata checksums list: the file is damaged")
        if recorded.get(key) != _value_crc(attributes[key]):
            raise fmt.CheckpointError(f"{path}: root attribute {key!r} does not match its "
                                      "checksum: the file is damaged")
    return catalog


def check_catalog(path: str, expected: Optional[Mapping[str, int]], document: np.ndarray,
                  shapes: np.ndarray, columns: np.ndarray) -> None:
    """Check the catalog's datasets as read from the file against ``expected`` (from
    :func:`check_root`; ``None``: a file older than :data:`FIRST_VERSION`, nothing to check).

    Raises:
        CheckpointError: naming the file and the dataset that is damaged.
    """
    if expected is None:
        return
    found = _crcs(document, shapes, columns)
    for name, what in _WHAT.items():
        if found.get(name) != expected.get(name):
            raise fmt.CheckpointError(f"{path}: {what} does not match its checksum: the file "
                                      "is damaged")
