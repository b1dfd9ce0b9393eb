"""PowerSGD (Vogels et al., 2019, https://arxiv.org/abs/1905.13727): gradients sent as low-rank
factors, with PyTorch's hyperparameters, defaults and arithmetic.

Each gradient matrix ``M`` (a parameter's gradient viewed as ``shape[0]`` rows) is sent as two
thin matrices: ``P = M Q`` is summed over the group and orthogonalized, ``Q = M^T P`` is summed
and averaged, and ``P Q^T`` replaces ``M``. One power iteration per step, reusing last step's
``Q`` (warm start), and the part of the gradient left out is added to the next step's (error
feedback). Vectors, and matrices that would not shrink by ``min_compression_rate``, are
averaged as they are. Per bucket, two collectives on flat buffers: the uncompressed tensors and
every ``P`` in one, every ``Q`` in the other.

Example::

    state = PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=1000)
    ddp.register_comm_hook(state, powerSGD_hook)
"""
from __future__ import annotations

import logging
import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from tensorplay_hpc import comm
from tensorplay_hpc.comm.mpi import MPI
from tensorplay_hpc.comm.private import private_comm

from .default_hooks import BucketWork, allreduce_fut

__all__ = ["PowerSGDState", "batched_powerSGD_hook", "powerSGD_hook"]

logger = logging.getLogger(__name__)

_SEED_BOUND = 1_000_000_000   # PyTorch draws each bucket's seed for Q below this
_BUCKET_DICTS = ("error_dict", "q_memory_dict")


class PowerSGDState:
    """Hyperparameters and state of :func:`powerSGD_hook` and :func:`batched_powerSGD_hook`
    (PyTorch's names and defaults). Collective: construct it on every rank of the group.

    Args:
        process_group: the data-parallel group (``None`` is ``MPI.COMM_WORLD``); the hooks
            communicate on a private duplicate of it.
        matrix_approximation_rank: the rank of the approximation; lower compresses more.
        start_powerSGD_iter: iterations of plain averaging before compression starts.
        min_compression_rate: a matrix is compressed only if it shrinks by more than this.
        use_error_feedback: add what compression left out to the next step's gradients.
        warm_start: start each step's power iteration from the previous step's ``Q``.
        orthogonalization_epsilon: added to each column's norm when orthogonalizing (guards
            against all-zero columns).
        random_seed: the seed of the generator that draws the first ``Q`` of each bucket.
        compression_stats_logging_frequency: log compression statistics every so many
            iterations (at ``INFO`` level).
        batch_tensors_with_same_shape: compress the matrices of one shape in a bucket as one
            batch (faster, same result up to rounding).

    Attributes:
        iter: iterations counted so far.
        error_dict: this rank's error feedback, one flat tensor per bucket index.
        q_memory_dict, p_memory_dict: the flat ``Q`` and ``P`` factors per bucket index.

    Raises:
        ValueError: ``matrix_approximation_rank`` below 1, ``start_powerSGD_iter`` at most 1
            with error feedback or warm start (as PyTorch), or ``process_group`` is
            ``MPI.COMM_NULL`` on this rank.
    """

    def __init__(self, process_group: Optional[MPI.Comm], matrix_approximation_rank: int = 1,
                 start_powerSGD_iter: int = 1_000, min_compression_rate: float = 2,
                 use_error_feedback: bool = True, warm_start: bool = True,
                 orthogonalization_epsilon: float = 0, random_seed: int = 0,
                 compression_stats_logging_frequency: int = 10_000,
                 batch_tensors_with_same_shape: bool = False) -> None:
        if int(matrix_approximation_rank) != matrix_approximation_rank \
                or matrix_approximation_rank < 1:
            raise ValueError("PowerSGDState: matrix_approximation_rank must be an integer of at "
                             f"least 1, got {matrix_approximation_rank!r}")
        if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
            raise ValueError(
                "Expect `start_powerSGD_iter` > 1 if `use_error_feedback` or `warm_start` is "
                "enabled, because PowerSGD can only be applied after the first two iterations "
                "in DDP.")
        logger.info("PowerSGD config: matrix_approximation_rank = %s; start_powerSGD_iter = %s; "
                    "min_compression_rate = %s; orthogonalization_epsilon = %s; "
                    "use_error_feedback = %s; warm_start = %s; random_seed = %s; "
                    "compression_stats_logging_frequency = %s; "
                    "batch_tensors_with_same_shape = %s", matrix_approximation_rank,
                    start_powerSGD_iter, min_compression_rate, orthogonalization_epsilon,
                    use_error_feedback, warm_start, random_seed,
                    compression_stats_logging_frequency, batch_tensors_with_same_shape)
        self.process_group = comm.resolve(process_group)
        self.matrix_approximation_rank = int(matrix_approximation_rank)
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.batch_tensors_with_same_shape = batch_tensors_with_same_shape
        self.compression_stats_logging_frequency = max(1, compression_stats_logging_frequency)
        self.rng = np.random.RandomState(random_seed)
        self.error_dict: Dict[int, torch.Tensor] = {}
        self.p_memory_dict: Dict[int, torch.Tensor] = {}
        self.q_memory_dict: Dict[int, torch.Tensor] = {}
        self.iter = 0
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0
        self.next_stats_report = 0
        self._comm = private_comm(self.process_group)
        if self._comm == MPI.COMM_NULL:
            raise ValueError(f"PowerSGDState: world rank {MPI.COMM_WORLD.Get_rank()} is not a "
                             "member of process_group (it holds MPI.COMM_NULL)")

    def maybe_increase_iter(self, bucket) -> None:
        """Count an iteration at its last bucket."""
        if bucket.is_last():
            self.iter += 1
        if self.iter == self.start_powerSGD_iter:
            logger.info("Start to apply PowerSGD after %s iterations.", self.iter)

    def compression_stats(self) -> Tuple[float, int, int]:
        """``(rate, elements before, elements after)`` over every compressed step so far;
        the rate is 0 before compression has started."""
        before, after = self.total_numel_before_compression, self.total_numel_after_compression
        return (before / after if after > 0 else 0, before, after)

    def _report_stats(self, bucket) -> None:
        if bucket.is_last() and self.iter >= self.next_stats_report:
            rate, before, after = self.compression_stats()
            logger.info("Compression stats: iter %s, total before compression %s, total after "
                        "compression %s, rate %s", self.iter, before, after, rate)
            self.next_stats_report = self.iter + self.compression_stats_logging_frequency

    def state_dict(self, prefix: Optional[str] = None) -> Dict[str, Any]:
        """The state a resumed run needs to continue exactly: the iteration, the statistics,
        the seed generator, and copies of each bucket's error feedback and ``Q`` (keyed by
        bucket index). Local: each rank's error feedback is its own.

        Args:
            prefix: ``None`` gives nested dicts; a string gives one flat dict whose keys start
                with it (``"powerSGD."`` gives ``"powerSGD.error_dict.0"``...), which
                :func:`tensorplay_hpc.checkpoint.save` stores as ``extra``, tensors as datasets.
        """
        name, keys, pos, has_gauss, cached = self.rng.get_state()
        nested: Dict[str, Any] = {
            "iter": self.iter,
            "total_numel_before_compression": self.total_numel_before_compression,
            "total_numel_after_compression": self.total_numel_after_compression,
            "next_stats_report": self.next_stats_report,
            "rng": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                    "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        }
        for field in _BUCKET_DICTS:
            nested[field] = {b: t.detach().clone() for b, t in getattr(self, field).items()}
        if prefix is None:
            return nested
        flat: Dict[str, Any] = {}
        for key, value in nested.items():
            if isinstance(value, dict):
                flat.update((f"{prefix}{key}.{inner}", v) for inner, v in value.items())
            else:
                flat[prefix + key] = value
        return flat

    def load_state_dict(self, state_dict: Dict[str, Any], prefix: Optional[str] = None) -> None:
        """Restore what :meth:`state_dict` returned (with the same ``prefix``; other keys of a
        flat dict, such as the rest of a checkpoint's extras, are ignored). Tensors are copied;
        they move to the gradients' device on first use. Local.

        Raises:
            KeyError: an entry is missing.
        """
        nested: Dict[str, Any] = {}
        if prefix is None:
            nested = dict(state_dict)
        else:
            for key, value in state_dict.items():
                if not key.startswith(prefix):
                    continue
                head, _, inner = key[len(prefix):].partition(".")
                if inner:
                    nested.setdefault(head, {})[inner] = value
                else:
                    nested[head] = value
        for field in _BUCKET_DICTS:
            tensors = nested.get(field, {})
            setattr(self, field, {int(b): torch.as_tensor(t).clone() for b, t in tensors.items()})
        self.p_memory_dict = {}
        for key in ("iter", "total_numel_before_compression", "total_numel_after_compression",
                    "next_stats_report"):
            setattr(self, key, int(nested[key]))
        rng = nested["rng"]
        keys = torch.as_tensor(rng["keys"]).numpy().astype(np.uint32)
        self.rng.set_state(("MT19937", keys, int(rng["pos"]), int(rng["has_gauss"]),
                            float(rng["cached_gaussian"])))


def _orthogonalize(matrices: torch.Tensor, epsilon: float = 0) -> None:
    """Orthonormalize the columns of each matrix of a ``(batch, rows, cols)`` tensor, in place:
    Gram-Schmidt for at most 2 columns or 16-bit floats (as PyTorch), QR otherwise."""
    cols = matrices.shape[2]
    if cols <= 2 or matrices.dtype in (torch.float16, torch.bfloat16):
        for i in range(cols):
            col = matrices[:, :, i:i + 1]
            norm = torch.norm(col, dim=1, keepdim=True)
            col /= norm + epsilon if epsilon else norm
            if i + 1 < cols:
                rest = matrices[:, :, i + 1:]
                rest -= torch.sum(col * rest, dim=1, keepdim=True) * col
    else:
        matrices.copy_(torch.linalg.qr(matrices).Q)


def _random_q(state: PowerSGDState, shapes: List[Tuple[int, ...]],
              dtype: torch.dtype) -> List[torch.Tensor]:
    """Standard normal matrices drawn as PyTorch draws them: one seed per bucket from the
    state's generator, then the matrices in turn on the CPU."""
    generator = torch.Generator().manual_seed(int(state.rng.randint(_SEED_BOUND)))
    return [torch.randn(*shape, generator=generator, dtype=dtype) for shape in shapes]


def _error_feedback(state: PowerSGDState, index: int,
                    tensor: torch.Tensor) -> Optional[torch.Tensor]:
    """Add the bucket's error to ``tensor``; return a copy of the sum (``None`` without error
    feedback)."""
    if not state.use_error_feedback:
        return None
    error = state.error_dict.get(index)
    if error is None:
        state.error_dict[index] = torch.zeros_like(tensor)
    else:
        if error.numel() != tensor.numel():
            raise ValueError(
                f"PowerSGD: the error feedback of bucket {index} has {error.numel()} elements, "
                f"the bucket {tensor.numel()}: was the state loaded from another model or "
                f"bucket layout? (world rank {MPI.COMM_WORLD.Get_rank()})")
        tensor.add_(error.to(tensor.device))
    return tensor.detach().clone()


def _stored_q(state: PowerSGDState, index: int, numel: int, like: torch.Tensor) -> torch.Tensor:
    q = state.q_memory_dict[index]
    if q.numel() != numel:
        raise ValueError(f"PowerSGD: the Q of bucket {index} has {q.numel()} elements, this "
                         f"bucket needs {numel}: was the state loaded from another model or "
                         f"bucket layout? (world rank {MPI.COMM_WORLD.Get_rank()})")
    if q.device != like.device or q.dtype != like.dtype:
        q = state.q_memory_dict[index] = q.to(like.device, like.dtype)
    return q


class _LowRankWork:
    """A bucket's compressed reduction in flight. The hook starts the first collective (the
    uncompressed tensors and the ``P`` factors); ``wait()`` computes ``Q`` from the summed ``P``,
    sums ``Q`` and decompresses. The second collective starts only in ``wait()``, which DDP
    calls bucket by bucket in the same order on every rank, so the ranks' collectives match."""

    def __init__(self, first: comm.Work, second: Callable[[], comm.Work],
                 finish: Callable[[], torch.Tensor]) -> None:
        self._first = first
        self._second = second
        self._finish = finish
        self._result: Optional[torch.Tensor] = None

    def is_completed(self) -> bool:
        """Whether the result is ready; before ``wait()``, only tests (and so progresses) the
        first collective."""
        if self._result is None:
            self._first.is_completed()
            return False
        return True

    def wait(self) -> torch.Tensor:
        if self._result is None:
            self._first.wait()
            self._second().wait()
            self._result = self._finish()
        return self._result


def _matrix_of(gradient: torch.Tensor) -> torch.Tensor:
    """A gradient as a matrix of ``shape[0]`` rows (a scalar as 1 x 1; zero elements as
    0 x n or n x 0, which go uncompressed)."""
    if gradient.dim() == 0:
        return gradient.view(1, 1)
    return gradient.view(gradient.shape[0], math.prod(gradient.shape[1:]))


def _warming_up(state: PowerSGDState, bucket) -> BucketWork:
    """A warm-up iteration: count it, and average the bucket plainly."""
    state.maybe_increase_iter(bucket)
    return allreduce_fut(state._comm, bucket.buffer())


def powerSGD_hook(state: PowerSGDState, bucket) -> Any:
    """Average the bucket's gradients over ``state.process_group`` by plain allreduce for the
    first ``state.start_powerSGD_iter`` iterations, then with PowerSGD: each matrix worth
    compressing (see :class:`PowerSGDState`) goes as rank-``r`` factors, the other tensors
    (biases, small matrices) as they are. Same arithmetic and random initialization as
    PyTorch's ``powerSGD_hook``. Collective: two allreduces per bucket once compressing.

    Example::

        state = PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=1000)
        ddp.register_comm_hook(state, powerSGD_hook)
    """
    if state.iter < state.start_powerSGD_iter:
        return _warming_up(state, bucket)
    communicator = state._comm
    buffer = bucket.buffer()
    world_size = communicator.Get_size()
    index, dtype, device = bucket.index(), buffer.dtype, buffer.device
    original = _error_feedback(state, index, buffer)

    # Split the gradients into matrices to compress and tensors to send as they are, and the
    # matrices into groups of one shape, in the order shapes first appear (PyTorch's layout).
    uncompressed: List[torch.Tensor] = []
    by_shape: Dict[torch.Size, List[torch.Tensor]] = {}
    for gradient in bucket.gradients():
        matrix = _matrix_of(gradient)
        rows, cols = matrix.shape
        rank = min(rows, cols, state.matrix_approximation_rank)
        compressed_numel = (rows + cols) * rank
        state.total_numel_before_compression += rows * cols
        if compressed_numel * state.min_compression_rate < rows * cols:
            by_shape.setdefault(matrix.shape, []).append(matrix)
            state.total_numel_after_compression += compressed_numel
        else:
            uncompressed.append(gradient)
            state.total_numel_after_compression += rows * cols
    state._report_stats(bucket)

    # Batches of matrices: stacked copies of one shape, or each matrix alone (a view).
    batches: List[Tuple[torch.Tensor, List[torch.Tensor]]] = []
    for matrices in by_shape.values():
        if state.batch_tensors_with_same_shape and len(matrices) > 1:
            batches.append((torch.stack(matrices), matrices))
        else:
            batches.extend((matrix.unsqueeze(0), []) for matrix in matrices)
    ranks = [min(b.shape[1], b.shape[2], state.matrix_approximation_rank) for b, _ in batches]
    p_sizes = [b.shape[0] * b.shape[1] * r for (b, _), r in zip(batches, ranks)]
    q_sizes = [b.shape[0] * b.shape[2] * r for (b, _), r in zip(batches, ranks)]

    # One flat buffer for the first collective: the uncompressed tensors, then every P.
    plain_numel = sum(t.numel() for t in uncompressed)
    first = torch.empty(plain_numel + sum(p_sizes), dtype=dtype, device=device)
    if uncompressed:
        torch.cat([t.reshape(-1) for t in uncompressed], out=first[:plain_numel])
    p_flat = state.p_memory_dict[index] = first[plain_numel:]
    randomize = not state.warm_start or index not in state.q_memory_dict
    if randomize:
        state.q_memory_dict[index] = torch.empty(sum(q_sizes), dtype=dtype, device=device)
    q_flat = _stored_q(state, index, sum(q_sizes), first)
    ps = [part.view(b.shape[0], b.shape[1], r)
          for part, (b, _), r in zip(p_flat.split(p_sizes), batches, ranks)]
    qs = [part.view(b.shape[0], b.shape[2], r)
          for part, (b, _), r in zip(q_flat.split(q_sizes), batches, ranks)]
    if randomize:
        for q, drawn in zip(qs, _random_q(state, [q.shape for q in qs], dtype)):
            q.copy_(drawn)
    for q in qs:
        _orthogonalize(q, state.orthogonalization_epsilon)
    for (batch, _), p, q in zip(batches, ps, qs):
        torch.bmm(batch, q, out=p)
    first_work = comm.all_reduce(first, communicator, comm.ReduceOp.SUM, async_op=True,
                                 in_dtype=True)

    def second() -> comm.Work:
        plain = first[:plain_numel].div_(world_size)
        for tensor, part in zip(uncompressed, plain.split([t.numel() for t in uncompressed])):
            tensor.copy_(part.view_as(tensor))
        for p in ps:
            _orthogonalize(p, state.orthogonalization_epsilon)
        for (batch, _), p, q in zip(batches, ps, qs):
            torch.bmm(batch.transpose(1, 2), p, out=q)
        return comm.all_reduce(q_flat, communicator, comm.ReduceOp.SUM, async_op=True,
                               in_dtype=True)

    def finish() -> torch.Tensor:
        q_flat.div_(world_size)
        for (batch, matrices), p, q in zip(batches, ps, qs):
            torch.bmm(p, q.transpose(1, 2), out=batch)
            for matrix, approximation in zip(matrices, batch):   # stacked copies only
                matrix.copy_(approximation)
        _end_of_step(state, bucket, original, buffer)
        return buffer
    return _LowRankWork(first_work, second, finish)


def _end_of_step(state: PowerSGDState, bucket, original: Optional[torch.Tensor],
                 approximation: torch.Tensor) -> None:
    if original is not None:
        state.error_dict[bucket.index()] = original - approximation
    if not state.warm_start:   # only this bucket's: the others may still be in flight
        state.p_memory_dict.pop(bucket.index(), None)
        state.q_memory_dict.pop(bucket.index(), None)
    state.maybe_increase_iter(bucket)


def batched_powerSGD_hook(state: PowerSGDState, bucket) -> Any:
    """PowerSGD on the whole bucket at once: the flat gradients, padded with zeros to a square
    matrix, go as rank-``r`` factors. Faster than :func:`powerSGD_hook` but usually much less
    accurate unless ``matrix_approximation_rank`` is 1. Plain allreduce for the first
    ``state.start_powerSGD_iter`` iterations, as PyTorch's ``batched_powerSGD_hook``.
    Collective: two allreduces per bucket once compressing.

    Example::

        state = PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=1000)
        ddp.register_comm_hook(state, batched_powerSGD_hook)
    """
    if state.iter < state.start_powerSGD_iter:
        return _warming_up(state, bucket)
    communicator = state._comm
    buffer = bucket.buffer()
    world_size = communicator.Get_size()
    index, dtype, device = bucket.index(), buffer.dtype, buffer.device
    numel = buffer.numel()
    side = math.ceil(math.sqrt(numel))
    rank = min(side, state.matrix_approximation_rank)
    state.total_numel_before_compression += numel
    state.total_numel_after_compression += side * state.matrix_approximation_rank * 2
    state._report_stats(bucket)

    padded = torch.zeros(side * side, dtype=dtype, device=device)
    padded[:numel].copy_(buffer)
    original = _error_feedback(state, index, padded)
    matrix = padded.view(side, side)
    if not state.warm_start or index not in state.q_memory_dict:
        state.q_memory_dict[index] = _random_q(state, [(side, rank)], dtype)[0].to(device)
    q = _stored_q(state, index, side * rank, padded).view(side, rank)
    p = state.p_memory_dict[index] = torch.empty(side, rank, dtype=dtype, device=device)
    epsilon = state.orthogonalization_epsilon
    _orthogonalize(q.unsqueeze(0), epsilon)
    torch.matmul(matrix, q, out=p)
    first_work = comm.all_reduce(p, communicator, comm.ReduceOp.SUM, async_op=True,
                                 in_dtype=True)

    def second() -> comm.Work:
        _orthogonalize(p.unsqueeze(0), epsilon)
        torch.matmul(matrix.t(), p, out=q)
        return comm.all_reduce(q, communicator, comm.ReduceOp.SUM, async_op=True,
                               in_dtype=True)

    def finish() -> torch.Tensor:
        q.div_(world_size)
        torch.matmul(p, q.t(), out=matrix)
        _end_of_step(state, bucket, original, padded)
        return buffer.copy_(padded[:numel])
    return _LowRankWork(first_work, second, finish)
