"""The plain averaging hook, and the future-like result that hooks return."""
from __future__ import annotations

from typing import Optional

import torch
from mpi4py import MPI

from tensorplay_hpc import comm
from tensorplay_hpc.comm.private import private_comm

__all__ = ["BucketWork", "allreduce_fut", "allreduce_hook"]


class BucketWork:
    """A bucket's reduction in flight: ``wait()`` returns the reduced flat tensor.

    Args:
        tensor: the tensor that holds the result once ``work`` has completed.
        work: the nonblocking collective writing it, or ``None`` when it is already final.
    """

    def __init__(self, tensor: torch.Tensor, work: Optional[comm.Work] = None) -> None:
        self.tensor = tensor
        self._work = work

    def is_completed(self) -> bool:
        """Whether the result is ready (testing lets MPI progress meanwhile)."""
        return self._work is None or self._work.is_completed()

    def wait(self) -> torch.Tensor:
        """Block until the reduction has completed; return the reduced tensor."""
        if self._work is not None:
            self._work.wait()
        return self.tensor


def allreduce_fut(communicator: MPI.Intracomm, tensor: torch.Tensor) -> BucketWork:
    """Start averaging ``tensor`` in place over ``communicator`` (divided first, then summed,
    like PyTorch, which keeps 16-bit sums in range). Collective."""
    tensor.div_(communicator.Get_size())
    return BucketWork(tensor, comm.all_reduce(tensor, communicator, comm.ReduceOp.SUM,
                                              async_op=True))


def allreduce_hook(process_group: Optional[MPI.Comm], bucket) -> BucketWork:
    """Average the bucket's gradients over ``process_group`` (``None`` is ``MPI.COMM_WORLD``);
    with it DDP gives the same gradients as without a hook. Traffic goes over a private
    duplicate cached on the communicator.

    Example::

        ddp.register_comm_hook(None, allreduce_hook)
    """
    return allreduce_fut(private_comm(process_group), bucket.buffer())
