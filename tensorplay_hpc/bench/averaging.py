"""Model averaging of the benchmark MLP (16.8M parameters): ``average_parameters`` and a
``PeriodicModelAverager`` (period 1, so every call averages) against PyTorch's
``PeriodicModelAverager`` over gloo, and against a raw mpi4py ``Allreduce`` of the same bytes in
one numpy array, whole and in the pieces that our collectives use.

Before each averaging the ranks check that they have gradients on the same parameters (one
allgather of a 40-byte digest, see :mod:`tensorplay_hpc.distributed.algorithms.model_averaging.
utils`): its cost is measured alone, against a raw ``Allgather`` of as many bytes, and as a
share of an averaging of the benchmark MLP and of a small MLP (3 layers of width 64, where the
per-step overhead weighs most)."""
from __future__ import annotations

import warnings

import numpy as np
import torch
from tensorplay_hpc.comm.mpi import MPI
from torch.distributed.algorithms.model_averaging import averagers as torch_averagers

from tensorplay_hpc.bench.gloo import init_gloo
from tensorplay_hpc.bench.models import mlp
from tensorplay_hpc.bench.report import Report
from tensorplay_hpc.bench.timing import compare
from tensorplay_hpc.comm.chunking import piece_elements
from tensorplay_hpc.comm.private import private_comm
from tensorplay_hpc.distributed.algorithms.model_averaging import averagers, utils
from tensorplay_hpc.distributed.algorithms.model_averaging.utils import average_parameters

__all__ = ["DIGEST_BYTES", "run"]

DIGEST_BYTES = 40


def _params(**shape):
    params = list(mlp(**shape).parameters())
    for p in params:
        p.grad = torch.zeros_like(p)   # only parameters with gradients are averaged
    return params


def run(report: Report) -> None:
    world = MPI.COMM_WORLD
    init_gloo(world)
    ours_params, theirs_params = _params(), _params()
    numel = sum(p.numel() for p in ours_params)
    flat = np.ones(numel, dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # period 1 warns in both libraries
        ours_averager = averagers.PeriodicModelAverager(period=1)
        theirs_averager = torch_averagers.PeriodicModelAverager(period=1)

    piece = piece_elements(4)

    def raw() -> None:
        world.Allreduce(MPI.IN_PLACE, [flat, MPI.FLOAT])

    def raw_in_pieces() -> None:
        for start in range(0, numel, piece):
            world.Allreduce(MPI.IN_PLACE, [flat[start:start + piece], MPI.FLOAT])

    with ours_averager:
        function_s, averager_s, theirs_s, raw_s, pieces_s = compare([
            lambda: average_parameters(ours_params, None),
            lambda: ours_averager.average_parameters(ours_params),
            lambda: theirs_averager.average_parameters(theirs_params),
            raw, raw_in_pieces], report.repeat)
    nbytes = 4 * numel
    for case, ours_s in (("average_parameters", function_s), ("PeriodicModelAverager", averager_s)):
        report.add("averaging", case, ours_s, "mpi4py-raw", raw_s, nbytes=nbytes)
        report.add("averaging", case, ours_s, "mpi4py-raw in pieces", pieces_s, nbytes=nbytes,
                   piece_bytes=4 * piece)
    report.add("averaging", "PeriodicModelAverager", averager_s, "torch-gloo", theirs_s,
               nbytes=nbytes)
    _gradient_check(report, ours_params, averager_s)


def _gradient_check(report: Report, params: list, averager_s: float) -> None:
    """The check before each averaging alone, and its share of an averaging."""
    world = MPI.COMM_WORLD
    private = private_comm(world)
    digest = np.zeros(DIGEST_BYTES, dtype=np.uint8)
    digests = np.zeros(DIGEST_BYTES * world.Get_size(), dtype=np.uint8)
    small = _params(layers=3, width=64)
    small_flat = np.ones(sum(p.numel() for p in small), dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        small_averager = averagers.PeriodicModelAverager(period=1)

    def check(checked: list):
        return lambda: utils.params_with_gradients(private, checked)

    def raw_gather() -> None:
        world.Allgather([digest, MPI.BYTE], [digests, MPI.BYTE])

    def raw_small() -> None:
        world.Allreduce(MPI.IN_PLACE, [small_flat, MPI.FLOAT])

    with small_averager:
        check_s, gather_s, small_check_s, small_s, small_raw_s = compare(
            [check(params), raw_gather, check(small),
             lambda: small_averager.average_parameters(small), raw_small], report.repeat)
    report.add("averaging", f"gradient check, {len(params)} parameters", check_s, "mpi4py-raw",
               gather_s, nbytes=DIGEST_BYTES, share_pct=round(100 * check_s / averager_s, 3))
    report.add("averaging", "PeriodicModelAverager, small MLP", small_s, "mpi4py-raw",
               small_raw_s, nbytes=small_flat.nbytes,
               share_pct=round(100 * small_check_s / small_s, 2))
