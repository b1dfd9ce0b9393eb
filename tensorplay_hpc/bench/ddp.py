"""DistributedDataParallel on the benchmark MLP (16.8M parameters), batch 32: one training step
without the optimizer (zero_grad, forward, backward with the gradient averaging) against
PyTorch's DistributedDataParallel over gloo, and against the limit without overlap (a plain
forward and backward, then one raw mpi4py ``Allreduce`` of all the gradients' bytes in one
numpy array).

Every synchronized backward pass ends with the ranks' agreement that no rank had a parameter
without a gradient (one allreduce of a few bytes, see
:mod:`tensorplay_hpc.distributed.parallel.reducer`): its cost is measured alone, against a raw
``Allreduce`` of as many bytes, and as a share of the step of the benchmark MLP and of a small
MLP (3 layers of width 64, where the per-step overhead weighs most).

The communication hooks (16-bit compression, PowerSGD at rank 1 per matrix and over whole
buckets) are timed on the benchmark MLP against ``allreduce_hook``, with the bytes each step
hands to collectives and PowerSGD's compression ratio."""
from __future__ import annotations

import copy

import numpy as np
import torch

from tensorplay_hpc.bench.gloo import init_gloo
from tensorplay_hpc.bench.models import mlp
from tensorplay_hpc.bench.report import Report
from tensorplay_hpc.bench.timing import compare
from tensorplay_hpc.comm import trace
from tensorplay_hpc.comm.mpi import MPI
from tensorplay_hpc.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from tensorplay_hpc.distributed.parallel import DistributedDataParallel

__all__ = ["BATCH", "run"]

BATCH = 32


def _step(model: torch.nn.Module, x: torch.Tensor):
    def step() -> None:
        model.zero_grad()
        model(x).square().mean().backward()
    return step


def _agreement(report: Report, module: torch.nn.Module, small: torch.nn.Module,
               step_s: float) -> None:
    """The end-of-backward agreement alone, and its share of a step."""
    world = MPI.COMM_WORLD
    ours = DistributedDataParallel(copy.deepcopy(module))
    flags = np.zeros(1 + len(ours.reducer.params), dtype=np.bool_)

    def raw() -> None:
        world.Allreduce(MPI.IN_PLACE, [flags, MPI.C_BOOL], op=MPI.LOR)

    x = torch.randn(BATCH, small[0].in_features,
                    generator=torch.Generator().manual_seed(world.Get_rank()))
    small_ddp = DistributedDataParallel(copy.deepcopy(small))
    small_theirs = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(small))
    with ours, small_ddp:
        agree_s, raw_s, small_s, small_theirs_s = compare(
            [ours.reducer.agree_on_pass, raw, _step(small_ddp, x), _step(small_theirs, x)],
            report.repeat)
    report.add("ddp", "end-of-backward agreement", agree_s, "mpi4py-raw", raw_s,
               nbytes=flags.nbytes, mlp_step_share_pct=round(100 * agree_s / step_s, 3),
               small_step_share_pct=round(100 * agree_s / small_s, 2))
    report.add("ddp", f"fwd+bwd small MLP, batch {BATCH}", small_s, "torch-gloo", small_theirs_s,
               nbytes=4 * sum(p.numel() for p in small.parameters()),
               agreement_share_pct=round(100 * agree_s / small_s, 2))


# Hook cases: (name, hook, PowerSGD hook or None). PowerSGD compresses from the third step.
_HOOKS = [("fp16", default_hooks.fp16_compress_hook, None),
          ("bf16", default_hooks.bf16_compress_hook, None),
          ("powerSGD rank 1", None, powerSGD_hook.powerSGD_hook),
          ("batched powerSGD rank 1", None, powerSGD_hook.batched_powerSGD_hook)]


def _with_hook(module: torch.nn.Module, hook, power_hook):
    ddp = DistributedDataParallel(copy.deepcopy(module))
    state = None
    if power_hook is not None:
        state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=1,
                                            start_powerSGD_iter=2)
        hook = power_hook
    ddp.register_comm_hook(state, hook)
    return ddp, state


def _bytes_per_step(step) -> int:
    """Bytes this rank hands to collectives in one step (after the warm-up steps)."""
    before = trace.bytes_communicated()
    step()
    return trace.bytes_communicated() - before


def _comm_hooks(report: Report, module: torch.nn.Module, x: torch.Tensor) -> None:
    """Each hook's step against ``allreduce_hook``'s, timed together."""
    baseline, _ = _with_hook(module, default_hooks.allreduce_hook, None)
    models = [(name, *_with_hook(module, hook, power)) for name, hook, power in _HOOKS]
    steps = [_step(baseline, x)] + [_step(ddp, x) for _, ddp, _ in models]
    for step in steps:   # past PowerSGD's two iterations of plain averaging
        step()
        step()
    sent, ratios = [], {}
    for (name, _, state), step in zip([("allreduce", baseline, None)] + models, steps):
        _, before, after = state.compression_stats() if state is not None else (0, 0, 0)
        sent.append(_bytes_per_step(step))
        if state is not None:   # elements before / after compression in this step
            _, before_now, after_now = state.compression_stats()
            ratios[name] = round((before_now - before) / (after_now - after), 1)
    times = compare(steps, report.repeat)
    for ddp in [baseline] + [ddp for _, ddp, _ in models]:
        ddp.close()
    for (name, _, state), ours_s, nbytes in zip(models, times[1:], sent[1:]):
        extra = {"baseline_bytes": sent[0]}
        if name in ratios:
            extra["compression_ratio"] = ratios[name]
        report.add("ddp", f"fwd+bwd batch {BATCH}, {name} hook", ours_s, "allreduce-hook",
                   times[0], nbytes=nbytes, **extra)


def run(report: Report) -> None:
    world = MPI.COMM_WORLD
    init_gloo(world)
    module = mlp()
    width = module[0].in_features
    x = torch.randn(BATCH, width, generator=torch.Generator().manual_seed(world.Get_rank()))
    numel = sum(p.numel() for p in module.parameters())
    flat = np.zeros(numel, dtype=np.float32)
    local = _step(copy.deepcopy(module), x)

    def raw() -> None:
        local()
        world.Allreduce(MPI.IN_PLACE, [flat, MPI.FLOAT])

    step_s = {}
    for bucket_view in (False, True):
        theirs = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(module),
                                                           gradient_as_bucket_view=bucket_view)
        with DistributedDataParallel(copy.deepcopy(module),
                                     gradient_as_bucket_view=bucket_view) as ours:
            ours_s, theirs_s, raw_s, local_s = compare(
                [_step(ours, x), _step(theirs, x), raw, local], report.repeat)
        step_s[bucket_view] = ours_s
        case = f"fwd+bwd batch {BATCH}, bucket view {'on' if bucket_view else 'off'}"
        extra = {"local_fwd_bwd_ms": round(local_s * 1e3, 1), "buckets": len(ours.buckets)}
        report.add("ddp", case, ours_s, "torch-gloo", theirs_s, nbytes=4 * numel, **extra)
        report.add("ddp", case, ours_s, "mpi4py-raw", raw_s, nbytes=4 * numel, **extra)
    _agreement(report, module, mlp(layers=3, width=64), step_s[False])
    _comm_hooks(report, module, x)
