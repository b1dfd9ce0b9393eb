"""The plain averaging hook, the 16-bit compression hooks and wrappers, and the future-like
result that hooks return."""
from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch

from tensorplay_hpc import comm
from tensorplay_hpc.comm.mpi import MPI
from tensorplay_hpc.comm.private import private_comm

__all__ = ["BucketWork", "allreduce_fut", "allreduce_hook", "bf16_compress_hook",
           "bf16_compress_wrapper", "fp16_compress_hook", "fp16_compress_wrapper"]

Hook = Callable[[Any, Any], Any]


class BucketWork:
    """A bucket's reduction in flight: ``wait()`` returns the reduced flat tensor.

    Args:
        tensor: the tensor that holds the result once ``work`` has completed.
        work: the nonblocking collective writing it, or ``None`` when it is already final.
        then: local work (no communication) run once by ``wait()`` after ``work`` has
            completed, such as casting the result back; it returns the final tensor.
    """

    def __init__(self, tensor: torch.Tensor, work: Optional[comm.Work] = None,
                 then: Optional[Callable[[], torch.Tensor]] = None) -> None:
        self.tensor = tensor
        self._work = work
        self._then = then

    def is_completed(self) -> bool:
        """Whether the communication has completed (testing lets MPI progress meanwhile)."""
        return self._work is None or self._work.is_completed()

    def wait(self) -> torch.Tensor:
        """Block until the reduction has completed; return the reduced tensor."""
        if self._work is not None:
            self._work.wait()
        if self._then is not None:
            then, self._then = self._then, None
            self.tensor = then()
        return self.tensor


def allreduce_fut(communicator: MPI.Intracomm, tensor: torch.Tensor) -> BucketWork:
    """Start averaging ``tensor`` in place over ``communicator`` (divided first, then summed,
    like PyTorch, which keeps 16-bit sums in range; 16-bit floats are summed in their own type,
    as PyTorch's hooks do). Collective."""
    tensor.div_(communicator.Get_size())
    return BucketWork(tensor, comm.all_reduce(tensor, communicator, comm.ReduceOp.SUM,
                                              async_op=True, in_dtype=True))


def allreduce_hook(process_group: Optional[MPI.Comm], bucket) -> BucketWork:
    """Average the bucket's gradients over ``process_group`` (``None`` is ``MPI.COMM_WORLD``);
    with it DDP gives the same gradients as without a hook. Traffic goes over a private
    duplicate cached on the communicator.

    Example::

        ddp.register_comm_hook(None, allreduce_hook)
    """
    return allreduce_fut(private_comm(process_group), bucket.buffer())


def _compress_hook(dtype: torch.dtype, process_group: Optional[MPI.Comm], bucket) -> BucketWork:
    communicator = private_comm(process_group)
    buffer = bucket.buffer()
    compressed = buffer.to(dtype).div_(communicator.Get_size())
    work = comm.all_reduce(compressed, communicator, comm.ReduceOp.SUM, async_op=True,
                           in_dtype=True)

    def decompress() -> torch.Tensor:
        return buffer.copy_(compressed)
    return BucketWork(compressed, work, decompress)


def fp16_compress_hook(process_group: Optional[MPI.Comm], bucket) -> BucketWork:
    """Average the bucket in half precision: cast it to ``torch.float16``, divide by the group
    size, sum over ``process_group`` (``None`` is ``MPI.COMM_WORLD``), cast back into the
    bucket. Half the bytes of :func:`allreduce_hook`. Collective; traffic goes over a private
    duplicate cached on the communicator.

    Example::

        ddp.register_comm_hook(None, fp16_compress_hook)
    """
    return _compress_hook(torch.float16, process_group, bucket)


def bf16_compress_hook(process_group: Optional[MPI.Comm], bucket) -> BucketWork:
    """:func:`fp16_compress_hook` with ``torch.bfloat16``: float32's range, fewer mantissa
    bits. Collective."""
    return _compress_hook(torch.bfloat16, process_group, bucket)


class _CastBucket:
    """A bucket seen in another dtype: what a wrapped hook receives."""

    def __init__(self, bucket, buffer: torch.Tensor) -> None:
        self._bucket = bucket
        self._flat = comm.FlatBuffer([p.shape for p in bucket.parameters()], buffer.dtype,
                                     buffer.device, buffer=buffer)

    def index(self) -> int:
        return self._bucket.index()

    def is_last(self) -> bool:
        return self._bucket.is_last()

    def parameters(self) -> List[torch.nn.Parameter]:
        return self._bucket.parameters()

    def buffer(self) -> torch.Tensor:
        return self._flat.buffer

    def gradients(self) -> List[torch.Tensor]:
        return list(self._flat.views)

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._flat.buffer.copy_(tensor.reshape(-1))


class _CastBack:
    """A wrapped hook's result; ``wait()`` copies it back into the bucket's own buffer."""

    def __init__(self, result: Any, buffer: torch.Tensor) -> None:
        self._result = result
        self._buffer = buffer
        self._done = False

    def is_completed(self) -> bool:
        if self._done:
            return True
        if hasattr(self._result, "is_completed"):
            return self._result.is_completed()
        return bool(getattr(self._result, "done", lambda: False)())

    def wait(self) -> torch.Tensor:
        if not self._done:
            value = self._result.wait()
            if isinstance(value, (list, tuple)):
                value = value[0]
            self._buffer.copy_(value.reshape(-1))
            self._done = True
        return self._buffer


def _compress_wrapper(dtype: torch.dtype, name: str, hook: Hook) -> Hook:
    def compressed_hook(state: Any, bucket) -> _CastBack:
        buffer = bucket.buffer()
        return _CastBack(hook(state, _CastBucket(bucket, buffer.to(dtype))), buffer)
    compressed_hook.__name__ = f"{name}_compress_wrapper({getattr(hook, '__name__', 'hook')})"
    return compressed_hook


def fp16_compress_wrapper(hook: Hook) -> Hook:
    """Run ``hook`` on a ``torch.float16`` copy of each bucket and cast its result back into
    the bucket: ``fp16_compress_wrapper(allreduce_hook)`` is :func:`fp16_compress_hook`.
    The wrapped hook is collective as before.

    Example::

        state = PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=10)
        ddp.register_comm_hook(state, fp16_compress_wrapper(powerSGD_hook))
    """
    return _compress_wrapper(torch.float16, "fp16", hook)


def bf16_compress_wrapper(hook: Hook) -> Hook:
    """:func:`fp16_compress_wrapper` with ``torch.bfloat16``."""
    return _compress_wrapper(torch.bfloat16, "bf16", hook)
