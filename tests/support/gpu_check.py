"""GPU checks of the communication layer, run when a GPU is present:

    mpiexec -n 2 python tests/support/gpu_check.py

Each collective runs on CUDA tensors twice: staged through pinned host memory
(TENSORPLAY_HPC_CUDA_AWARE=0) and, when the MPI library is CUDA-aware, with device pointers
handed to MPI directly. Results are compared with values computed by hand; the script exits
non-zero on the first mismatch, on every rank.
"""
import os
import sys

import torch
from mpi4py import MPI

from tensorplay_hpc import comm


def check(name: str, ok: bool) -> None:
    oks = MPI.COMM_WORLD.allgather(bool(ok))
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(f"{'ok  ' if all(oks) else 'FAIL'} {name}" + ("" if all(oks) else f" ranks {oks}"))
    if not all(oks):
        sys.exit(1)


def run_collectives(mode: str, device: torch.device) -> None:
    group = comm.ProcessGroup()
    rank, size = group.rank, group.size
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        t = torch.full((1 << 20,), rank + 1, dtype=dtype, device=device)
        comm.all_reduce(t, group.comm)
        check(f"{mode} all_reduce {dtype}", bool((t == size * (size + 1) // 2).all()))
    t = torch.full((1000,), float(rank), device=device)
    comm.all_reduce(t, group.comm, comm.ReduceOp.AVG)
    check(f"{mode} all_reduce avg", torch.allclose(t, torch.full_like(t, (size - 1) / 2)))
    t = torch.full((777,), float(rank), device=device)[::3]
    comm.broadcast(t, group.comm, size - 1)
    check(f"{mode} broadcast strided", bool((t == size - 1).all()))
    out = torch.zeros(size * 5, device=device)
    work = comm.all_gather_v(out, [5] * size, group.comm,
                             input=torch.full((5,), float(rank), device=device), async_op=True)
    work.wait()
    expected = torch.arange(size, device=device).repeat_interleave(5).float()
    check(f"{mode} all_gather_v nonblocking", torch.equal(out, expected))
    out = torch.zeros(2, device=device)
    comm.reduce_scatter(out, torch.ones(2 * size, device=device), group.comm)
    check(f"{mode} reduce_scatter", bool((out == size).all()))
    group.close()


def main() -> None:
    if not torch.cuda.is_available():
        print("no GPU: nothing to check")
        return
    device = comm.device_for_rank()
    torch.cuda.set_device(device)
    check("device from node-local rank",
          device.index == comm.local_rank() % torch.cuda.device_count())
    os.environ[comm.CUDA_AWARE_ENV] = "0"
    run_collectives("staged", device)
    del os.environ[comm.CUDA_AWARE_ENV]
    if comm.is_cuda_aware():
        run_collectives("cuda-aware", device)
    elif MPI.COMM_WORLD.Get_rank() == 0:
        print("MPI is not CUDA-aware here: the direct path was not run")


if __name__ == "__main__":
    main()
