"""Writing a checkpoint file collectively, crash-safe.

The ranks first agree on the whole layout (names, shapes, dtypes, checksums, attributes) in one
small exchange of metadata; then the datasets are created collectively, as HDF5 requires (a few:
small tensors share one per dtype, see :mod:`.catalog`), and each rank writes its own tensors
straight into them, one write per run of neighbouring tensors. Rank 0 writes the catalog.
Everything goes to a temporary file in the target folder, renamed over the target only after
every rank has succeeded, so a crash or a full disk never touches the last good checkpoint.

The three phases, :func:`plan`, :func:`write_data` and :func:`commit`, are what a blocking
save runs in a row and what a background save (:mod:`.background`) runs on its own thread.

Without a parallel h5py the same file is written serially, rank after rank.
"""
from __future__ import annotations

import os
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import h5py
import numpy as np
from mpi4py import MPI

from tensorplay_hpc.comm import agree
from tensorplay_hpc.comm.watchdog import watched

from . import files
from . import format as fmt
from .catalog import OFFSET, Catalog
from .snapshot import Snapshot

Arrays = List[Tuple[str, np.ndarray]]

_RUN_BYTES = 64 << 20

SERIAL_WARNING = (
    "h5py was built without MPI: the checkpoint is written serially, rank by rank. For parallel "
    "writes, build h5py against parallel HDF5 (see docs/install.md), e.g. on Debian: "
    "CC=mpicc HDF5_MPI=ON HDF5_DIR=/usr/lib/x86_64-linux-gnu/hdf5/openmpi pip install "
    "--no-binary=h5py --no-build-isolation --no-cache-dir h5py")


def _file_size(catalog: Catalog) -> int:
    """An upper estimate of the file's size: the data plus room for HDF5's metadata."""
    datasets = catalog.datasets
    data = sum(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
               for shape, dtype in datasets.values())
    return data + (1 << 20) + 8192 * len(datasets) + 256 * len(catalog.names)


def parallel_available() -> bool:
    return bool(h5py.get_config().mpi)


def _create(f: h5py.File, catalog: Catalog, index: Dict[str, np.ndarray],
            root_attributes: dict) -> None:
    for name, (shape, dtype) in catalog.datasets.items():
        f.create_dataset(name, shape=shape, dtype=dtype)
    for name, array in index.items():
        f.create_dataset(name, shape=array.shape, dtype=array.dtype)
    for key, value in root_attributes.items():
        f.attrs[key] = value


def _runs(catalog: Catalog, arrays: Arrays) -> Iterator[Tuple[str, Optional[int], List[np.ndarray]]]:
    """This rank's arrays grouped into writes: ``(dataset, offset, arrays)``, the arrays lying
    back to back from ``offset`` (``None`` for a dataset of its own)."""
    run: List[np.ndarray] = []
    dataset, start, end, nbytes = "", 0, 0, 0
    for name, array in arrays:
        row = catalog.index[name]
        offset = int(catalog.columns[row, OFFSET])
        if offset < 0:
            yield name, None, [array]
            continue
        packed = catalog.dataset(row)
        if run and (packed != dataset or offset != end or nbytes > _RUN_BYTES):
            yield dataset, start, run
            run = []
        if not run:
            dataset, start, end, nbytes = packed, offset, offset, 0
        run.append(array)
        end += array.size
        nbytes += array.nbytes
    if run:
        yield dataset, start, run


def _write_own(f: h5py.File, catalog: Catalog, index: Dict[str, np.ndarray], arrays: Arrays,
               rank: int) -> None:
    for dataset, offset, run in _runs(catalog, arrays):
        if offset is None:
            if run[0].size:
                f[dataset].write_direct(run[0])
            continue
        flat = np.concatenate([array.reshape(-1) for array in run])
        if flat.size:
            f[dataset].write_direct(flat, dest_sel=np.s_[offset:offset + flat.size])
    if rank == 0:
        for name, array in index.items():
            if array.size:
                f[name].write_direct(np.ascontiguousarray(array))


def _write_parallel(temporary: str, catalog: Catalog, root_attributes: dict, arrays: Arrays,
                    comm: MPI.Intracomm) -> Optional[Exception]:
    with watched("checkpoint file write (HDF5 mpio)", comm):
        try:
            f = h5py.File(temporary, "w", driver="mpio", comm=comm)
        except Exception as error:  # the open is collective: it fails everywhere or nowhere
            return error
        error = None
        try:
            index = catalog.encode()
            _create(f, catalog, index, root_attributes)
            _write_own(f, catalog, index, arrays, comm.Get_rank())
        except Exception as failure:
            error = failure
        finally:
            try:
                f.close()
            except Exception as failure:
                error = error or failure
    return error


def _write_serial(temporary: str, catalog: Catalog, root_attributes: dict, arrays: Arrays,
                  comm: MPI.Intracomm) -> Optional[Exception]:
    error = None
    index = catalog.encode()
    for turn in range(comm.Get_size()):
        if turn == comm.Get_rank():
            try:
                with h5py.File(temporary, "w" if turn == 0 else "r+") as f:
                    if turn == 0:
                        _create(f, catalog, index, root_attributes)
                    _write_own(f, catalog, index, arrays, turn)
            except Exception as failure:
                error = failure
        comm.Barrier()
    return error


@dataclass
class Layout:
    """A save after :func:`plan`: the file's layout, agreed on every rank, and this rank's
    arrays; the temporary file exists (empty) in the target folder."""

    path: str
    temporary: str
    catalog: Catalog
    root_attributes: dict
    arrays: Arrays


def plan(path: str, snapshot: Snapshot, comm: MPI.Intracomm,
         keep: Optional[int] = None) -> Layout:
    """The first phase of a save: agree on the layout (every tensor's name, shape, dtype and
    checksum, and the attributes) and create the temporary file. Collective.

    Raises:
        CheckpointError: on every rank, if any rank failed.
    """
    path = os.path.abspath(path)
    rank = comm.Get_rank()
    what = f"saving checkpoint {path}"
    error, arrays, layout = None, [], ([], [], [], [])
    try:
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        for name, tensor in snapshot.datasets:
            array = fmt.to_numpy(tensor)
            arrays.append((name, array))
            for column, value in zip(layout, (name, tuple(tensor.shape),
                                              fmt.dtype_name(tensor.dtype), fmt.checksum(array))):
                column.append(value)
        if rank == 0:
            os.makedirs(os.path.dirname(path), exist_ok=True)
    except Exception as failure:
        error = failure
    agree(comm, error, what, fmt.CheckpointError)

    gathered = comm.allgather((layout, snapshot.attributes))
    names, shapes, dtypes, crcs = ([value for part, _ in gathered for value in part[c]]
                                   for c in range(4))
    attributes: Dict[str, dict] = {}
    for _, part in gathered:
        for node, attrs in part.items():
            attributes.setdefault(node, {}).update(attrs)
    if len(set(names)) != len(names):
        duplicate = next(n for n, count in Counter(names).items() if count > 1)
        raise fmt.CheckpointError(f"{what}: dataset {duplicate!r} is written by two ranks")
    catalog = Catalog.lay_out(names, shapes, dtypes, crcs, attributes)

    temporary = comm.bcast(files.temporary_name(path) if rank == 0 else None, root=0)
    error = None
    if rank == 0:
        try:
            files.check_space(path, _file_size(catalog))
            files.create_empty(temporary)
        except OSError as failure:
            error = failure
    agree(comm, error, what, fmt.CheckpointError)
    error = None
    try:
        files.check_visible(temporary)
    except OSError as failure:
        error = failure
    try:
        agree(comm, error, what, fmt.CheckpointError)
    except fmt.CheckpointError:
        if rank == 0:
            files.discard(temporary)
        raise
    return Layout(path, temporary, catalog, attributes.get("", {}), arrays)


def write_data(layout: Layout, comm: MPI.Intracomm) -> Layout:
    """The second phase: every rank writes its arrays into the temporary file (in parallel, or
    rank after rank without a parallel h5py). Collective.

    Raises:
        CheckpointError: on every rank, if any rank failed; the temporary file is deleted.
    """
    args = (layout.temporary, layout.catalog, layout.root_attributes, layout.arrays, comm)
    if parallel_available():
        error = _write_parallel(*args)
    else:
        if comm.Get_rank() == 0:
            warnings.warn(SERIAL_WARNING, RuntimeWarning, stacklevel=4)
        error = _write_serial(*args)
    try:
        agree(comm, error, f"saving checkpoint {layout.path}", fmt.CheckpointError)
    except fmt.CheckpointError:
        if comm.Get_rank() == 0:
            files.discard(layout.temporary)
        raise
    return layout


def commit(layout: Layout, comm: MPI.Intracomm, keep: Optional[int] = None) -> str:
    """The last phase, once every rank has written its part: rank 0 renames the file over the
    target (atomically, durably) and prunes the run to ``keep`` checkpoints. Collective.

    Returns:
        The checkpoint's absolute path.

    Raises:
        CheckpointError: on every rank, if the rename failed; the temporary file is deleted.
    """
    rank = comm.Get_rank()
    error = None
    if rank == 0:
        try:
            files.commit(layout.temporary, layout.path)
        except Exception as failure:
            error = failure
            files.discard(layout.temporary)
    agree(comm, error, f"saving checkpoint {layout.path}", fmt.CheckpointError)
    if keep is not None and rank == 0:
        files.prune(layout.path, keep)
    comm.Barrier()
    return layout.path


def write(path: str, snapshot: Snapshot, comm: MPI.Intracomm, keep: Optional[int] = None) -> str:
    """Write ``snapshot`` (this rank's part) into the checkpoint file ``path``: :func:`plan`,
    :func:`write_data`, :func:`commit`. Collective.

    Returns the absolute path. Raises :class:`~.format.CheckpointError` on every rank if any
    rank fails; the previous file at ``path`` (if any) is then left as it was.
    """
    return commit(write_data(plan(path, snapshot, comm, keep), comm), comm, keep)
