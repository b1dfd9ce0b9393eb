"""The communication layer: the only code that turns tensors into MPI buffers.

- :mod:`.group` resolves process groups and holds the library's private communicator;
- :mod:`.dtypes` maps torch dtypes and reductions to MPI;
- :mod:`.staging` hands tensor memory to MPI (zero-copy, or staged and copied back);
- :mod:`.chunking` splits messages longer than MPI's count limit;
- :mod:`.flat_buffer` packs many tensors into one buffer;
- :mod:`.collectives` and :mod:`.work` are the collectives, blocking or not;
- :mod:`.agreement` turns a failure on one rank into the same error on all;
- :mod:`.cuda` decides how GPU memory reaches MPI and which GPU a rank uses.
"""
from .agreement import agree
from .chunking import CHUNK_ENV, chunk_elements, chunks
from .collectives import (all_gather, all_gather_v, all_reduce, all_reduce_coalesced, broadcast,
                          broadcast_coalesced, gather, reduce_scatter)
from .cuda import CUDA_AWARE_ENV, device_for_rank, is_cuda_aware, local_rank
from .dtypes import ReduceOp
from .flat_buffer import FlatBuffer, group_by_dtype_device, pack_by_dtype_device
from .group import ProcessGroup, is_member, resolve
from .staging import Staged, memory
from .work import Work

__all__ = [
    "CHUNK_ENV", "CUDA_AWARE_ENV", "FlatBuffer", "ProcessGroup", "ReduceOp", "Staged", "Work",
    "agree", "all_gather", "all_gather_v", "all_reduce", "all_reduce_coalesced", "broadcast",
    "broadcast_coalesced", "chunk_elements", "chunks", "device_for_rank", "gather",
    "group_by_dtype_device", "is_cuda_aware", "is_member", "local_rank", "memory",
    "pack_by_dtype_device", "reduce_scatter", "resolve",
]
