"""Remote references over MPI one-sided communication.

:func:`share` (collective) puts every rank's tensors in MPI windows and returns references
(:class:`RemoteRef`) to all of them; any rank then reads a value (``to_here``) or, through
:mod:`tensorplay_hpc.distributed.autograd` and ``DistributedOptimizer``, sends gradients and
updates parameters, without the owner taking part.
"""
from .progress import ProgressThread, poll
from .reference import RemoteRef, by_owner
from .shared import SharedTensors, share

__all__ = ["ProgressThread", "RemoteRef", "SharedTensors", "by_owner", "poll", "share"]
