"""The communication layer: the only code that turns tensors into MPI buffers.

- :mod:`.mpi` is the package's handle on ``mpi4py.MPI``: MPI starts at first use, not at import;
- :mod:`.library` knows the MPI library this process runs (family, version, ABI, thread level,
  CUDA support): what differs between Open MPI, MPICH, Intel MPI, Cray MPICH and MVAPICH;
- :mod:`.group` resolves process groups and holds the library's private communicator
  (:mod:`.private` caches one on a user's communicator); :mod:`.lifetime` is the rule for
  freeing the library's communicators and windows (``close()``, never the garbage collector);
- :mod:`.dtypes` maps torch dtypes and reductions to MPI;
- :mod:`.staging` hands tensor memory to MPI (zero-copy, or staged and copied back);
- :mod:`.chunking` splits messages longer than MPI's count limit, and large allreduces into
  cache-sized pieces; :mod:`.environment` reads the variables every collective consults once;
- :mod:`.flat_buffer` packs many tensors into one buffer;
- :mod:`.collectives` and :mod:`.work` are the collectives, blocking or not; :mod:`.worker`
  runs those started nonblocking, blocking and in order, on a thread per communicator;
  :mod:`.small_collectives` those on small values (objects, flags, digests) and
  :mod:`.communicators` the making of communicators (``Dup``, ``Split``): the package calls no
  mpi4py collective elsewhere, so the watchdog sees every one;
- :mod:`.agreement` turns a failure on one rank into the same error on all
  (:func:`~.agreement.fail_together`);
- :mod:`.consistency`, :mod:`.watchdog` and :mod:`.abort` keep a diverging rank from hanging
  the others;
- :mod:`.fault_tolerance` lets the survivors of a lost rank go on (ULFM: revoke, agree,
  shrink), when enabled, with a :class:`~.fault_tolerance.RankLost` from any collective;
- :mod:`.trace` records every collective and one-sided operation (the last few always, for
  the watchdog's report; all of them as a Chrome trace when asked);
- :mod:`.node_layout` tells which ranks share a node, and forms groups that follow the nodes;
- :mod:`.cuda` decides how GPU memory reaches MPI and which GPU a rank uses;
- :mod:`.capabilities` says what MPI can do between a communicator's ranks (thread level, one
  node, one-sided windows, recovery from a lost rank).

The names exported here (``__all__``) are what users and the layers above call; the rest of the
layer (staging, chunking, the private communicator cache) is imported from its own module.
"""
from . import capabilities, library
from .agreement import agree, quiet_barrier
from .abort import abort_on_exception
from .chunking import CHUNK_ENV, PIECE_ENV
from .consistency import check_consistent, gather_digests, tensor_signature
from .collectives import (all_gather, all_gather_v, all_reduce, all_reduce_coalesced, broadcast,
                          broadcast_coalesced, gather, reduce, reduce_scatter)
from .cuda import CUDA_AWARE_ENV, device_for_rank, is_cuda_aware, local_rank
from .dtypes import ReduceOp
from .flat_buffer import FlatBuffer, group_by_dtype_device
from .group import ProcessGroup, is_member, resolve
from .lifetime import Closeable
from .node_layout import NodeLayout
from .work import Work, in_background

__all__ = [
    "CHUNK_ENV", "CUDA_AWARE_ENV", "Closeable", "FlatBuffer", "NodeLayout", "PIECE_ENV",
    "ProcessGroup", "ReduceOp", "Work", "abort_on_exception", "agree", "all_gather",
    "all_gather_v", "all_reduce", "all_reduce_coalesced", "broadcast", "broadcast_coalesced",
    "capabilities", "check_consistent", "device_for_rank", "gather", "gather_digests",
    "group_by_dtype_device", "in_background", "is_cuda_aware", "is_member", "library", "local_rank",
    "quiet_barrier", "reduce", "reduce_scatter", "resolve", "tensor_signature",
]
