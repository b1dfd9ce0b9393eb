"""``tensorplay-hpc env``: what this installation and launch can do, for people or, with
``--json``, for a bug report."""
from __future__ import annotations

import argparse
import json

__all__ = ["DESCRIPTION", "add_arguments", "run"]

DESCRIPTION = """\
Print the versions of the package, torch and mpi4py; the MPI library's family (Open MPI, MPICH,
Intel MPI, Cray MPICH, MVAPICH), version and ABI; the MPI thread level, and below
MPI_THREAD_MULTIPLE the variable that raises it; whether one-sided windows work within a node
and across nodes for this launch (run it under mpiexec or srun with the ranks and nodes of your
job to find out); CUDA-aware MPI and how it was detected; Open MPI's components; parallel HDF5;
the launcher's and the MPI library's variables; and every TENSORPLAY_HPC_* setting with its
value and default."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``env``."""
    parser.add_argument("--json", action="store_true", help="one JSON object, for bug reports")


def run(args: argparse.Namespace) -> int:
    """Collect the report on every rank; rank 0 prints it. Collective over MPI.COMM_WORLD."""
    from tensorplay_hpc.comm.mpi import MPI

    from .report import as_text, collect
    report = collect(MPI.COMM_WORLD)
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(json.dumps(report, indent=2) if args.json else as_text(report))
    return 0
