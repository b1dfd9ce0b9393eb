"""The trace of collectives and one-sided operations: the ring of recent operations, the Chrome
trace files of a traced training run and its timeline, and the watchdog's report of what each
rank was doing."""
import json
import os
import re
import threading
from pathlib import Path

import pytest
import torch
from mpi4py import MPI

from launch import SUPPORT, mpiexec, only_in_single_rank_run
from tensorplay_hpc import comm
from tensorplay_hpc.comm import capabilities, trace, worker
from tensorplay_hpc.comm.capabilities import TRANSPORT_ENV
from tensorplay_hpc.distributed import rma
from tensorplay_hpc.train.config import TrainConfig
from tensorplay_hpc.train.loop import train
from tensorplay_hpc.train.timeline import TIMELINE_FILE

WORLD = MPI.COMM_WORLD
JOB = str(SUPPORT / "fault_job.py")


@pytest.fixture
def traced(folder):
    """Tracing on, into a folder every rank sees; off again afterwards."""
    directory = Path(folder) / "trace"
    trace.enable(directory)
    yield directory
    trace.disable()


def _timed(events):
    return [e for e in events if e["ph"] != "M"]


def test_ring_and_trace_hold_a_known_sequence(world, traced, setting):
    """The ring and the trace, with nonblocking collectives as MPI requests."""
    setting(worker.NONBLOCKING_ENV, "requests")
    group = comm.ProcessGroup()
    size = group.size
    name = f"MPI_COMM_WORLD (private duplicate) of {size} ranks"
    before = trace.bytes_communicated()
    with trace.caller("outer"), trace.caller("known"):
        comm.all_reduce(torch.ones(4), group.comm)                          # 16 bytes
        comm.broadcast(torch.ones(3, dtype=torch.float64), group.comm)      # 24 bytes
        work = comm.all_gather(torch.empty(2 * size, dtype=torch.int16),
                               torch.ones(2, dtype=torch.int16), group.comm, async_op=True)
        assert trace.recent()[-1].end is None      # in flight until waited for
        work.wait()
        with trace.span("local work"):
            pass
    last = trace.recent()[-4:]
    assert [(op.name, op.kind, op.nbytes, op.comm, op.caller, op.asynchronous) for op in last] == [
        ("all_reduce", "collective", 16, name, "outer / known", False),
        ("broadcast", "collective", 24, name, "outer / known", False),
        ("all_gather", "collective", 4 * size, name, "outer / known", True),
        ("local work", "compute", 0, "", "outer / known", False)]
    assert all(op.end >= op.start for op in last)
    assert all(a.start <= b.start for a, b in zip(last, last[1:]))
    assert "all_reduce 16 B on " + name + " for outer / known [MainThread]: took" in \
        trace.describe_recent()
    for _ in range(trace.RECENT + 3):
        comm.all_reduce(torch.ones(1), group.comm)
    assert len(trace.recent()) == trace.RECENT
    assert [op.nbytes for op in trace.recent()] == [4] * trace.RECENT
    for name, numel in (("helper", 5), ("second helper", 2)):   # the second starts after the
        helper = threading.Thread(target=comm.broadcast,            # first has ended
                                  args=(torch.ones(numel), group.comm), name=name)
        helper.start()
        helper.join()
        assert trace.recent()[-1].thread == name
    assert trace.bytes_communicated() - before == (16 + 24 + 4 * size + 4 * (trace.RECENT + 3)
                                                   + 20 + 8)

    merged = trace.write(world)
    group.close()
    mine = json.loads((traced / f"trace-rank{world.rank}.json").read_text())["traceEvents"]
    events = [(e["name"], e["ph"], e["args"].get("bytes")) for e in _timed(mine)]
    assert events[:6] == [("Dup", "X", 0), ("all_reduce", "X", 16), ("broadcast", "X", 24),
                          ("all_gather", "b", 4 * size), ("all_gather", "e", None),
                          ("local work", "X", 0)]
    assert events[6:] == ([("all_reduce", "X", 4)] * (trace.RECENT + 3)
                          + [("broadcast", "X", 20), ("broadcast", "X", 8)])
    if world.rank == 0:
        every = _timed(json.loads(merged.read_text())["traceEvents"])
        assert sorted({e["pid"] for e in every}) == list(range(world.size))
        assert len(every) == world.size * len(events)
    else:
        assert merged is None


def test_a_queued_collective_is_traced_on_its_worker(world, traced, setting):
    """Started nonblocking, a collective runs blocking on its communicator's worker thread and
    is recorded there, for the caller that started it; a blocking one started next follows it."""
    setting(worker.NONBLOCKING_ENV, "thread")
    if not worker.in_thread():
        pytest.skip("below MPI_THREAD_MULTIPLE: no workers")
    group = comm.ProcessGroup()
    size = group.size
    with trace.caller("queued"):
        work = comm.all_gather(torch.empty(2 * size, dtype=torch.int16),
                               torch.ones(2, dtype=torch.int16), group.comm, async_op=True)
        comm.broadcast(torch.ones(3), group.comm)
    work.wait()
    gather, broadcast = trace.recent()[-2:]
    assert (gather.name, gather.nbytes, gather.caller, gather.asynchronous) == (
        "all_gather", 4 * size, "queued", False)
    assert gather.thread.startswith("mpi-worker-") and gather.end <= broadcast.start
    assert (broadcast.name, broadcast.thread, broadcast.asynchronous) == (
        "broadcast", "MainThread", False)
    group.close()


def test_without_watchdog_or_trace_operations_are_counted_not_recorded(world, monkeypatch):
    monkeypatch.setattr(trace, "_recording", False)   # as in a process that never watched
    monkeypatch.setattr(trace, "_ring_kept", False)
    group = comm.ProcessGroup()
    before, ring = trace.bytes_communicated(), trace.recent()
    comm.all_reduce(torch.ones(4), group.comm)
    comm.all_gather(torch.empty(3 * group.size), torch.ones(3), group.comm, async_op=True).wait()
    with trace.span("local work"):
        pass
    assert trace.recent() == ring
    assert trace.bytes_communicated() - before == 16 + 12 * group.size
    group.close()
    trace.keep_recent()     # what the watchdog does when it starts watching
    comm.broadcast(torch.ones(2), world)
    assert [(op.name, op.nbytes) for op in trace.recent()[-1:]] == [("broadcast", 8)]


@pytest.mark.mpi(min_size=2)
def test_write_refuses_a_trace_on_some_ranks_only(world, folder):
    if world.rank == 0:
        trace.enable(folder)
    try:
        with pytest.raises(RuntimeError, match=rf"tracing is on for ranks \[0\] only, of "
                                               rf"{world.size} \(rank {world.rank}\)"):
            trace.write(world)
    finally:
        trace.disable()
    assert trace.write(world) is None


@pytest.mark.parametrize("transport", ["shared", "mpi", "served"])
def test_one_sided_operations_are_recorded_with_their_epoch(world, monkeypatch, traced,
                                                             transport):
    if transport == "served" and world.size == 1:
        pytest.skip("a served window reads its own rank's memory without a message")
    if transport == "shared" and not capabilities.within_one_node(world):
        pytest.skip("shared windows need every rank on one node")
    if transport == "mpi" and not capabilities.one_sided_works(world):
        pytest.skip("MPI's one-sided windows do not reach every rank of this launch")
    monkeypatch.setenv(TRANSPORT_ENV, transport)
    owner = (world.rank + 1) % world.size
    with rma.share([torch.full((5,), float(world.rank))]) as shared:
        assert shared.transport == transport
        with trace.caller("fetch test"):
            value = shared.fetch(shared.refs_of(owner)[0])
        last = trace.recent()[-2:]
        world.Barrier()   # no rank frees the windows while another still reads
    assert value.tolist() == [float(owner)] * 5
    name = f"MPI_COMM_WORLD (private duplicate) of {world.size} ranks"
    assert [(op.name, op.kind, op.nbytes, op.comm, op.caller) for op in last] == [
        (f"shared epoch on rank {owner}", "rma", 0, name, "fetch test"),
        (f"get from rank {owner}", "rma", 20, name, "fetch test")]
    epoch, get = last
    assert epoch.start <= get.start <= get.end <= epoch.end


@pytest.mark.timeout(120)
@pytest.mark.parametrize("optimizer, callers", [
    ("zero", {"DDP bucket 0", "DDP end of backward", "ZeRO parameter sync",
              "loss and stop agreement", "validation", "DDP initial broadcast"}),
    ("postlocal", {"DDP bucket 0", "model averaging", "loss and stop agreement"})])
def test_traced_training_run_writes_trace_files_and_timeline(world, folder, optimizer, callers):
    run_dir = Path(folder) / "run"
    config = TrainConfig(layers=1, width=32, heads=2, context=16, batch_size=8, eval_every=0,
                         eval_batches=1, progress=False, threads=1, steps=20, warmup_steps=2,
                         average_period=2, checkpoint_every=0, optimizer=optimizer,
                         run_dir=run_dir, trace=run_dir / "trace")
    try:
        assert train(config, world).steps == 20
    finally:
        trace.disable()
    world.Barrier()
    mine = json.loads((run_dir / "trace" / f"trace-rank{world.rank}.json").read_text())
    timed = _timed(mine["traceEvents"])
    assert all(e["pid"] == world.rank for e in timed)
    assert [e["ts"] for e in timed] == sorted(e["ts"] for e in timed)
    assert callers <= {e["args"]["caller"] for e in timed if e["ph"] in "Xb"}
    steps = [e["name"] for e in timed if e["name"].startswith("step ")]
    assert steps == [f"step {n}" for n in range(1, 21)]
    for name in ("forward", "backward", "optimizer step"):
        assert sum(e["name"] == name for e in timed) == 20
    assert sum(e["name"] == "checkpoint save" and e["cat"] == "io" for e in timed) == 1
    if world.rank == 0:
        merged = _timed(json.loads((run_dir / "trace" / "trace.json").read_text())["traceEvents"])
        assert sorted({e["pid"] for e in merged}) == list(range(world.size))
        for rank in range(world.size):
            of_rank = [e["ts"] for e in merged if e["pid"] == rank]
            assert of_rank == sorted(of_rank) and len(of_rank) > 20 * 5
        png = (run_dir / "trace" / TIMELINE_FILE).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


@only_in_single_rank_run
@pytest.mark.timeout(120)
def test_watchdog_report_lists_every_ranks_last_operations():
    run = mpiexec(2, [JOB, "stall"], timeout=100,
                  env=dict(os.environ, TENSORPLAY_HPC_COLLECTIVE_TIMEOUT="2"))
    assert run.returncode != 0, run.stdout + run.stderr
    report = run.stderr
    comm_name = r"MPI_COMM_WORLD \(private duplicate\) of 2 ranks"
    assert re.search(r"\[rank 0\] collective timeout: all_reduce \(collective #2\).*Aborting the "
                     r"job\. This rank's last operations, oldest first:\n(?:\[rank 0\]   .*\n)*"
                     rf"\[rank 0\]   all_reduce 16 B on {comm_name} \[MainThread\]: took [0-9.]+ ms, "
                     r"ended [0-9.]+ s ago\n"
                     rf"\[rank 0\]   all_reduce 16 B on {comm_name} \[MainThread\]: running for "
                     r"[0-9.]+ s\n", report), report
    assert re.search(r"\[rank 1\] asked by rank 0 of communicator .* about a stalled collective; "
                     r"this rank has entered 1 collectives there\. Its last operations, oldest "
                     rf"first:\n(?:\[rank 1\]   .*\n)*\[rank 1\]   all_reduce 16 B on {comm_name} "
                     r"\[MainThread\]: took "
                     r"[0-9.]+ ms, ended [0-9.]+ s ago\n", report), report
