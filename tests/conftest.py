"""Test harness under mpiexec: rank 0 reports; a failure on any rank aborts the whole job at
once (no rank is left waiting in a collective); a test stuck past its timeout kills its process,
which makes mpiexec end the job."""
import os
import sys

import pytest
import torch
from mpi4py import MPI

from tensorplay_hpc.bench.gloo import init_gloo
from tensorplay_hpc.comm import environment

WORLD = MPI.COMM_WORLD


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    if WORLD.Get_rank() != 0:  # only rank 0 reports; a failure elsewhere is printed below
        reporter = config.pluginmanager.getplugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)


def pytest_runtest_logreport(report):
    if report.failed and WORLD.Get_size() > 1:
        sys.stderr.write(f"\n=== rank {WORLD.Get_rank()}: {report.nodeid} failed ({report.when}) ===\n"
                         f"{report.longreprtext}\n")
        sys.stderr.flush()
        WORLD.Abort(1)


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(1234)


@pytest.fixture
def setting():
    """``setting(name, value)`` sets an environment variable for this test only, and has the
    library read its settings again (it reads them once, see tensorplay_hpc.comm.environment)."""
    saved = {}

    def set_variable(name, value):
        saved.setdefault(name, os.environ.get(name))
        os.environ[name] = value
        environment.reload()
    yield set_variable
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    environment.reload()


@pytest.fixture
def world():
    return WORLD


@pytest.fixture
def folder(tmp_path_factory):
    """One new folder shared by every rank (rank 0 makes it)."""
    path = str(tmp_path_factory.mktemp("shared")) if WORLD.Get_rank() == 0 else None
    return WORLD.bcast(path, root=0)


@pytest.fixture(scope="session")
def gloo():
    """torch.distributed over gloo on the same ranks, for side-by-side parity checks."""
    import torch.distributed as dist
    init_gloo(WORLD)
    return dist


@pytest.fixture(scope="session")
def simulated_nodes():
    """Two simulated nodes of two slots, for tests that launch jobs across nodes: the cluster
    the suite runs in, or one made for this session."""
    from simulated_nodes import NodesUnavailable, SimulatedNodes, from_env
    running = from_env()
    if running is not None:
        yield running
        return
    try:
        with SimulatedNodes(nodes=2, slots=2) as nodes:
            yield nodes
    except NodesUnavailable as reason:
        pytest.skip(f"no simulated nodes: {reason}")
