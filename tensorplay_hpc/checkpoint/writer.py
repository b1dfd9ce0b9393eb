"""Writing a checkpoint file collectively, crash-safe.

The ranks first agree on the whole layout (names, shapes, dtypes, attributes) in one small
exchange of metadata. Rank 0 alone then lays out the file with serial h5py: every dataset (a few:
small tensors share one per dtype, see :mod:`.catalog`) contiguous and allocated at once, the
catalog and the root's attributes written but for the checksums, and it broadcasts where each
dataset's bytes lie. Every rank then writes its own tensors' bytes there through MPI-IO, straight
from their memory, one write per run of neighbouring tensors, taking each run's CRC-32 just
before writing it (the bytes are then in the cache, and the disk starts on the file's data one
pass over the data earlier); rank 0 gathers the checksums and writes them into the catalog last.
Everything goes to a temporary file in the target folder, renamed over the target only after
every rank has succeeded, so a crash or a full disk never touches the last good checkpoint.

No HDF5 call waits for another rank, every MPI call releases Python's lock while it waits, and
no communicator is created: a background save's thread never keeps the main thread's Python,
nor its collectives, from running.

The three phases, :func:`plan`, :func:`write_data` and :func:`commit`, are what a blocking
save runs in a row and what a background save (:mod:`.background`) runs on its own thread.
"""
from __future__ import annotations

import errno
import os
from collections import Counter
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import h5py
import numpy as np
from tensorplay_hpc.comm.mpi import MPI

from tensorplay_hpc.comm.agreement import fail_together
from tensorplay_hpc.comm.communicators import close_file, open_file
from tensorplay_hpc.comm.file_writes import write_at_all
from tensorplay_hpc.comm.small_collectives import (all_gather_object, all_reduce_object, barrier,
                                                   broadcast_array, broadcast_object,
                                                   gather_array, quiet_barrier)

from . import files
from . import format as fmt
from . import metadata_checksums, striping
from .guarded_file import GuardedFile
from .catalog import COLUMNS, CRC, DTYPE, NUMEL, OFFSET, Catalog, packed_dataset, stored_dtype
from .snapshot import Snapshot

__all__ = ["Arrays", "DEFAULT_WRITE", "Layout", "WRITE_ENV", "commit", "lay_out",
           "open_for_writing", "plan", "write", "write_data", "write_own"]

Arrays = List[Tuple[str, np.ndarray]]

_COLUMNS_DTYPE = np.dtype("<i8")

_WRITE_BYTES = 1 << 20
"""The most bytes one MPI-IO write carries; longer runs are split, and the thread offers its core
to others between writes (as :func:`.format.checksum` does between pieces)."""

WRITE_ENV = "TENSORPLAY_HPC_CHECKPOINT_WRITE"
DEFAULT_WRITE = "independent"
"""How the ranks write their bytes: ``independent`` (each rank ``Write_at`` on a file it opens
alone) or ``collective`` (``Write_at_all`` over the save's communicator, with ROMIO's collective
buffering). The default is the faster of the two in ``bench checkpoint`` here (see
docs/checkpoints.md); a background save always writes independently, since opening a file over
a communicator makes one inside MPI, which must not wait for the main thread's."""

_NOTHING = np.empty(0, dtype=np.uint8)


def _collective() -> bool:
    """Whether :data:`WRITE_ENV` asks for the collective write path.

    Raises:
        ValueError: it is neither ``independent`` nor ``collective``.
    """
    chosen = os.environ.get(WRITE_ENV, "").strip().lower() or DEFAULT_WRITE
    if chosen not in ("independent", "collective"):
        raise ValueError(f"{WRITE_ENV}={chosen!r}: expected independent or collective")
    return chosen == "collective"


def _file_size(catalog: Catalog) -> int:
    """An upper estimate of the file's size: the data plus room for HDF5's metadata."""
    datasets = catalog.datasets
    data = sum(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
               for shape, dtype in datasets.values())
    return data + (1 << 20) + 8192 * len(datasets) + 256 * len(catalog.names)


def _allocated() -> h5py.h5p.PropDCID:
    """A dataset's creation properties: contiguous, its space allocated at its first write
    (:func:`lay_out` writes one element of each, so that its place in the file is known),
    nothing else written there by HDF5 (every rank writes its own bytes)."""
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_layout(h5py.h5d.CONTIGUOUS)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_LATE)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    return dcpl


def lay_out(temporary: str, catalog: Catalog, root_attributes: dict) -> Tuple[np.ndarray, int]:
    """Rank 0: create the file, every dataset of ``catalog.datasets`` allocated and unwritten,
    the catalog and the root's attributes written, but for the catalog's columns (they hold the
    checksums), which are only allocated. Returns each dataset's byte offset in the file, in
    ``catalog.datasets``' order (``-1`` for one without elements), and the columns' offset
    (``-1`` when there are no tensors). Datasets of at least :func:`.striping.boundary` bytes
    start on a multiple of it. Local."""
    end = 0

    def allocate(dataset: h5py.Dataset) -> int:
        """Have HDF5 place ``dataset``'s values (a first element written) and say where."""
        nonlocal end
        if not dataset.size:
            return -1
        dataset[(0,) * dataset.ndim] = np.zeros((), dtype=dataset.dtype)
        offset = dataset.id.get_offset()
        end = max(end, offset + dataset.id.get_storage_size())
        return offset

    align = striping.boundary(os.path.dirname(temporary))
    with GuardedFile(temporary) as target, h5py.File(
            target, "w", alignment_threshold=align, alignment_interval=align) as f:
        # Every header first, then every dataset's values: HDF5 puts a header at the file's end
        # too, which would push the next aligned dataset to the next boundary.
        created = [f.create_dataset(name, shape=shape, dtype=dtype, dcpl=_allocated())
                   for name, (shape, dtype) in catalog.datasets.items()]
        encoded = catalog.encode()
        columns = encoded.pop(COLUMNS)
        created.append(f.create_dataset(COLUMNS, shape=columns.shape, dtype=_COLUMNS_DTYPE,
                                        dcpl=_allocated()))
        *placed, columns_offset = [allocate(dataset) for dataset in created]
        offsets = np.array(placed, dtype=np.int64)
        for name, array in encoded.items():
            f.create_dataset(name, data=np.ascontiguousarray(array))
        for key, value in root_attributes.items():
            f.attrs[key] = value
    if os.path.getsize(temporary) < end:     # HDF5 refuses a file shorter than its datasets
        os.truncate(temporary, end)
    return offsets, columns_offset


def _write_columns(temporary: str, offset: int, catalog: Catalog, crcs: np.ndarray) -> None:
    """Rank 0: put the checksums ``crcs`` into ``catalog`` and write its columns into their
    place in the file (``offset``, as :func:`lay_out` returns it). Local."""
    catalog.columns[:, CRC] = crcs
    if offset < 0:
        return
    data = np.ascontiguousarray(catalog.columns, dtype=_COLUMNS_DTYPE)
    fd = os.open(temporary, os.O_WRONLY)
    try:
        _write_rest(fd, offset, [data], data.nbytes, 0)
    finally:
        os.close(fd)


def _write_rest(fd: int, position: int, run: List[np.ndarray], nbytes: int, done: int) -> None:
    """Write what is left of ``run`` (``nbytes`` bytes back to back at byte ``position``, the
    first ``done`` of them written) with ``pwrite``, as often as it takes.

    Every MPI library reports a write it could not finish its own way (Open MPI's OMPIO: a short
    count; ROMIO, in MPICH, Intel MPI and Open MPI 5: an exception whose text names the system's
    error), so whatever MPI-IO left undone is tried again here, where the system says why.

    Raises:
        OSError: with the system's error number (``ENOSPC`` when the system accepts no byte
            and says nothing), naming the bytes written.
    """
    data = memoryview(np.concatenate([part.reshape(-1).view(np.uint8) for part in run])
                      if len(run) > 1 else run[0].reshape(-1).view(np.uint8))
    while done < nbytes:
        try:
            written = os.pwrite(fd, data[done:], position + done)
        except OSError as failure:
            number, reason = failure.errno, failure.strerror
        else:
            done += written
            if written:
                continue
            number, reason = errno.ENOSPC, os.strerror(errno.ENOSPC)
        raise OSError(number, f"{reason}: wrote {done} of {nbytes} bytes at byte {position} "
                              "of the file")


def _places(catalog: Catalog, rows: np.ndarray,
            offsets: Dict[str, int]) -> Tuple[np.ndarray, np.ndarray]:
    """The byte of the file where the values of each of catalog rows ``rows`` begin (their
    dataset's offset, plus their own in a packed dataset), and how many bytes they take."""
    element, numel, codes = (catalog.columns[rows, column] for column in (OFFSET, NUMEL, DTYPE))
    stored = [stored_dtype(name) for name in catalog.dtypes]
    itemsize = np.array([dtype.itemsize for dtype in stored], dtype=np.int64)[codes]
    base = np.zeros(len(rows), dtype=np.int64)
    packed = element >= 0
    for code in np.unique(codes[packed]).tolist():
        base[packed & (codes == code)] = offsets[packed_dataset(stored[code])]
    for i in np.flatnonzero(~packed).tolist():
        base[i] = offsets[catalog.names[rows[i]]]
    return base + np.maximum(element, 0) * itemsize, numel * itemsize


def _runs(catalog: Catalog, first_row: int, arrays: Arrays, offsets: Dict[str, int]
          ) -> Iterator[Tuple[int, List[np.ndarray], List[int], List[int]]]:
    """This rank's arrays (contiguous; catalog rows ``first_row`` on) grouped into writes:
    ``(position, parts, their bytes, their arrays' indices)``, the parts lying back to back in
    the file from byte ``position``, at most :data:`_WRITE_BYTES` in all (a longer array is
    split into byte views, in order)."""
    positions, nbytes = _places(catalog, np.arange(first_row, first_row + len(arrays)), offsets)
    owners = np.flatnonzero(nbytes)
    parts = [arrays[i][1] for i in owners.tolist()]
    positions, nbytes = positions[owners], nbytes[owners]
    if (nbytes > _WRITE_BYTES).any():
        split, where, whose = [], [], []
        for part, position, owner in zip(parts, positions.tolist(), owners.tolist()):
            data = part.reshape(-1).view(np.uint8)
            for i in range(0, data.size, _WRITE_BYTES):
                split.append(data[i:i + _WRITE_BYTES])
                where.append(position + i)
                whose.append(owner)
        parts, positions = split, np.array(where, dtype=np.int64)
        owners = np.array(whose, dtype=np.int64)
        nbytes = np.array([part.nbytes for part in parts], dtype=np.int64)
    # Runs of parts that follow each other in the file, cut where the next would exceed the
    # bytes of one write.
    follows = np.zeros(len(parts), dtype=bool)
    follows[1:] = positions[1:] == positions[:-1] + nbytes[:-1]
    starts = np.flatnonzero(~follows).tolist() + [len(parts)]
    ends = np.cumsum(nbytes)
    for first, stop in zip(starts[:-1], starts[1:]):
        while first < stop:
            before = ends[first - 1] if first else 0
            last = min(int(np.searchsorted(ends, before + _WRITE_BYTES, side="right")), stop)
            last = max(last, first + 1)
            yield (int(positions[first]), parts[first:last], nbytes[first:last].tolist(),
                   owners[first:last].tolist())
            first = last


def _write_run(handle: MPI.File, fd: int, position: int, run: List[np.ndarray],
               lengths: List[int], comm: Optional[MPI.Intracomm]) -> None:
    """Write ``run``'s arrays (of ``lengths`` bytes; none: this rank's empty part of a
    collective write) back to back at byte ``position`` of the file, from their own memory,
    through MPI-IO (``handle``; ``Write_at_all`` over ``comm`` when it is given): one array as
    it is, several through a datatype of their addresses. What MPI-IO leaves undone is finished,
    or explained, with ``pwrite`` on ``fd`` (:func:`_write_rest`)."""
    datatype = None
    nbytes = sum(lengths)
    if not run:
        message = [_NOTHING, 0, MPI.BYTE]
    elif len(run) == 1:
        message = [run[0], nbytes, MPI.BYTE]
    else:
        datatype = MPI.BYTE.Create_hindexed(lengths, [MPI.Get_address(part) for part in run])
        datatype.Commit()
        message = [MPI.BOTTOM, 1, datatype]
    status = MPI.Status()
    try:
        if comm is None:
            handle.Write_at(position, message, status)
        else:
            write_at_all(handle, comm, position, message, status)
        done = status.Get_count(MPI.BYTE)
    except MPI.Exception:
        done = 0
    finally:
        if datatype is not None:
            datatype.Free()
    if done != nbytes:
        _write_rest(fd, position, run, nbytes, done)


def open_for_writing(temporary: str, comm: Optional[MPI.Intracomm]) -> MPI.File:
    """The temporary file, opened for writing through MPI-IO with the hints of
    :func:`.striping.hints`: by this rank alone, or collectively over ``comm`` when given.

    Raises:
        OSError: the system's reason when it refuses the file too (permissions, a missing
            folder), else ``EIO`` with MPI-IO's own.
    """
    info = MPI.Info.Create()
    for key, value in striping.hints(collective=comm is not None).items():
        info.Set(key, value)
    try:
        return open_file(MPI.COMM_SELF if comm is None else comm, temporary, MPI.MODE_WRONLY,
                         info)
    except MPI.Exception as failure:
        os.close(os.open(temporary, os.O_WRONLY))
        raise OSError(errno.EIO, f"MPI-IO cannot open the file: {failure}") from None
    finally:
        info.Free()


def write_own(temporary: str, catalog: Catalog, offsets: np.ndarray, first_row: int,
              arrays: Arrays, comm: Optional[MPI.Intracomm] = None) -> np.ndarray:
    """Write this rank's arrays (catalog rows ``first_row`` on) where their datasets lie
    (``offsets``, as :func:`lay_out` returns them), taking the CRC-32 of each run just before
    writing it, and ``fsync`` them: on a parallel file system each node holds its own writes
    until it syncs them, so rank 0's ``fsync`` at the commit would not make them durable.
    Returns the arrays' checksums (``int64``).

    Without ``comm``, local: the file is opened by this rank alone (an MPI-IO open on more ranks
    creates a communicator, which Open MPI does one at a time per process, so it could wait for
    the main thread's), and only if it has values to write. With ``comm``, collective over it:
    every rank opens the file and takes part in as many ``Write_at_all`` as the rank with the
    most runs has (with nothing, once its own are written or one of them failed)."""
    crcs = np.zeros(len(arrays), dtype=np.int64)
    runs = list(_runs(catalog, first_row, arrays, dict(zip(catalog.datasets, offsets.tolist()))))
    rounds = len(runs) if comm is None else all_reduce_object(len(runs), comm, MPI.MAX)
    if not rounds:
        return crcs
    handle = open_for_writing(temporary, comm)
    failure: Optional[OSError] = None
    try:
        fd = os.open(temporary, os.O_WRONLY)     # to start each run's writeback at once
        try:
            for i in range(rounds):
                if i >= len(runs) or failure is not None:
                    _write_run(handle, fd, 0, [], [], comm)
                    continue
                position, run, lengths, owners = runs[i]
                for part, owner in zip(run, owners):
                    crcs[owner] = fmt.checksum(part, int(crcs[owner]))
                try:
                    _write_run(handle, fd, position, run, lengths, comm)
                except OSError as error:
                    if comm is None:
                        raise
                    failure = error
                files.start_writeback(fd, position, sum(lengths))
                os.sched_yield()
            if failure is not None:
                raise failure
            if runs:
                os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        close_file(handle, MPI.COMM_SELF if comm is None else comm)
    return crcs


def _write(layout: Layout, comm: MPI.Intracomm, what: str) -> None:
    """Rank 0 lays the file out, then every rank writes its arrays into it, then rank 0 their
    checksums. Collective.

    Raises:
        CheckpointError: on every rank, if any rank failed.
    """
    together = dict(comm=comm, what=what, exc_type=fmt.CheckpointError, quiet=layout.background)
    offsets = np.full(len(layout.catalog.datasets), -1, dtype=np.int64)
    columns_offset = -1
    with fail_together(**together):
        if comm.Get_rank() == 0:
            offsets, columns_offset = lay_out(layout.temporary, layout.catalog,
                                               metadata_checksums.seal(layout.catalog,
                                                                       layout.root_attributes))
    broadcast_array(offsets, comm)
    crcs = np.zeros(len(layout.arrays), dtype=np.int64)
    with fail_together(**together):
        crcs = write_own(layout.temporary, layout.catalog, offsets, layout.first_row,
                         layout.arrays, comm if _collective() and not layout.background else None)
    every = gather_array(crcs, layout.rows, comm)
    with fail_together(**together):
        if comm.Get_rank() == 0:
            _write_columns(layout.temporary, columns_offset, layout.catalog, every)


@dataclass
class Layout:
    """A save after :func:`plan`: the file's layout, agreed on every rank (checksums not taken
    yet), and this rank's arrays (contiguous), the catalog's rows ``first_row`` on (``rows[r]``
    of them are rank ``r``'s); the temporary file exists (empty) in the target folder.
    ``background``: the save runs on a background thread, which waits for the other ranks
    without spinning inside MPI (:func:`tensorplay_hpc.comm.quiet_barrier`)."""

    path: str
    temporary: str
    catalog: Catalog
    root_attributes: dict
    arrays: Arrays
    first_row: int
    rows: List[int]
    background: bool


def plan(path: str, snapshot: Snapshot, comm: MPI.Intracomm, keep: Optional[int] = None,
         background: bool = False) -> Layout:
    """The first phase of a save: agree on the layout (every tensor's name, shape and dtype,
    and the attributes) and create the temporary file. Collective; ``background``:
    run by a background thread (see :class:`Layout`).

    Raises:
        CheckpointError: on every rank, if any rank failed.
    """
    path = os.path.abspath(path)
    rank = comm.Get_rank()
    what = f"saving checkpoint {path}"
    together = dict(comm=comm, what=what, exc_type=fmt.CheckpointError, quiet=background)
    arrays, layout = [], ([], [], [])
    with fail_together(**together):
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        for name, tensor in snapshot.datasets:
            arrays.append((name, fmt.to_numpy(tensor)))
            for column, value in zip(layout, (name, tuple(tensor.shape),
                                              fmt.dtype_name(tensor.dtype))):
                column.append(value)
        if rank == 0:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            files.remove_dead_temporaries(path)

    gathered = all_gather_object((layout, snapshot.attributes), comm)
    names, shapes, dtypes = ([value for part, _ in gathered for value in part[c]]
                             for c in range(3))
    attributes: Dict[str, dict] = {}
    for _, part in gathered:
        for node, attrs in part.items():
            attributes.setdefault(node, {}).update(attrs)
    if len(set(names)) != len(names):
        duplicate = next(n for n, count in Counter(names).items() if count > 1)
        raise fmt.CheckpointError(f"{what}: dataset {duplicate!r} is written by two ranks")
    # The checksums are taken as each rank writes (see :func:`write_own`).
    catalog = Catalog.lay_out(names, shapes, dtypes, np.zeros(len(names), np.int64), attributes)

    temporary = broadcast_object(files.temporary_name(path) if rank == 0 else None, comm)
    with fail_together(**together, catch=OSError):
        if rank == 0:
            files.check_space(temporary, _file_size(catalog))
            striping.create(temporary)
    try:
        with fail_together(**together, catch=OSError):
            files.check_visible(temporary)
    except fmt.CheckpointError:
        if rank == 0:
            files.discard(temporary)
        raise
    rows = [len(part[0]) for part, _ in gathered]
    return Layout(path, temporary, catalog, attributes.get("", {}), arrays, sum(rows[:rank]),
                  rows, background)


def write_data(layout: Layout, comm: MPI.Intracomm) -> Layout:
    """The second phase: rank 0 lays out the temporary file (datasets, catalog, attributes),
    then every rank writes its arrays into it through MPI-IO. Collective.

    Raises:
        CheckpointError: on every rank, if any rank failed; the temporary file is deleted.
    """
    try:
        _write(layout, comm, f"saving checkpoint {layout.path}")
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
    with fail_together(comm, f"saving checkpoint {layout.path}", fmt.CheckpointError,
                       quiet=layout.background):
        if rank == 0:
            try:
                files.commit(layout.temporary, layout.path)
            except Exception:
                files.discard(layout.temporary)
                raise
    if keep is not None and rank == 0:
        files.prune(layout.path, keep)
    if layout.background:
        quiet_barrier(comm)
    else:
        barrier(comm)
    return layout.path


def write(path: str, snapshot: Snapshot, comm: MPI.Intracomm, keep: Optional[int] = None,
          background: bool = False) -> str:
    """Write ``snapshot`` (this rank's part) into the checkpoint file ``path``: :func:`plan`,
    :func:`write_data`, :func:`commit`. Collective; ``background``: run by a background thread
    (see :class:`Layout`).

    Returns the absolute path. Raises :class:`~.format.CheckpointError` on every rank if any
    rank fails; the previous file at ``path`` (if any) is then left as it was.
    """
    return commit(write_data(plan(path, snapshot, comm, keep, background), comm), comm, keep)
