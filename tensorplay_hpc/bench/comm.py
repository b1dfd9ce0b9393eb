"""Communication layer: allreduce, allgather and broadcast bus bandwidth against a raw mpi4py
call on one numpy array of the same bytes (the limit) and torch.distributed over gloo; many
small tensors through one flat buffer against one call per tensor; and several nonblocking
allreduces in flight at once, as DDP's buckets, against the same blocking calls."""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from tensorplay_hpc import comm
from tensorplay_hpc.bench.gloo import init_gloo
from tensorplay_hpc.bench.report import Report
from tensorplay_hpc.bench.timing import compare
from tensorplay_hpc.comm.mpi import MPI

__all__ = ["IN_FLIGHT", "SIZES", "SMALL_TENSORS", "bus_factor", "run"]

SIZES = (2**20, 2**24, 2**27)   # 1 MiB, 16 MiB, 128 MiB
SMALL_TENSORS = 1000
IN_FLIGHT = 5   # nonblocking allreduces of 1 MiB started before the first is waited for


def bus_factor(case: str, ranks: int) -> float:
    """nccl-tests' bus bandwidth factors."""
    if case == "allreduce":
        return 2 * (ranks - 1) / ranks
    if case == "allgather":
        return (ranks - 1) / ranks
    return 1.0


def _cases(group: comm.ProcessGroup, raw: MPI.Intracomm, nbytes: int):
    """For each collective: (name, ours, raw mpi4py, gloo), each a no-argument callable; ours and
    raw mpi4py each call their own communicator, both looked up beforehand."""
    size, ours = group.size, group.comm
    n = nbytes // 4
    part = n // size
    t = torch.ones(n)
    a = np.ones(n, dtype=np.float32)
    out, mine = torch.empty(part * size), torch.ones(part)
    a_out, a_mine = np.empty(part * size, dtype=np.float32), np.ones(part, dtype=np.float32)
    g_outs = [torch.empty(part) for _ in range(size)]
    return [
        ("allreduce",
         lambda: comm.all_reduce(t, ours),
         lambda: raw.Allreduce(MPI.IN_PLACE, a),
         lambda: dist.all_reduce(t)),
        ("allgather",
         lambda: comm.all_gather(out, mine, ours),
         lambda: raw.Allgather(a_mine, a_out),
         lambda: dist.all_gather(g_outs, mine)),
        ("broadcast",
         lambda: comm.broadcast(t, ours, 0),
         lambda: raw.Bcast(a, 0),
         lambda: dist.broadcast(t, 0)),
    ]


def run(report: Report) -> None:
    init_gloo()
    group = comm.ProcessGroup()
    raw = MPI.COMM_WORLD.Dup()
    ranks = group.size
    for nbytes in SIZES:
        for case, ours, limit, gloo in _cases(group, raw, nbytes):
            ours_s, raw_s, gloo_s = compare([ours, limit, gloo], report.repeat)
            busbw = bus_factor(case, ranks) * nbytes / ours_s / 1e9
            report.add("comm", case, ours_s, "mpi4py-raw", raw_s, nbytes=nbytes,
                       busbw_GBps=round(busbw, 3))
            report.add("comm", case, ours_s, "torch-gloo", gloo_s, nbytes=nbytes,
                       busbw_GBps=round(busbw, 3))

    small = [torch.ones(100 + i % 7) for i in range(SMALL_TENSORS)]
    nbytes = sum(t.numel() * 4 for t in small)
    c = group.comm
    flat_s, each_s = compare([lambda: comm.all_reduce_coalesced(small, c),
                              lambda: [comm.all_reduce(t, c) for t in small]],
                             report.repeat)
    report.add("comm", f"allreduce {SMALL_TENSORS} small tensors", flat_s, "one call per tensor",
               each_s, nbytes=nbytes)

    buckets = [torch.ones(2**18) for _ in range(IN_FLIGHT)]
    in_flight_s, blocking_s = compare(
        [lambda: [w.wait() for w in [comm.all_reduce(b, c, async_op=True) for b in buckets]],
         lambda: [comm.all_reduce(b, c) for b in buckets]], report.repeat)
    report.add("comm", f"allreduce {IN_FLIGHT} x 1 MiB nonblocking, in flight at once",
               in_flight_s, "blocking, one after another", blocking_s, nbytes=IN_FLIGHT * 2**20)
    raw.Free()
    group.close()
