"""Tests of ``tensorplay-hpc env``: the report of this launch (in process, at every world size
and across simulated nodes), the command, and the table of settings being complete."""
import json
import re
import subprocess
import sys

import pytest
from mpi4py import MPI

import tensorplay_hpc
from tensorplay_hpc.diagnostics import settings
from tensorplay_hpc.diagnostics.report import as_text, collect
from lanes import ABIS, FAMILIES, LANE, LIBRARY_PREFIXES, PARALLEL_HDF5
from launch import ONLY_UNDER_ONE_RANK, REPO, clean_env, single_rank

WORLD = MPI.COMM_WORLD


def test_the_report_describes_this_launch():
    report = collect(WORLD)
    hosts = list(dict.fromkeys(WORLD.allgather(MPI.Get_processor_name())))
    assert report["launch"]["ranks"] == WORLD.Get_size()
    assert report["launch"]["hosts"] == hosts
    assert sum(report["launch"]["ranks_per_host"].values()) == WORLD.Get_size()
    assert report["mpi"]["thread_levels"] == ["MPI_THREAD_MULTIPLE"]
    assert report["mpi"]["thread_variable"] is None
    assert report["mpi"]["family"] == FAMILIES[LANE] and report["mpi"]["abi"] == ABIS[LANE]
    assert report["mpi"]["library"].startswith(LIBRARY_PREFIXES[LANE])
    assert report["mpi"]["version"] in report["mpi"]["library"]
    assert report["windows"]["within_a_node"] is True
    # Debian's Open MPI 4.1 has no one-sided component between nodes over TCP; MPICH's and
    # Open MPI 5's windows work there.
    across = None if len(hosts) == 1 else LANE != "system"
    assert report["windows"]["across_nodes"] is across
    assert report["hdf5"]["parallel"] is PARALLEL_HDF5
    assert (report["open_mpi"] is not None) is (
        FAMILIES[LANE] == "open-mpi" and WORLD.Get_rank() == 0)
    assert report["tensorplay_hpc"] == tensorplay_hpc.__version__
    text = as_text(report)
    assert f"ranks           {WORLD.Get_size()} on {len(hosts)} node(s)" in text
    assert f"family {FAMILIES[LANE]}, version {report['mpi']['version']}, ABI {ABIS[LANE]}" in text
    assert "windows         within a node: yes; across nodes: " + (
        "one node only, not probed" if across is None else "yes" if across else "no") in text


def test_every_setting_the_package_reads_is_in_the_table_and_the_docs():
    names = set()
    for path in list((REPO / "tensorplay_hpc").rglob("*.py")) + list((REPO / "jobs").iterdir()):
        names |= set(re.findall(r"TENSORPLAY_HPC_[A-Z_]+[A-Z]", path.read_text()))
    assert names == {s.name for s in settings.SETTINGS}
    page = (REPO / "docs" / "environment.md").read_text()
    for s in settings.SETTINGS:
        assert f"| `{s.name}` | {s.default} |" in page, s.name


@pytest.mark.skipif(not single_rank(), reason=ONLY_UNDER_ONE_RANK)
def test_the_command_prints_json_with_the_settings_set():
    env = clean_env(TENSORPLAY_HPC_DEBUG="1", TENSORPLAY_HPC_DEGUB="1")
    result = subprocess.run([sys.executable, "-m", "tensorplay_hpc", "env", "--json"], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    values = {s["name"]: s["value"] for s in report["settings"]}
    assert values["TENSORPLAY_HPC_DEBUG"] == "1" and values["TENSORPLAY_HPC_CUDA_AWARE"] is None
    assert report["unknown_settings"] == ["TENSORPLAY_HPC_DEGUB"]
    assert report["mpi"]["library"].startswith(LIBRARY_PREFIXES[LANE])
    if FAMILIES[LANE] == "open-mpi":
        assert report["open_mpi"]["components"]["btl"]["candidates"]
    else:
        assert report["open_mpi"] is None


def test_below_multiple_the_report_names_the_variable_to_set():
    report = collect(WORLD)
    report["mpi"].update(thread_levels=["MPI_THREAD_SERIALIZED"], family="cray-mpich",
                         thread_variable="MPICH_MAX_THREAD_SAFETY=multiple")
    assert "set MPICH_MAX_THREAD_SAFETY=multiple in the job's environment" in as_text(report)
    report["mpi"].update(family="open-mpi", thread_variable=None)
    assert "no variable raises it: this open-mpi library was built without thread support" in (
        as_text(report))
