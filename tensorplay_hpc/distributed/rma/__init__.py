"""Remote references over MPI one-sided communication, or served windows where MPI has none.

:func:`share` (collective) puts every rank's tensors in windows of the transport
:mod:`.transport` chooses (shared memory, MPI passive-target windows, or served windows) and
returns
references (:class:`RemoteRef`) to all of them; any rank then reads a value (``to_here``) or, through
:mod:`tensorplay_hpc.distributed.autograd` and ``DistributedOptimizer``, sends gradients and
updates parameters, without the owner taking part.
"""
from .progress import ProgressThread, poll
from .reference import RemoteRef, by_owner
from .shared import SharedTensors, share
from .transport import TransportError

__all__ = ["ProgressThread", "RemoteRef", "SharedTensors", "TransportError", "by_owner", "poll",
           "share"]
