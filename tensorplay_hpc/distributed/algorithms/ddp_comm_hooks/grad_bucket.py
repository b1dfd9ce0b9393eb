"""What a communication hook receives and returns.

A hook (:data:`CommHook`) is called as ``hook(state, bucket)`` with a :class:`GradBucket` and
returns a :class:`HookResult`:

- an object with ``wait()`` that returns the reduced flat tensor (or a one-element list of it),
  such as :class:`~.default_hooks.BucketWork`; an ``is_completed()`` method, if present, lets
  DDP drive MPI progress during the backward pass;
- or a ``torch.futures.Future`` whose value is that tensor.

A result whose ``consumes_gradients`` attribute is true used the gradients itself (ZeRO-2's
step, :func:`~.ddp_zero_hook.hook_with_zero2_step`): DDP then writes no gradients back, leaves
the parameters' ``.grad`` as ``None`` and frees the bucket's buffer until the next backward pass.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Protocol, Sequence, Union

import torch

from tensorplay_hpc import comm
from tensorplay_hpc.comm.mpi import MPI

__all__ = ["CommHook", "GradBucket", "HookResult", "result_done", "result_tensor"]


class HookResult(Protocol):
    """What a communication hook returns: ``wait()`` blocks until the bucket is reduced and
    gives the reduced flat tensor, or a one-element list of it (a ``torch.futures.Future``'s
    value). Optional members, looked up when present: ``is_completed()`` (our works) or
    ``done()`` (a Future) test for completion, which drives MPI progress during the backward
    pass; a true ``consumes_gradients`` says the hook used the gradients itself."""

    def wait(self) -> Union[torch.Tensor, List[torch.Tensor]]:
        ...


class GradBucket:
    """The gradients of several parameters of one dtype and device in one flat buffer, which is
    allocated when first used and freed by :meth:`release` (PyTorch's ``GradBucket``
    interface).

    Args:
        index: the bucket's position in the order buckets are reduced.
        parameters: the bucket's parameters, in slot order.
        is_last: whether this bucket is the last reduced in an iteration.
    """

    def __init__(self, index: int, parameters: Sequence[torch.nn.Parameter], is_last: bool) -> None:
        self._index = index
        self._parameters = list(parameters)
        self._is_last = is_last
        self._flat: Optional[comm.FlatBuffer] = None

    @property
    def flat(self) -> comm.FlatBuffer:
        """The flat buffer and its per-parameter views (allocated on first use)."""
        if self._flat is None:
            first = self._parameters[0]
            self._flat = comm.FlatBuffer([p.shape for p in self._parameters], first.dtype,
                                         first.device)
        return self._flat

    def release(self) -> None:
        """Free the buffer; the next use allocates a new one."""
        self._flat = None

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat gradient tensor."""
        return self.flat.buffer

    def gradients(self) -> List[torch.Tensor]:
        """Views of :meth:`buffer` shaped like each parameter."""
        return list(self.flat.views)

    def parameters(self) -> List[torch.nn.Parameter]:
        return list(self._parameters)

    def is_last(self) -> bool:
        """Whether this is the last bucket reduced in an iteration."""
        return self._is_last

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Replace the bucket's contents with ``tensor``'s."""
        self.flat.buffer.copy_(tensor.reshape(-1))


def result_done(result: HookResult) -> bool:
    """Whether a hook's result has completed, testing it (which drives MPI progress)."""
    if hasattr(result, "is_completed"):
        return result.is_completed()
    if hasattr(result, "done"):
        return result.done()
    return False


def result_tensor(result: HookResult) -> torch.Tensor:
    """Wait for a hook's result and return the reduced tensor.

    Raises:
        TypeError: the result does not wait to a tensor.
    """
    value = result.wait()
    if isinstance(value, (list, tuple)):
        value = value[0]
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"a communication hook's result must wait() to a tensor, got "
                        f"{type(value).__name__} (world rank {MPI.COMM_WORLD.Get_rank()})")
    return value


CommHook = Callable[[Any, GradBucket], HookResult]
"""A communication hook: ``hook(state, bucket)`` starts the bucket's reduction."""
