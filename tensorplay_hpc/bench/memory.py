"""Memory per rank of data-parallel training with Adam: parameters, gradients, optimizer state and
the library's own buffers, for DDP with a local Adam, PyTorch's ZeroRedundancyOptimizer over
gloo, and ours as ZeRO-1 (bucket view off and on, overlapped with DDP) and ZeRO-2, on the
benchmark MLP and on the training job's transformer; on the MLP also PyTorch's FSDP2 over the
``mpi4py`` backend: ZeRO-3 (``fully_shard`` on all ranks) and, from 4 ranks, hybrid sharding
(HSDP: a replica per node, sharded within it, wherever the ranks sit; on one node, rows of
consecutive ranks). Every DDP, ours and PyTorch's, runs with ``gradient_as_bucket_view=True``,
the setting for saving memory (the gradients live in the buckets rather than beside them).

Bytes are those of the distinct tensor storages (a DTensor's: its local shard's) reachable from the model, the optimizer, DDP and
its hook after a few training steps, each storage counted once, in the first of these kinds it
belongs to: parameters, optimizer state, gradients (``.grad``), buffers (everything else: DDP's
gradient buckets, staging and parameter buffers). PyTorch's DDP keeps its buckets in C++, out of
reach, so its buffers count as 0; the growth of the resident set size, reported beside, covers
them. Each row also gives the step time (forward, backward and step, every case timed side by
side against DDP's), the bytes this rank handed to the library's MPI collectives per step (none
for PyTorch's, whose traffic goes through gloo), and the bytes this rank's node sent on its
network in a step (0 between ranks of one node; across nodes of one rank each, what went over
the wire)."""
from __future__ import annotations

import gc
import os
import types
from typing import Any, Callable, Dict, Iterable, List, Tuple

import torch
from tensorplay_hpc.comm.mpi import MPI
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO
from torch.distributed.tensor import DTensor

from tensorplay_hpc.bench.backend import fully_sharded
from tensorplay_hpc.bench.gloo import backend_group, init_gloo
from tensorplay_hpc.bench.models import mlp
from tensorplay_hpc.bench.network import bytes_sent
from tensorplay_hpc.bench.report import Report
from tensorplay_hpc.bench.timing import compare
from tensorplay_hpc.comm import trace
from tensorplay_hpc.comm.node_layout import NodeLayout
from tensorplay_hpc.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import (
    hook_with_zero2_step, hook_with_zero_step_interleaved)
from tensorplay_hpc.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from tensorplay_hpc.distributed.optim import ZeroRedundancyOptimizer
from tensorplay_hpc.distributed.parallel import DistributedDataParallel
from tensorplay_hpc.train.data import VOCAB_SIZE
from tensorplay_hpc.train.mesh import hybrid_shape
from tensorplay_hpc.train.model import CharTransformer, next_token_loss

__all__ = ["ADAM", "CASES", "KINDS", "SHARDED_CASES", "Setup", "run", "storage_bytes"]

ADAM = {"lr": 1e-3}
KINDS = ("parameters", "optimizer state", "gradients", "buffers")
_SKIPPED = (type, types.ModuleType, MPI.Comm, MPI.Win, str, bytes, int, float)


def _tensors(roots: Iterable[Any]) -> Iterable[torch.Tensor]:
    """The tensors reachable from ``roots`` through containers, objects' attributes, bound
    methods and closures (not through classes, modules or functions' globals)."""
    seen, stack = set(), list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _SKIPPED):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            yield obj
            if obj.grad is not None:
                stack.append(obj.grad)
        elif isinstance(obj, types.FunctionType):
            stack.extend(cell.cell_contents for cell in obj.__closure__ or ()
                         if cell.cell_contents is not None)
        elif isinstance(obj, types.MethodType):
            stack.append(obj.__self__)
        else:
            stack.extend(r for r in gc.get_referents(obj) if not isinstance(r, _SKIPPED))


def _storage(tensor: torch.Tensor) -> Tuple[int, int]:
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def storage_bytes(params: List[torch.Tensor], state: Iterable[torch.Tensor],
                  roots: Iterable[Any]) -> Dict[str, int]:
    """Bytes of distinct storages by kind (see the module): ``params``, the optimizer ``state``
    tensors, the parameters' gradients, and whatever else ``roots`` reach. Local."""
    owner: Dict[int, Tuple[str, int]] = {}
    grads = [p.grad for p in params if p.grad is not None]
    for kind, tensors in zip(KINDS, (params, state, grads, _tensors(roots))):
        for tensor in tensors:
            pointer, nbytes = _storage(tensor)
            if nbytes and pointer not in owner:
                owner[pointer] = (kind, nbytes)
    totals = dict.fromkeys(KINDS, 0)
    for kind, nbytes in owner.values():
        totals[kind] += nbytes
    return totals


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


Setup = Callable[[torch.nn.Module], Tuple[torch.nn.Module, Any, Callable[[], None], List[Any]]]


def _ddp(module):
    model = DistributedDataParallel(module, gradient_as_bucket_view=True)
    optimizer = torch.optim.Adam(model.parameters(), **ADAM)
    return model, optimizer, optimizer.step, [model, optimizer]


def _torch_zero(module):
    model = torch.nn.parallel.DistributedDataParallel(module, gradient_as_bucket_view=True)
    optimizer = TorchZeRO(model.parameters(), torch.optim.Adam, **ADAM)
    return model, optimizer, optimizer.step, [model, optimizer]


def _zero1(bucket_view: bool) -> Setup:
    def setup(module):
        model = DistributedDataParallel(module, gradient_as_bucket_view=True)
        optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam,
                                            parameters_as_bucket_view=bucket_view, **ADAM)
        return model, optimizer, optimizer.step, [model, optimizer]
    return setup


def _overlapped(zero2: bool) -> Setup:
    def setup(module):
        model = DistributedDataParallel(module, gradient_as_bucket_view=True)
        optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam,
                                            overlap_with_ddp=True, **ADAM)
        hook = (hook_with_zero2_step(model, optimizer) if zero2 else
                hook_with_zero_step_interleaved(allreduce_hook, model, optimizer,
                                                shard_buckets=True))
        model.register_comm_hook(None, hook)
        return model, optimizer, lambda: None, [model, optimizer, hook]
    return setup


def _fsdp(module):
    """ZeRO-3: FSDP2 on a 1-D mesh of every rank, over the mpi4py backend."""
    model = fully_sharded(backend_group(), module=module)
    optimizer = torch.optim.Adam(model.parameters(), **ADAM)
    return model, optimizer, optimizer.step, [model, optimizer]


def _hsdp(module):
    """HSDP: FSDP2 on a 2-D mesh (a replica per node, sharded within it; on one node, rows of
    consecutive ranks), over the backend."""
    rows, _ = hybrid_shape(NodeLayout(MPI.COMM_WORLD))
    model = fully_sharded(backend_group(), module=module, rows=rows)
    optimizer = torch.optim.Adam(model.parameters(), **ADAM)
    return model, optimizer, optimizer.step, [model, optimizer]


CASES: Dict[str, Setup] = {
    "ddp + adam": _ddp, "torch zero-1 (gloo)": _torch_zero,
    "zero-1, bucket view off": _zero1(False), "zero-1, bucket view on": _zero1(True),
    "zero-1, overlapped": _overlapped(False), "zero-2": _overlapped(True)}


SHARDED_CASES: Dict[str, Setup] = {"fsdp (zero-3)": _fsdp, "hsdp": _hsdp}
"""Cases of the MLP only; ``hsdp`` from 4 ranks."""


def _models(rank: int) -> Dict[str, Tuple[Callable[[], torch.nn.Module], Callable]]:
    """The benchmark MLP and the training job's transformer (default size), each with the
    loss of one batch."""
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(32, 1024, generator=generator)
    tokens = torch.randint(0, VOCAB_SIZE, (32, 65), generator=generator)

    def transformer() -> torch.nn.Module:
        torch.manual_seed(0)
        return CharTransformer(VOCAB_SIZE, 64, 128, 2, 4)
    return {"mlp": (mlp, lambda model: model(x).square().mean()),
            "transformer": (transformer,
                            lambda model: next_token_loss(model, tokens[:, :-1], tokens[:, 1:]))}


def _measure(make: Callable[[], torch.nn.Module], loss: Callable, setup: Setup) -> Dict:
    """Build a case, train a few steps, and count its storages. Collective."""
    gc.collect()
    resident = _resident()
    module = make()
    model, optimizer, step, roots = setup(module)

    def train_step() -> None:
        optimizer.zero_grad()
        loss(model).backward()
        step()
    for _ in range(4):        # past the overlap's warm-up, with the optimizer state allocated
        train_step()
    sent, wire = trace.bytes_communicated(), bytes_sent()
    train_step()
    wire = bytes_sent() - wire
    state_of = getattr(optimizer, "optim", optimizer).state
    state = [t for s in state_of.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return {"kinds": storage_bytes(list(module.parameters()), state, roots),
            "sent": trace.bytes_communicated() - sent, "wire": wire,
            "growth": _resident() - resident,
            "step": train_step, "owners": (model, optimizer)}


def run(report: Report) -> None:
    world = MPI.COMM_WORLD
    init_gloo(world)
    for name, (make, loss) in _models(world.rank).items():
        chosen = dict(CASES)
        if name == "mlp":
            chosen.update((case, setup) for case, setup in SHARDED_CASES.items()
                          if case != "hsdp" or world.Get_size() >= 4)
        cases = {case: _measure(make, loss, setup) for case, setup in chosen.items()}
        seconds = compare([c["step"] for c in cases.values()], repeat=report.repeat, warmup=1)
        ddp_bytes, ddp_s = sum(cases["ddp + adam"]["kinds"].values()), seconds[0]
        for (case, c), case_s in zip(cases.items(), seconds):
            total = sum(c["kinds"].values())
            report.add("memory", f"{name}: {case}", case_s, "ddp + adam", ddp_s, nbytes=total,
                       fraction_of_ddp=round(total / ddp_bytes, 3),
                       **{kind.replace(" ", "_") + "_bytes": n for kind, n in c["kinds"].items()},
                       rss_growth_bytes=c["growth"],
                       bytes_per_step=None if case.startswith("torch") else c["sent"],
                       network_bytes_per_step=c["wire"])
        for c in cases.values():
            for owner in c["owners"]:
                if hasattr(owner, "close"):
                    owner.close()
