"""The cost model of the library's operations, on paper and checked against measurement.

Every cost is an alpha-beta-gamma sum: ``alpha`` seconds per message, ``beta`` seconds per byte
sent, ``gamma`` seconds per byte reduced by MPI and ``update`` seconds per byte of a local
torch pass (division, SGD update, copy), with alpha and beta between nodes or within one,
whichever the ranks of the operation cross. ``p`` is the number of ranks and
``n`` the bytes of the operation.

``python -m tensorplay_hpc.bench cost-model`` (under mpiexec) measures alpha, beta and gamma at
the launch's size (every pair of ranks exchanges at once, so they are the effective figures
with all ranks busy), then times the library's operations on a 4 MiB model and prints predicted
against measured. With ``--project`` it also evaluates the model from 64 to 10,000 ranks on
:data:`THIS_VM` and :data:`SLINGSHOT`, says where each operation stops scaling and what to
choose there.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from tensorplay_hpc import checkpoint, comm
from tensorplay_hpc.bench.checkpoint_scaling import raw_io
from tensorplay_hpc.bench.models import mlp
from tensorplay_hpc.bench.report import Report
from tensorplay_hpc.bench.timing import compare
from tensorplay_hpc.comm.mpi import MPI
from tensorplay_hpc.distributed import autograd, rma
from tensorplay_hpc.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_fut
from tensorplay_hpc.distributed.algorithms.ddp_comm_hooks.hierarchical_hook import (
    HierarchicalState, hierarchical_all_reduce)
from tensorplay_hpc.distributed.algorithms.model_averaging.utils import average_parameters
from tensorplay_hpc.distributed.optim import DistributedOptimizer, ZeroRedundancyOptimizer

__all__ = [
    "Allreduce", "LOAD_COLLECTIVES", "METADATA_BYTES_PER_TENSOR", "Link", "Machine",
    "PROJECTED_RANKS", "SAVE_COLLECTIVES", "SLINGSHOT", "THIS_VM", "Workload", "advice",
    "allgather", "allreduce",
    "averaging", "broadcast", "checkpoint_interval", "checkpoint_load", "checkpoint_save",
    "ddp_step", "distributed_optimizer_step", "halving_doubling_allreduce",
    "hierarchical_allreduce", "latency_share", "machine_probes", "project",
    "recursive_doubling_allreduce", "reduce_scatter", "ring_allreduce", "run",
    "small_collective", "stops_scaling_at", "zero_step",
]


@dataclass(frozen=True)
class Link:
    """The cost of one message of ``n`` bytes: ``alpha + n * beta`` seconds."""
    alpha: float
    beta: float


@dataclass(frozen=True)
class Machine:
    """A machine as the model sees it.

    Attributes:
        name: what it is.
        alpha_inter, beta_inter: seconds per message and per byte between nodes.
        alpha_intra, beta_intra: the same within a node.
        gamma: seconds per byte reduced by MPI's reduction (``MPI.SUM`` on float32).
        update: seconds per byte of one elementwise pass of torch on one rank (a division, an
            SGD update, a copy).
        ranks_per_node: ranks placed on each node (by consecutive ranks).
        fs_write, fs_read: the file system's bandwidth (bytes/s, all ranks together), the
            write including the ``fsync`` a checkpoint needs.
        fs_latency: seconds to open, ``fsync`` and close a file (all ranks together).
        node_mtbf_s: mean time between failures of one node (seconds).
    """
    name: str
    alpha_inter: float
    beta_inter: float
    alpha_intra: float
    beta_intra: float
    gamma: float
    update: float
    ranks_per_node: int
    fs_write: float
    fs_read: float
    fs_latency: float
    node_mtbf_s: float

    def nodes(self, ranks: int) -> int:
        """The nodes ``ranks`` consecutive ranks occupy."""
        return math.ceil(ranks / self.ranks_per_node)

    def link(self, ranks: int) -> Link:
        """The link a flat collective over ``ranks`` consecutive ranks is bound by: between
        nodes as soon as they span more than one."""
        if ranks <= self.ranks_per_node:
            return Link(self.alpha_intra, self.beta_intra)
        return Link(self.alpha_inter, self.beta_inter)


_YEAR_S = 365.25 * 24 * 3600.0

THIS_VM = Machine(
    name="this VM (2 cores, Open MPI 4.1, TCP between simulated nodes)",
    alpha_inter=540e-6, beta_inter=1 / 0.14e9, alpha_intra=6.5e-6, beta_intra=1 / 1.46e9,
    gamma=1 / 5.8e9, update=1 / 9.9e9, ranks_per_node=2, fs_write=1.07e9, fs_read=1.14e9,
    fs_latency=15e-3, node_mtbf_s=5 * _YEAR_S)
"""Measured by ``bench cost-model``: within a node at 2 ranks on one node, between nodes and
the file system at 2 ranks on 2 simulated nodes of 1 (docs/performance.md, Cost model); the
node MTBF is the same order of magnitude as :data:`SLINGSHOT`'s."""

SLINGSHOT = Machine(
    name="200 Gb/s Slingshot-class cluster, 4 ranks per node",
    alpha_inter=2e-6, beta_inter=1 / 25e9, alpha_intra=0.5e-6, beta_intra=1 / 50e9,
    gamma=1 / 10e9, update=1 / 10e9, ranks_per_node=4, fs_write=1e12, fs_read=1e12,
    fs_latency=10e-3, node_mtbf_s=5 * _YEAR_S)
"""HPE's published Slingshot-11 figures: about 2 us MPI latency and 200 Gb/s (25 GB/s) per
NIC, one NIC per rank; the node's memory, the reduction speed, a 1 TB/s parallel file system
(10 ms to create and sync a file) and a node MTBF of 5 years are orders of magnitude, not
measurements."""


def _log2(p: int) -> int:
    return math.ceil(math.log2(p)) if p > 1 else 0


# Collectives over p ranks on one link.

def ring_allreduce(p: int, n: float, link: Link, gamma: float) -> float:
    """Ring (reduce-scatter then allgather): ``2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n
    gamma``."""
    return 2 * (p - 1) * link.alpha + (p - 1) / p * n * (2 * link.beta + gamma)


def halving_doubling_allreduce(p: int, n: float, link: Link, gamma: float) -> float:
    """Rabenseifner's (recursive-halving reduce-scatter, recursive-doubling allgather):
    ``2 log2(p) alpha + 2(p-1)/p n beta + (p-1)/p n gamma``."""
    return 2 * _log2(p) * link.alpha + (p - 1) / p * n * (2 * link.beta + gamma)


def recursive_doubling_allreduce(p: int, n: float, link: Link, gamma: float) -> float:
    """Recursive doubling, whole vector each step: ``log2(p) (alpha + n beta + n gamma)``."""
    return _log2(p) * (link.alpha + n * (link.beta + gamma))


def allreduce(p: int, n: float, link: Link, gamma: float) -> float:
    """The cheapest of the three allreduce algorithms (Open MPI's tuned component picks
    recursive doubling for small messages and ring or Rabenseifner for large ones, by its own
    fixed rules, so this is a lower bound on its choice)."""
    return min(algorithm(p, n, link, gamma) for algorithm in
               (ring_allreduce, halving_doubling_allreduce, recursive_doubling_allreduce))


def reduce_scatter(p: int, n: float, link: Link, gamma: float) -> float:
    """Recursive halving: ``log2(p) alpha + (p-1)/p n (beta + gamma)``."""
    return _log2(p) * link.alpha + (p - 1) / p * n * (link.beta + gamma)


def allgather(p: int, n: float, link: Link) -> float:
    """Recursive doubling (Bruck's for other sizes) to ``n`` bytes on every rank:
    ``log2(p) alpha + (p-1)/p n beta``."""
    return _log2(p) * link.alpha + (p - 1) / p * n * link.beta


def broadcast(p: int, n: float, link: Link) -> float:
    """The cheaper of a binomial tree, ``log2(p) (alpha + n beta)``, and scatter then
    allgather, ``(log2(p) + p - 1) alpha + 2(p-1)/p n beta``."""
    if p <= 1:
        return 0.0
    return min(_log2(p) * (link.alpha + n * link.beta),
               (_log2(p) + p - 1) * link.alpha + 2 * (p - 1) / p * n * link.beta)


def small_collective(p: int, link: Link) -> float:
    """A collective on a few bytes (a flag, a digest): ``log2(p) alpha``."""
    return _log2(p) * link.alpha


# The library's operations on a machine.

Allreduce = Callable[[int, float, Link, float], float]


def ddp_step(machine: Machine, p: int, nbytes: float, bucket_bytes: float,
             algorithm: Allreduce = allreduce) -> float:
    """DDP's gradient averaging (communication only, none of it hidden behind the backward
    pass): every bucket divided (one pass) and allreduced by ``algorithm``."""
    full, rest = divmod(nbytes, bucket_bytes)
    link = machine.link(p)
    return sum(count * (algorithm(p, size, link, machine.gamma) + size * machine.update)
               for count, size in ((full, bucket_bytes), (1 if rest else 0, rest)))


def zero_step(machine: Machine, p: int, nbytes: float, stage: int) -> float:
    """A ZeroRedundancyOptimizer step of a model of ``nbytes``: gradients averaged (stage 1:
    allreduce; stage 2: reduce-scatter, each rank keeps its shard) after a division, the shard
    updated (one pass over ``n/p``: SGD), the parameters allgathered."""
    if stage not in (1, 2):
        raise ValueError(f"ZeRO stage {stage}: the model knows stages 1 and 2")
    link, gamma = machine.link(p), machine.gamma
    averaging_cost = (allreduce(p, nbytes, link, gamma) if stage == 1
                      else reduce_scatter(p, nbytes, link, gamma))
    return (averaging_cost + nbytes * machine.update + nbytes / p * machine.update
            + allgather(p, nbytes, link))


def averaging(machine: Machine, p: int, nbytes: float) -> float:
    """``average_parameters``: the gradient check (an allgather of a 40-byte digest), the
    allreduce, and three passes: parameters smaller than a piece packed in and out, and the
    division by ``p``."""
    link = machine.link(p)
    return (allgather(p, 40 * p, link) + allreduce(p, nbytes, link, machine.gamma)
            + 3 * nbytes * machine.update)


def hierarchical_allreduce(machine: Machine, p: int, nbytes: float) -> float:
    """The hierarchical hook on one bucket, ``k`` ranks per node: reduce-scatter within the
    node, allreduce of ``n/k`` among the ranks at the same node rank of every node, allgather
    within the node, and the division."""
    k = min(machine.ranks_per_node, p)
    nodes = math.ceil(p / k)
    intra = Link(machine.alpha_intra, machine.beta_intra)
    inter = Link(machine.alpha_inter, machine.beta_inter)
    return (reduce_scatter(k, nbytes, intra, machine.gamma)
            + allreduce(nodes, nbytes / k, inter, machine.gamma)
            + allgather(k, nbytes, intra) + nbytes * machine.update)


_LOCKS = 3   # a step locks the values, state and gradients windows of its owner


def distributed_optimizer_step(machine: Machine, transport: str, nbytes: float, tensors: int,
                               state_entries: int = 0, trainers: int = 1) -> float:
    """``trainers`` DistributedOptimizer steps on one owner's ``tensors`` parameters of
    ``nbytes`` in all, each with ``state_entries`` state tensors of its size (SGD 0, Adam 2).

    The owner's exclusive lock serializes the trainers. One step, counted from
    ``distributed_optimizer.py`` and ``rma/``:

    - ``shared`` (one node): 3 locks and 3 unlocks (``alpha_intra`` each); the optimizer runs in
      the owner's memory: ``(1 + s)`` passes over ``n``;
    - ``mpi`` windows: 3 lock and 3 unlock round trips, one more for the pipelined gets, and
      ``(3 + 2s) n`` bytes (gradient, value and state fetched; value and state put back);
    - ``served``: every get waits for its answer: ``6 + t(3 + s)`` round trips (3 locks, per
      tensor a gradient, a value, a flag and s states; 3 unlocks; the flushes after gets cost
      nothing), ``t(2 + s)`` one-way puts and the same bytes.
    """
    compute = (1 + state_entries) * nbytes * machine.update
    if transport == "shared":
        return trainers * (2 * _LOCKS * machine.alpha_intra + compute)
    if transport == "mpi":
        round_trips, one_way = 2 * _LOCKS + 1, 0
    elif transport == "served":
        round_trips = 2 * _LOCKS + tensors * (3 + state_entries)
        one_way = tensors * (2 + state_entries)
    else:
        raise ValueError(f"transport {transport!r}: the model knows shared, mpi and served")
    moved = (3 + 2 * state_entries) * nbytes
    return trainers * ((2 * round_trips + one_way) * machine.alpha_inter
                       + moved * machine.beta_inter + compute)


METADATA_BYTES_PER_TENSOR = 36
"""Catalog bytes per tensor, gathered to rank 0 on save (measured: linear in tensors)."""
SAVE_COLLECTIVES = 21
"""Small collectives of one ``checkpoint.save`` (counted with the trace at 2 ranks)."""
LOAD_COLLECTIVES = 14
"""Small collectives of one ``checkpoint.load``, the broadcasts of data apart."""


def checkpoint_save(machine: Machine, p: int, file_bytes: float, tensors: int) -> float:
    """``checkpoint.save``: the file created, written and ``fsync``-ed at the file system's
    latency and bandwidth, the catalog (36 B per tensor) gathered to rank 0, and the small
    collectives."""
    link = machine.link(p)
    metadata = METADATA_BYTES_PER_TENSOR * tensors
    return (machine.fs_latency + file_bytes / machine.fs_write
            + SAVE_COLLECTIVES * small_collective(p, link)
            + (p - 1) / p * metadata * link.beta + small_collective(p, link))


def checkpoint_load(machine: Machine, p: int, file_bytes: float, tensors: int,
                    replicated_bytes: float) -> float:
    """``checkpoint.load``: every byte read once, the replicated entries (model) broadcast
    from their readers, the catalog broadcast, and the small collectives."""
    link = machine.link(p)
    return (machine.fs_latency + file_bytes / machine.fs_read
            + LOAD_COLLECTIVES * small_collective(p, link)
            + broadcast(p, replicated_bytes, link)
            + broadcast(p, METADATA_BYTES_PER_TENSOR * tensors, link))


def checkpoint_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Young/Daly's first-order optimal interval between checkpoints:
    ``sqrt(2 * checkpoint_s * mtbf_s)``."""
    return math.sqrt(2 * checkpoint_s * mtbf_s)


# Projection.

@dataclass(frozen=True)
class Workload:
    """What the projection evaluates: a model of ``model_bytes`` (float32) trained data
    parallel, its Adam checkpoint, and DistributedOptimizer steps on one owner."""
    model_bytes: float = 4 * 250e6          # 250M parameters
    tensors: int = 400
    bucket_bytes: float = 25 * 2**20        # DDP's default
    distopt_bytes: float = 4 * 2**20        # one owner's parameters (4 MiB, SGD)
    distopt_tensors: int = 4

    @property
    def checkpoint_bytes(self) -> float:
        """Parameters and Adam's two moments."""
        return 3 * self.model_bytes


def _operations(w: Workload) -> Dict[str, Callable[[Machine, int], float]]:
    return {
        "ddp step": lambda m, p: ddp_step(m, p, w.model_bytes, w.bucket_bytes),
        "ddp step, ring allreduce only": lambda m, p: ddp_step(
            m, p, w.model_bytes, w.bucket_bytes, ring_allreduce),
        "zero-1 step": lambda m, p: zero_step(m, p, w.model_bytes, 1),
        "zero-2 step": lambda m, p: zero_step(m, p, w.model_bytes, 2),
        "averaging": lambda m, p: averaging(m, p, w.model_bytes),
        "hierarchical hook": lambda m, p: sum(
            hierarchical_allreduce(m, p, size) for size in _buckets(w)),
        "distopt, every rank steps one owner": lambda m, p: distributed_optimizer_step(
            m, "mpi", w.distopt_bytes, w.distopt_tensors, trainers=p - 1),
        "checkpoint save": lambda m, p: checkpoint_save(
            m, p, w.checkpoint_bytes, w.tensors * 3),
        "checkpoint load": lambda m, p: checkpoint_load(
            m, p, w.checkpoint_bytes, w.tensors * 3, w.model_bytes),
    }


def _buckets(w: Workload) -> List[float]:
    full, rest = divmod(w.model_bytes, w.bucket_bytes)
    return [w.bucket_bytes] * int(full) + ([rest] if rest else [])


def latency_share(cost: Callable[[Machine, int], float], machine: Machine, p: int) -> float:
    """The part of ``cost`` that is alpha terms (messages), 0 to 1."""
    total = cost(machine, p)
    alphas = cost(dataclasses.replace(machine, beta_inter=0.0, beta_intra=0.0, gamma=0.0,
                                      update=0.0, fs_write=math.inf, fs_read=math.inf,
                                      fs_latency=0.0), p)
    return alphas / total if total > 0 else 0.0


def stops_scaling_at(cost: Callable[[Machine, int], float], machine: Machine,
                     limit: int = 16384) -> Optional[int]:
    """The first rank count, doubling from two nodes, at which ``cost`` is more than twice its
    value on two nodes or messages (alpha terms) make up more than half of it; ``None`` if
    neither happens up to ``limit``."""
    p = 2 * machine.ranks_per_node
    two_nodes = cost(machine, p)
    while p <= limit:
        if cost(machine, p) > 2 * two_nodes or latency_share(cost, machine, p) > 0.5:
            return p
        p *= 2
    return None


PROJECTED_RANKS = (64, 256, 1024, 4096, 10000)


def advice(machine: Machine, p: int, w: Workload) -> Dict[str, str]:
    """What to choose at ``p`` ranks on ``machine``, one line per decision."""
    bucket = 2**16
    while (bucket < 2**31 and latency_share(
            lambda m, q: allreduce(q, bucket, m.link(q), m.gamma), machine, p) > 0.1):
        bucket *= 2
    flat = ddp_step(machine, p, w.model_bytes, w.bucket_bytes)
    hierarchical = sum(hierarchical_allreduce(machine, p, size) for size in _buckets(w))
    zero1, zero2 = (zero_step(machine, p, w.model_bytes, s) for s in (1, 2))
    save = checkpoint_save(machine, p, w.checkpoint_bytes, w.tensors * 3)
    mtbf = machine.node_mtbf_s / machine.nodes(p)
    return {
        "bucket": f"buckets of at least {bucket / 2**20:g} MiB keep messages under 10% of an "
                  "allreduce",
        "hierarchical": f"hierarchical hook {flat / hierarchical:.2f}x the speed of flat "
                        "allreduce" + (" (use it)" if hierarchical < flat else " (keep flat)"),
        "zero": f"ZeRO-2 step {zero1 / zero2:.2f}x the speed of ZeRO-1 (and 1/p of the "
                "gradients' memory)",
        "checkpoint": f"save {save:.3g} s; system MTBF {mtbf / 3600:.3g} h; checkpoint every "
                      f"{checkpoint_interval(save, mtbf) / 60:.3g} min (Young/Daly)",
    }


def project(machines: Sequence[Machine] = (THIS_VM, SLINGSHOT),
            ranks: Sequence[int] = PROJECTED_RANKS, workload: Workload = Workload(),
            emit: Callable[[str], None] = print) -> List[dict]:
    """The model at ``ranks`` on each machine: a table, where each operation stops scaling,
    and the advice; returns the rows (also emitted as JSON lines). Local."""
    operations = _operations(workload)
    rows = []
    for machine in machines:
        emit(f"\ncost model projection: {machine.name}; model {workload.model_bytes / 1e9:g} GB,"
             f" checkpoint {workload.checkpoint_bytes / 1e9:g} GB")
        emit("  ".join([f"{'operation':36}"] + [f"{p:>9}" for p in ranks]
                       + ["stops scaling at"]))
        for name, cost in operations.items():
            times = [cost(machine, p) for p in ranks]
            where = stops_scaling_at(cost, machine)
            emit("  ".join([f"{name:36}"] + [f"{_seconds(t):>9}" for t in times]
                           + [str(where or "-")]))
            for p, t in zip(ranks, times):
                rows.append({"bench": "cost-model", "case": f"projection: {name}",
                             "machine": machine.name, "ranks": p, "predicted_s": t,
                             "latency_share": round(latency_share(cost, machine, p), 3)})
        for p in ranks:
            emit(f"  at {p} ranks: " + "; ".join(advice(machine, p, workload).values()))
    for row in rows:
        emit(json.dumps(row))
    return rows


def _seconds(t: float) -> str:
    return f"{t * 1e3:.3g} ms" if t < 1 else f"{t:.3g} s"


# Measurement.

def _partner(layout: comm.NodeLayout, across: bool) -> Optional[int]:
    """This rank's exchange partner: the neighbouring node rank on its node, or the same node
    rank on the neighbouring node (``across``); ``None`` if there is none."""
    if across:
        node = layout.node ^ 1
        if node < len(layout.nodes) and layout.node_rank < len(layout.nodes[node]):
            return layout.nodes[node][layout.node_rank]
        return None
    ranks = layout.nodes[layout.node]
    partner = layout.node_rank ^ 1
    return ranks[partner] if partner < len(ranks) else None


def _exchange(pairs: MPI.Intracomm, partner: Optional[int], buffer: np.ndarray
              ) -> Callable[[], None]:
    """Send ``buffer`` to ``partner`` while receiving its own: one step of a collective."""
    received = np.empty_like(buffer)

    def run() -> None:
        if partner is not None:
            pairs.Sendrecv(buffer, partner, recvbuf=received, source=partner)
    return run


_LARGE = 2**20


def _fit(small_s: float, large_s: float) -> Link:
    """Alpha and beta from the exchanges of 8 bytes and of 1 MiB."""
    return Link(small_s, max(large_s - small_s, 0.0) / _LARGE)


def machine_probes(world: MPI.Intracomm, pairs: MPI.Intracomm, folder: str,
                   file_bytes: int = 16 * _LARGE
                   ) -> Tuple[List[Callable[[], object]], Callable[[List[float]], Machine]]:
    """What measures this machine at ``world``'s size, every rank busy at once: the functions
    to time (collective over ``world``; ``pairs``, a duplicate of it, carries the exchanges),
    and what makes the :class:`Machine` from their median seconds. Alpha and beta: every rank
    exchanges 8 bytes and 1 MiB with a partner on its node (``Sendrecv``, both directions at
    once, as in a step of a collective), then with one on the next node (the slowest pair
    counts); gamma: ``MPI.SUM.Reduce_local`` of 4 MiB of float32; the update: a torch
    ``mul_`` of 4 MiB; the file system: raw MPI-IO of
    ``file_bytes`` and a sixteenth of it written with ``fsync`` (latency the intercept,
    bandwidth the slope) and ``file_bytes`` read back. Collective."""
    layout = comm.NodeLayout(world)
    small, large = np.zeros(1, dtype=np.float64), np.ones(_LARGE // 8, dtype=np.float64)
    probes: List[Callable[[], object]] = []
    links = []
    for across in (False, True):
        partner = _partner(layout, across)
        if world.allreduce(partner is not None, op=MPI.LOR):
            links.append(across)
            probes += [_exchange(pairs, partner, small), _exchange(pairs, partner, large)]
    a, b = np.ones(_LARGE, dtype=np.float32), np.ones(_LARGE, dtype=np.float32)
    t = torch.ones(_LARGE)
    path, big, little = os.path.join(folder, "raw.bin"), file_bytes, file_bytes // 16
    probes += [lambda: MPI.SUM.Reduce_local(a, b), lambda: t.mul_(1.0),
               raw_io(path, little, world, write=True),
               raw_io(path, big, world, write=True), raw_io(path, big, world, write=False)]

    def build(seconds: List[float]) -> Machine:
        fitted = {across: _fit(*seconds[2 * i:2 * i + 2]) for i, across in enumerate(links)}
        reduce_s, update_s, small_s, large_s, read_s = seconds[2 * len(links):]
        intra = fitted.get(False) or fitted.get(True) or Link(0.0, 0.0)
        inter = fitted.get(True) or intra
        slope = (large_s - small_s) / (big - little)   # not resolved: latency-bound
        return Machine(
            name=f"measured at {world.Get_size()} ranks on {len(layout.nodes)} node(s)",
            alpha_inter=inter.alpha, beta_inter=inter.beta, alpha_intra=intra.alpha,
            beta_intra=intra.beta, gamma=reduce_s / a.nbytes, update=update_s / a.nbytes,
            ranks_per_node=max(len(ranks) for ranks in layout.nodes),
            fs_write=1 / slope if slope > 0 else math.inf, fs_read=big / read_s,
            fs_latency=max(small_s - little * max(slope, 0.0), 0.0),
            node_mtbf_s=THIS_VM.node_mtbf_s)
    return probes, build


_BUCKET = 2**20
WIDTH = 256
"""The measured model: 16 x Linear(WIDTH, WIDTH), 4 MiB of float32 parameters."""

Case = Tuple[str, float, Callable[[Machine], float], Callable[[], object]]
"""What one measured operation is: its name, its bytes, its prediction on a machine, itself."""


def _cases(world: MPI.Intracomm, folder: str, stack: ExitStack, width: int) -> List[Case]:
    """The library's operations at ``world``'s size, each with its prediction. Collective."""
    p = world.Get_size()
    model = mlp(layers=16, width=width)
    params = list(model.parameters())
    for param in params:
        param.grad = torch.ones_like(param)
    nbytes = 4 * sum(param.numel() for param in params)
    gradients = torch.ones(nbytes // 4)
    buckets = list(gradients.split(_BUCKET // 4))
    zero = stack.enter_context(ZeroRedundancyOptimizer(
        params, torch.optim.SGD, lr=1e-3, process_group=world, parameters_as_bucket_view=True))
    cases: List[Case] = []
    if p > 1:
        def ddp() -> None:
            for work in [allreduce_fut(world, bucket) for bucket in buckets]:
                work.wait()
        arrays = [bucket.numpy() for bucket in buckets]

        def raw() -> None:
            for array in arrays:
                world.Allreduce(MPI.IN_PLACE, array)
        cases += [(f"ddp step: allreduce_fut on {len(buckets)} buckets of <= 1 MiB", nbytes,
                   lambda m: ddp_step(m, p, nbytes, _BUCKET), ddp),
                  ("reference: raw mpi4py Allreduce of the same buckets", nbytes,
                   lambda m: sum(allreduce(p, a.nbytes, m.link(p), m.gamma) for a in arrays),
                   raw)]

    def zero_1() -> None:
        allreduce_fut(world, gradients).wait()
        zero.step()
    cases += [("zero-1 step (sgd, bucket view): gradient averaging + step", nbytes,
               lambda m: zero_step(m, p, nbytes, 1), zero_1),
              ("average_parameters", nbytes, lambda m: averaging(m, p, nbytes),
               lambda: average_parameters(params, world))]
    layout = comm.NodeLayout(world)
    if p > 1 and layout.node_size is not None and layout.node_size > 1:
        state = stack.enter_context(HierarchicalState(world))
        cases.append((f"hierarchical hook, nodes of {layout.node_size}", nbytes,
                      lambda m: hierarchical_allreduce(m, p, nbytes),
                      lambda: hierarchical_all_reduce(state, gradients).wait()))
    if p > 1:
        cases.append(_distopt_case(world, stack, width))
    path = os.path.join(folder, "model.h5")
    checkpoint.save(path, model, zero, process_group=world)
    file_bytes = world.bcast(os.path.getsize(path) if world.Get_rank() == 0 else 0)
    tensors = len(params)
    cases += [("checkpoint.save", file_bytes,
               lambda m: checkpoint_save(m, p, file_bytes, tensors),
               lambda: checkpoint.save(path, model, zero, process_group=world)),
              ("checkpoint.load", file_bytes,
               lambda m: checkpoint_load(m, p, file_bytes, tensors, nbytes),
               lambda: checkpoint.load(path, model, zero, process_group=world))]
    return cases


def _distopt_case(world: MPI.Intracomm, stack: ExitStack, width: int) -> Case:
    """Rank 0 steps SGD on 4 parameters of ``width`` x ``width`` owned by the last rank (the
    other ranks wait in the timing's collectives)."""
    rank, owner = world.Get_rank(), world.Get_size() - 1
    owned = ([torch.ones(width, width, requires_grad=True) for _ in range(4)]
             if rank == owner else [])
    shared = stack.enter_context(rma.share(owned, process_group=world))
    refs = shared.refs_of(owner)
    optimizer = stack.enter_context(DistributedOptimizer(torch.optim.SGD, refs, lr=1e-3))
    step: Callable[[], object] = lambda: None
    if rank == 0:
        context_id = stack.enter_context(autograd.context())
        autograd.backward(context_id, [sum(ref.to_here().sum() for ref in refs)])
        step = lambda: optimizer.step(context_id)
    nbytes = 4 * sum(ref.shape.numel() for ref in refs)
    transport = shared.transport
    return (f"DistributedOptimizer step (sgd), {transport} transport", nbytes,
            lambda m: distributed_optimizer_step(m, transport, nbytes, len(refs)), step)


def _rate(seconds_per_byte: float) -> Optional[float]:
    """GB/s, ``None`` where unbounded (nothing measured, or the time did not grow with bytes)."""
    return round(1e-9 / seconds_per_byte, 3) if 0 < seconds_per_byte < math.inf else None


def _parameters_row(machine: Machine, ranks: int) -> dict:
    return {"bench": "cost-model", "case": "parameters", "ranks": ranks,
            "ranks_per_node": machine.ranks_per_node,
            "alpha_intra_us": round(machine.alpha_intra * 1e6, 3),
            "beta_intra_GBps": _rate(machine.beta_intra),
            "alpha_inter_us": round(machine.alpha_inter * 1e6, 3),
            "beta_inter_GBps": _rate(machine.beta_inter),
            "gamma_GBps": _rate(machine.gamma), "update_GBps": _rate(machine.update),
            "fs_write_GBps": _rate(1 / machine.fs_write),
            "fs_read_GBps": _rate(1 / machine.fs_read),
            "fs_latency_ms": round(machine.fs_latency * 1e3, 3)}


def run(report: Report, project_too: bool = False, width: int = WIDTH,
        file_bytes: int = 16 * _LARGE) -> None:
    """Measure the machine and the library's operations in the same interleaved rounds, then
    print predicted against measured; with ``project_too`` also the projection to 10,000 ranks.
    Collective over ``MPI.COMM_WORLD``."""
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    folder = world.bcast(tempfile.mkdtemp(prefix="tensorplay-cost-") if rank == 0 else None)
    try:
        with ExitStack() as stack:
            pairs = world.Dup()
            stack.callback(pairs.Free)
            probes, build = machine_probes(world, pairs, folder, file_bytes)
            cases = _cases(world, folder, stack, width)
            seconds = compare(probes + [case[3] for case in cases], report.repeat, warmup=1)
            machine = build(seconds[:len(probes)])
            if rank == 0:
                print(json.dumps(_parameters_row(machine, world.Get_size())), flush=True)
            for (case, nbytes, predict, _), measured_s in zip(cases, seconds[len(probes):]):
                predicted_s = predict(machine)
                report.add("cost-model", case, measured_s, "model", predicted_s, nbytes=nbytes,
                           predicted_s=predicted_s, measured_s=measured_s,
                           error=measured_s / predicted_s - 1)
    finally:
        world.Barrier()
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
    if project_too and rank == 0:
        project()
