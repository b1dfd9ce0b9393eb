"""Writing a checkpoint file collectively, crash-safe.

The ranks first agree on the whole layout (names, shapes, dtypes, checksums, attributes) in one
small exchange of metadata; then every dataset is created collectively, as HDF5 requires, and
each rank writes its own tensors straight into their datasets. Everything goes to a temporary
file in the target folder, renamed over the target only after every rank has succeeded, so a
crash or a full disk never touches the last good checkpoint.

Without a parallel h5py the same file is written serially, rank after rank.
"""
from __future__ import annotations

import os
import warnings
from typing import Dict, List, Optional, Tuple

import h5py
import numpy as np
from mpi4py import MPI

from tensorplay_hpc.comm import agree
from tensorplay_hpc.comm.watchdog import watched

from . import files
from . import format as fmt
from .snapshot import Snapshot

# (name, shape, torch dtype name, crc32)
Layout = List[Tuple[str, Tuple[int, ...], str, int]]


def _file_size(layout: Layout) -> int:
    """An upper estimate of the file's size: the data plus room for HDF5's metadata."""
    data = sum(int(np.prod(shape, dtype=np.int64)) * fmt.numpy_dtype(fmt.torch_dtype(dtype)).itemsize
               for _, shape, dtype, _ in layout)
    return data + (1 << 20) + 8192 * len(layout)


def parallel_available() -> bool:
    return bool(h5py.get_config().mpi)


def _create(f: h5py.File, layout: Layout, attributes: Dict[str, dict]) -> None:
    for name, shape, dtype, crc in layout:
        dataset = f.create_dataset(name, shape=shape, dtype=fmt.numpy_dtype(fmt.torch_dtype(dtype)))
        dataset.attrs["torch_dtype"] = dtype
        dataset.attrs["crc32"] = np.uint32(crc)
    for path, attrs in attributes.items():
        node = f.require_group(path) if path else f
        for key, value in attrs.items():
            node.attrs[key] = value


def _write_own(f: h5py.File, arrays: List[Tuple[str, np.ndarray]]) -> None:
    for name, array in arrays:
        if array.size:
            f[name].write_direct(array)


def _write_parallel(temporary: str, layout: Layout, attributes: Dict[str, dict],
                    arrays: List[Tuple[str, np.ndarray]], comm: MPI.Intracomm) -> Optional[Exception]:
    with watched("checkpoint file write (HDF5 mpio)", comm):
        try:
            f = h5py.File(temporary, "w", driver="mpio", comm=comm)
        except Exception as error:  # the open is collective: it fails everywhere or nowhere
            return error
        error = None
        try:
            _create(f, layout, attributes)
            _write_own(f, arrays)
        except Exception as failure:
            error = failure
        finally:
            try:
                f.close()
            except Exception as failure:
                error = error or failure
    return error


def _write_serial(temporary: str, layout: Layout, attributes: Dict[str, dict],
                  arrays: List[Tuple[str, np.ndarray]], comm: MPI.Intracomm) -> Optional[Exception]:
    error = None
    for turn in range(comm.Get_size()):
        if turn == comm.Get_rank():
            try:
                with h5py.File(temporary, "w" if turn == 0 else "r+") as f:
                    if turn == 0:
                        _create(f, layout, attributes)
                    _write_own(f, arrays)
            except Exception as failure:
                error = failure
        comm.Barrier()
    return error


def write(path: str, snapshot: Snapshot, comm: MPI.Intracomm, keep: Optional[int] = None) -> str:
    """Write ``snapshot`` (this rank's part) into the checkpoint file ``path``. Collective.

    Returns the absolute path. Raises :class:`~.format.CheckpointError` on every rank if any
    rank fails; the previous file at ``path`` (if any) is then left as it was.
    """
    path = os.path.abspath(path)
    rank = comm.Get_rank()
    what = f"saving checkpoint {path}"
    error, layout, arrays = None, [], []
    try:
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        for name, tensor in snapshot.datasets:
            array = fmt.to_numpy(tensor)
            arrays.append((name, array))
            layout.append((name, tuple(tensor.shape), fmt.dtype_name(tensor.dtype), fmt.checksum(array)))
        if rank == 0:
            os.makedirs(os.path.dirname(path), exist_ok=True)
    except Exception as failure:
        error = failure
    agree(comm, error, what, fmt.CheckpointError)

    gathered = comm.allgather((layout, snapshot.attributes))
    layout = [entry for part, _ in gathered for entry in part]
    attributes: Dict[str, dict] = {}
    for _, part in gathered:
        for node, attrs in part.items():
            attributes.setdefault(node, {}).update(attrs)
    names = [entry[0] for entry in layout]
    if len(set(names)) != len(names):
        duplicate = next(n for n in names if names.count(n) > 1)
        raise fmt.CheckpointError(f"{what}: dataset {duplicate!r} is written by two ranks")

    temporary = comm.bcast(files.temporary_name(path) if rank == 0 else None, root=0)
    error = None
    if rank == 0:
        try:
            files.check_space(path, _file_size(layout))
        except OSError as failure:
            error = failure
    agree(comm, error, what, fmt.CheckpointError)
    if parallel_available():
        error = _write_parallel(temporary, layout, attributes, arrays, comm)
    else:
        if rank == 0:
            warnings.warn("h5py was built without MPI: the checkpoint is written serially, rank "
                          "by rank (install h5py against parallel HDF5 for parallel writes)",
                          RuntimeWarning, stacklevel=3)
        error = _write_serial(temporary, layout, attributes, arrays, comm)
    try:
        agree(comm, error, what, fmt.CheckpointError)    # every rank wrote its part...
        error = None
        if rank == 0:                                    # ...before the file replaces the old one
            try:
                files.commit(temporary, path)
            except Exception as failure:
                error = failure
        agree(comm, error, what, fmt.CheckpointError)
    except fmt.CheckpointError:
        if rank == 0:
            files.discard(temporary)
        raise
    if keep is not None and rank == 0:
        files.prune(os.path.dirname(path), keep)
    comm.Barrier()
    return path
