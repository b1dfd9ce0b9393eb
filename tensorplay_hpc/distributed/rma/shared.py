"""Tensors exposed in MPI windows: :func:`share` and the :class:`SharedTensors` it returns."""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence

import torch

from tensorplay_hpc import comm
from tensorplay_hpc.comm import library
from tensorplay_hpc.comm.dtypes import move_datatype, reduce_dtype
from tensorplay_hpc.comm.mpi import MPI
from tensorplay_hpc.comm.small_collectives import all_gather_object, barrier

from .buffer_pool import empty
from .layout import Layout
from .progress import ProgressThread
from .reference import RemoteRef, by_owner
from .transport import AnyWindow, choose, make_window

__all__ = ["SharedTensors", "share"]


class SharedTensors(comm.Closeable):
    """The tensors of every rank of a group, each in its owner's window memory.

    Two windows hold them, of the transport :func:`~.transport.choose` picked for the group
    (:attr:`transport`). The *values* window holds each rank's tensors; the owner's tensors
    are re-pointed (``tensor.data``) at it, so the owner keeps using the same tensor objects.
    The *gradients* window holds, on each owner, one gradient slot per rank of the group (in
    :func:`~tensorplay_hpc.comm.dtypes.reduce_dtype`, float32 for 16-bit floats): a trainer only
    accumulates into its own slot, so trainers never clobber each other.

    A tensor that does not require grad when shared stays frozen: its references fetch values
    that do not require grad either, so no gradient reaches it and no optimizer updates it.

    After :meth:`close`, every operation on it or its references raises ``RuntimeError``
    ("SharedTensors is closed").

    Attributes:
        refs: all references, flat, in rank order (rank 0's tensors first).
        rank, size: this rank and the size of the group.
        transport: ``"shared"``, ``"mpi"`` or ``"served"``, the same on every rank.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], process_group: Optional[MPI.Comm],
                 progress_thread: Optional[bool]) -> None:
        self._closed = False
        self._group = comm.ProcessGroup(process_group, owner="SharedTensors")
        self.rank, self.size = self._group.rank, self._group.size
        self._tensors = list(tensors)
        for i, tensor in enumerate(self._tensors):
            if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
                raise TypeError(f"rma.share: tensor {i} on rank {self.rank} must be a CPU "
                                f"torch.Tensor, got {_describe(tensor)}")
            move_datatype(tensor.dtype)
        if len({id(t) for t in self._tensors}) != len(self._tensors):
            raise ValueError(f"rma.share: rank {self.rank} lists the same tensor twice")
        self.transport = choose(self._group.comm, bool(progress_thread))
        if progress_thread is None:
            progress_thread = (self.transport != "served"
                               and library.target_progress_needed(self.transport == "mpi")
                               and MPI.Query_thread() == MPI.THREAD_MULTIPLE)
        specs = [(tuple(t.shape), t.dtype) for t in self._tensors]
        gathered = all_gather_object((specs, [t.requires_grad for t in self._tensors]),
                                     self._group.comm)
        all_specs = [s for s, _ in gathered]
        self._value_layouts = [Layout(s) for s in all_specs]
        self._grad_layouts = [Layout([(shape, reduce_dtype(dtype)) for shape, dtype in s])
                              for s in all_specs]
        self.values = self.new_window(self._value_layouts[self.rank].nbytes)
        self.gradients = self.new_window(self._grad_layouts[self.rank].nbytes * self.size)
        with torch.no_grad():
            for i, tensor in enumerate(self._tensors):
                view = self.values.view(self._value_layouts[self.rank].offsets[i], *specs[i])
                view.copy_(tensor)
                tensor.data = view
        self._by_rank: List[List[RemoteRef]] = [
            [RemoteRef(self, owner, i, shape, dtype, requires_grad)
             for i, ((shape, dtype), requires_grad) in enumerate(zip(s, grads))]
            for owner, (s, grads) in enumerate(gathered)]
        self.refs: List[RemoteRef] = [ref for refs in self._by_rank for ref in refs]
        self._progress = (ProgressThread(communicator=self._group.comm) if progress_thread
                          else None)
        barrier(self._group.comm)  # every owner's values are in place before anyone reads

    def check_open(self) -> None:
        """Raise ``RuntimeError`` if :meth:`close` has freed the windows. Local."""
        if self._closed:
            raise RuntimeError(f"SharedTensors is closed (rank {self.rank}): its windows were "
                               "freed by close(), so its references cannot be used any more")

    @property
    def progress_thread(self) -> bool:
        """Whether this rank runs a :class:`~.progress.ProgressThread` for the windows."""
        return self._progress is not None

    @property
    def communicator(self) -> MPI.Intracomm:
        """The private communicator the windows were made on."""
        return self._group.comm

    def new_window(self, nbytes: int) -> AnyWindow:
        """``nbytes`` of this rank's memory in another window of the group's transport (the
        caller frees it). Collective."""
        self.check_open()
        return make_window(self._group.comm, nbytes, self.transport)

    def refs_of(self, rank: int) -> List[RemoteRef]:
        """The references to the tensors rank ``rank`` shared, in its order."""
        return list(self._by_rank[rank])

    def local_tensor(self, index: int) -> torch.Tensor:
        """This rank's own tensor ``index`` (window memory)."""
        self.check_open()
        return self._tensors[index]

    def value_offset(self, ref: RemoteRef) -> int:
        """Byte offset of ``ref``'s value in its owner's part of the values window."""
        return self._value_layouts[ref.owner()].offsets[ref.index]

    def gradient_offset(self, ref: RemoteRef, trainer: int) -> int:
        """Byte offset of ``ref``'s gradient in ``trainer``'s slot on its owner."""
        layout = self._grad_layouts[ref.owner()]
        return trainer * layout.nbytes + layout.offsets[ref.index]

    def fetch(self, ref: RemoteRef) -> torch.Tensor:
        """A copy of ``ref``'s current value, read under a shared lock. Not collective."""
        self.check_open()
        out = empty(ref.shape, ref.dtype)
        with self.values.locked(ref.owner()):
            self.values.get(out, ref.owner(), self.value_offset(ref))
        return out

    def accumulate_gradients(self, gradients: Dict[RemoteRef, torch.Tensor],
                             fresh: Iterable[RemoteRef]) -> None:
        """Add ``gradients`` into this rank's slot on their owners with ``MPI.SUM``; those of
        ``fresh`` refs replace the slot's stale contents instead. Not collective."""
        self.check_open()
        fresh = set(fresh)
        for owner, refs in by_owner(gradients).items():
            with self.gradients.locked(owner):
                kept = []  # alive until the epoch ends
                for ref in refs:
                    grad = gradients[ref].detach().to(reduce_dtype(ref.dtype)).contiguous()
                    kept.append(grad)
                    self.gradients.accumulate(grad, owner, self.gradient_offset(ref, self.rank),
                                              MPI.REPLACE if ref in fresh else MPI.SUM)

    def fetch_gradients(self, refs: Iterable[RemoteRef]) -> Dict[RemoteRef, torch.Tensor]:
        """This rank's accumulated gradients of ``refs``, in their dtype. Not collective."""
        self.check_open()
        out = {}
        for owner, group in by_owner(refs).items():
            with self.gradients.locked(owner):
                for ref in group:
                    out[ref] = self.get_gradient(ref)
        return {ref: grad.to(ref.dtype) for ref, grad in out.items()}

    def get_gradient(self, ref: RemoteRef, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Start reading this rank's gradient of ``ref`` into ``out`` (a new tensor if ``None``),
        in the reduction dtype; it is there once the caller's epoch on the gradients window ends
        (or is flushed)."""
        if out is None:
            out = empty(ref.shape, reduce_dtype(ref.dtype))
        self.gradients.get(out, ref.owner(), self.gradient_offset(ref, self.rank))
        return out

    def abandon(self) -> None:
        """After a lost rank, instead of :meth:`close`: stop this rank's threads of the windows
        (they are left to ``MPI_Finalize``), so that none is inside MPI while the survivors
        shrink; afterwards the references raise as after :meth:`close`. Local."""
        self._closed = True
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        self.values.abandon()
        self.gradients.abandon()

    def close(self) -> None:
        """Free the windows. Collective. The owner's tensors get their own memory back, with
        their last values, so they remain usable. Closing again does nothing."""
        if self._closed:
            return
        self._closed = True
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        with torch.no_grad():
            for tensor in self._tensors:
                tensor.data = tensor.data.clone()
        self.values.free()
        self.gradients.free()
        self._group.close()


def share(tensors: Iterable[torch.Tensor], process_group: Optional[MPI.Comm] = None,
          progress_thread: Optional[bool] = None) -> SharedTensors:
    """Expose this rank's ``tensors`` (possibly none) to the group in MPI windows. Collective.

    Args:
        tensors: CPU tensors this rank owns; those that do not require grad stay frozen (read
            here, once: the owner takes no part later); afterwards they live in window memory (the same
            tensor objects, re-pointed), so the owner keeps reading them locally.
        process_group: an mpi4py intracommunicator; ``None`` is ``MPI.COMM_WORLD``.
        progress_thread: run a :class:`~.progress.ProgressThread` on this rank, for MPI
            one-sided components that need the target to enter MPI (Open MPI's ``osc/pt2pt``,
            the MPICH lineage; not served windows). Needs MPI_THREAD_MULTIPLE. ``None`` (the
            default): where the library needs it
            (:func:`tensorplay_hpc.comm.library.target_progress_needed`; ``mpi`` windows count
            as across nodes) and runs at MPI_THREAD_MULTIPLE.

    Returns:
        A :class:`SharedTensors`: ``.refs`` is the flat list of references to every rank's
        tensors in rank order, ``.refs_of(rank)`` one rank's. ``close()`` it (collective), or use
        it as a context manager.

    Raises:
        TransportError: on every rank, before any window exists, when no transport works
            between the ranks or ``progress_thread`` is asked for below MPI_THREAD_MULTIPLE
            (see :mod:`~.transport`).
    """
    return SharedTensors(list(tensors), process_group, progress_thread)


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor on {value.device}"
    return type(value).__name__
