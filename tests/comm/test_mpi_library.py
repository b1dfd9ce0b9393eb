"""Tests of :mod:`tensorplay_hpc.comm.library`: the family and version read from real version
strings, and what the running library (the lane's) says of itself."""
import os

import mpi4py
import pytest
from mpi4py import MPI

from tensorplay_hpc.comm import library
from lanes import ABIS, FAMILIES, LANE, LIBRARY_PREFIXES

VERSIONS = [
    ("Open MPI v4.1.4, package: Debian OpenMPI, ident: 4.1.4, repo rev: v4.1.4, May 26, 2022",
     "open-mpi", "4.1.4"),
    ("Open MPI v5.0.11, package: Open MPI user@localhost Distribution, ident: 5.0.11, repo rev: "
     "v5.0.11rc1, Sep 16, 2026", "open-mpi", "5.0.11"),
    ("MPICH Version:      5.0.2\nMPICH Release date: Fri Sep 25 20:45:26 UTC 2026\n"
     "MPICH ABI:          18:2:6\nMPICH Device:       ch4:ucx ofi", "mpich", "5.0.2"),
    ("MPICH Version:\t4.0.2\nMPICH Release date:\tThu Apr  7 12:34:45 CDT 2022", "mpich", "4.0.2"),
    ("Intel(R) MPI Library 2021.19.0 for Linux* OS\n", "intel-mpi", "2021.19.0"),
    ("Intel(R) MPI Library 2019 Update 9 for Linux* OS", "intel-mpi", "2019"),
    ("MPI VERSION    : CRAY MPICH version 8.1.28.2 (ANL base 3.4a2)\nMPI BUILD INFO : "
     "Sun Nov 12 13:54 2023 (git hash 4fc5f2b)", "cray-mpich", "8.1.28.2"),
    ("MVAPICH2 Version      :\t2.3.7\nMVAPICH2 Release date :\tWed March 02 22:00:00 EST 2022",
     "mvapich", "2.3.7"),
    ("MVAPICH Version      :\t3.0\nMVAPICH Release date :\tTue Feb 27 2024", "mvapich", "3.0"),
    ("Spectrum MPI 10.4", "unknown", None),
]


@pytest.mark.parametrize("text,family,version", VERSIONS)
def test_family_and_version_from_the_version_string(text, family, version):
    assert library.parse_family(text) == family
    assert library.parse_version(text) == version
    assert family in library.FAMILIES + ("unknown",)


def test_the_running_library_is_the_lanes():
    assert library.family() == FAMILIES[LANE]
    assert library.abi() == ABIS[LANE]
    assert library.version_text().startswith(LIBRARY_PREFIXES[LANE])
    assert library.version() and library.version() in library.version_text()
    path = library.library_path()
    assert path and os.path.basename(path).startswith("libmpi") and os.path.isfile(path)
    assert library.thread_level() == MPI.Query_thread() == MPI.THREAD_MULTIPLE
    assert library.thread_level_name(MPI.THREAD_SERIALIZED) == "MPI_THREAD_SERIALIZED"


def test_cuda_support_is_asked_of_the_loaded_library_and_is_no_here():
    aware, source = library.cuda_support()
    assert aware is False
    query = ("MPIX_Query_cuda_support" if FAMILIES[LANE] == "open-mpi"
             else "MPIX_GPU_query_support")
    assert source == f"the MPI library ({query})"


def test_without_an_answer_from_the_library_the_variables_decide(monkeypatch):
    monkeypatch.setattr(library, "_ask_library", lambda name: None)
    monkeypatch.delenv("MPICH_GPU_SUPPORT_ENABLED", raising=False)
    monkeypatch.delenv("MV2_USE_CUDA", raising=False)
    aware, source = library.cuda_support.__wrapped__()
    assert aware is False and "neither MPICH_GPU_SUPPORT_ENABLED nor MV2_USE_CUDA is 1" in source
    monkeypatch.setenv("MV2_USE_CUDA", "1")
    assert library.cuda_support.__wrapped__() == (True, "MV2_USE_CUDA=1")
    monkeypatch.setattr(library, "_memory_kinds", lambda: "mpi,system,cuda:device")
    assert library.cuda_support.__wrapped__() == (True,
                                                  "mpi_memory_alloc_kinds=mpi,system,cuda:device")


def test_the_variable_that_raises_the_thread_level(monkeypatch):
    assert library.thread_variable("cray-mpich") == "MPICH_MAX_THREAD_SAFETY=multiple"
    assert library.thread_variable("mvapich") == "MV2_ENABLE_AFFINITY=0"
    for family in ("open-mpi", "mpich", "intel-mpi"):
        assert library.thread_variable(family) is None   # built without threads: none helps
    monkeypatch.setattr(mpi4py.rc, "thread_level", "serialized")
    assert library.thread_variable("cray-mpich") == "MPI4PY_RC_THREAD_LEVEL=multiple"
