"""Post-local SGD's communication hook: global gradient averaging during a warm-up, then
averaging inside a subgroup (the node by default) while a model averager syncs globally."""
from __future__ import annotations

import logging
from typing import Optional

from tensorplay_hpc.comm.mpi import MPI

from tensorplay_hpc import comm
from tensorplay_hpc.comm.communicators import free, split_by_node
from tensorplay_hpc.comm.private import private_comm

from .default_hooks import BucketWork, allreduce_fut

__all__ = ["PostLocalSGDState", "post_localSGD_hook"]

logger = logging.getLogger(__name__)


class PostLocalSGDState(comm.Closeable):
    """State of :func:`post_localSGD_hook`. Collective: construct it on every rank.

    Args:
        process_group: the global group of the warm-up (``None`` is ``MPI.COMM_WORLD``).
        subgroup: the group that averages gradients after the warm-up; ``None`` is the ranks
            sharing this node (``Split_type(COMM_TYPE_SHARED)`` of ``process_group``), whether
            or not the node's ranks are consecutive (``--map-by node``).
        start_localSGD_iter: the number of iterations with global averaging.
        post_local_gradient_allreduce: ``False`` leaves gradients purely local after the
            warm-up (no subgroup at all).

    Attributes:
        iter: iterations counted so far (only during the warm-up, as in PyTorch).
    """

    def __init__(self, process_group: Optional[MPI.Comm], subgroup: Optional[MPI.Comm],
                 start_localSGD_iter: int, post_local_gradient_allreduce: bool = True) -> None:
        logger.info("Local SGD will be started after %s iterations", start_localSGD_iter)
        self.process_group = comm.resolve(process_group)
        self.start_localSGD_iter = start_localSGD_iter
        self.post_local_gradient_allreduce = post_local_gradient_allreduce
        self.iter = 0
        self._closed = False
        self._global = private_comm(self.process_group)
        self._node: Optional[comm.ProcessGroup] = None
        if subgroup is None and post_local_gradient_allreduce:
            node = split_by_node(self._global)
            self._node = comm.ProcessGroup(node, owner="PostLocalSGDState")
            free(node)
            subgroup = self._node.comm
        self.subgroup = subgroup
        self._local = None
        if post_local_gradient_allreduce:
            self._local = subgroup if self._node is not None else private_comm(subgroup)
            if self._local == MPI.COMM_NULL:
                raise ValueError(f"PostLocalSGDState: world rank {MPI.COMM_WORLD.Get_rank()} "
                                 "is not a member of the subgroup (it holds MPI.COMM_NULL)")

    def close(self) -> None:
        """Free the node communicator made when ``subgroup`` is ``None``. Collective over
        ``process_group``; closing again does nothing. The duplicates cached on the user's
        communicators go when those are freed (see :mod:`tensorplay_hpc.comm.private`)."""
        if self._node is not None:
            self._node.close()
        self._closed = True

    def check_open(self) -> None:
        """Raise ``RuntimeError`` once :meth:`close` has run."""
        if self._closed:
            raise RuntimeError("PostLocalSGDState is closed: close() freed its communicators "
                               f"(world rank {MPI.COMM_WORLD.Get_rank()})")

    def maybe_increase_iter(self, bucket) -> None:
        """Count an iteration at its last bucket."""
        if bucket.is_last():
            self.iter += 1
        if self.iter == self.start_localSGD_iter:
            logger.info("Start to apply local SGD after %s iterations.", self.iter)


def post_localSGD_hook(state: PostLocalSGDState, bucket) -> BucketWork:
    """Average gradients over ``state.process_group`` for the first ``start_localSGD_iter``
    iterations, then over ``state.subgroup`` (or not at all when
    ``post_local_gradient_allreduce`` is ``False``). Pair it with a model averager whose
    ``warmup_steps`` equals ``start_localSGD_iter``. Collective over the group in use.
    """
    state.check_open()
    buffer = bucket.buffer()
    if state.iter < state.start_localSGD_iter:
        state.maybe_increase_iter(bucket)
        return allreduce_fut(state._global, buffer)
    if state._local is None:
        return BucketWork(buffer)
    return allreduce_fut(state._local, buffer)
