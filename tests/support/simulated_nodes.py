"""A cluster of simulated nodes on one machine, for running MPI jobs across nodes over TCP.

Each node is a set of Linux namespaces of its own, held open by a sleeping process:

- network: one ``eth0`` (a veth) with its own address on a private bridge;
- UTS: its own hostname (``n1``, ``n2``...);
- mount: a private ``/dev/shm`` and ``/tmp`` (nodes share no memory segments and no scratch
  folder; a checkout under ``/tmp`` stays visible at its path), and an ``/etc/hosts`` that
  names every node;
- IPC: its own System V objects.

With ``throttle`` (a rate such as ``100mbit``), each node's ``eth0`` sends through a token
bucket filter (``tc qdisc ... tbf``) at that rate, so the link between nodes is as slow as a
site's uplink; the kernel here has no ``netem``, so no delay is added. Off by default.

The bridge lives in one more namespace, the *launcher* (the login node of the cluster), where
``mpiexec`` runs. It starts one daemon per node through a script that enters the node's
namespaces instead of calling ssh: Open MPI 4's ``--mca plm_rsh_agent``, Open MPI 5's (PRRTE)
``--prtemca plm_ssh_agent``, or Hydra's (MPICH, Intel MPI) ``-launcher-exec``. Nothing here touches the
machine's own network namespace: all traffic stays on the bridge. The nodes share the rest of
the file system; ``scratch``, a folder in ``/var/tmp`` handed to jobs as ``TMPDIR``, plays the
cluster's parallel file system.

Needs root (it creates namespaces). Use it from Python::

    with SimulatedNodes(nodes=2, slots=2) as cluster:
        cluster.run(["mpiexec", *cluster.mpiexec_flags(), "-n", "4", "python", "job.py"])

or from the shell: ``python tests/support/simulated_nodes.py --nodes 2 --slots 2 -- COMMAND`` runs
COMMAND in the launcher with ``TENSORPLAY_TEST_NODES`` set, and with ``--mpiexec`` it runs
``mpiexec CLUSTER-OPTIONS ARGS`` there (``-- ARGS``: options of your own, ``-n``, the program). A process that runs with that
variable (a test, or a rank of a job) gets the same cluster back from :func:`from_env`, so it
can launch further jobs across the same nodes.
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

from started import Started

ENV = "TENSORPLAY_TEST_NODES"
"""Set, in the launcher and in every job, to the folder that describes the running cluster."""

CHECKOUT = Path(__file__).resolve().parents[2]
"""This repository: kept at its path on every node, even under a node's private /tmp."""

SUBNET = "10.213.17"
"""The bridge's /24: the launcher is .1, node i is .(10 + i). Private to the namespaces."""

AGENT = """#!/bin/sh
# The launcher's remote-shell agent for the simulated nodes: "AGENT HOST COMMAND..." runs COMMAND in
# HOST's namespaces, as ssh would run it in a remote shell.
host=$1
shift
exec nsenter --target "$(cat "{folder}/$host.pid")" --net --uts --ipc --mount -- /bin/sh -c "$*"
"""

THROTTLE_BURST = "32kb"
"""Bytes a throttled node may send at once above its rate (the token bucket's depth)."""
THROTTLE_QUEUE = "100ms"
"""How long a packet may wait in a throttled node's queue before it is dropped."""

# What each holder process does in its fresh namespaces before sleeping until it is killed.
HOLDER = """set -e
hostname "$1"
mount -t tmpfs -o size=1g tmpfs /dev/shm
mount --bind "$2" /etc/hosts
case "$4" in /tmp/*) mkdir -p "$3"; mount --bind "$4" "$3" ;; esac
mount -t tmpfs -o size=1g tmpfs /tmp
case "$4" in /tmp/*) mkdir -p "$4"; mount --bind "$3" "$4" ;; esac
ip link set lo up
echo ready
exec sleep infinity
"""


@functools.lru_cache(maxsize=None)
def launcher_dialect() -> str:
    """Which launcher ``mpiexec`` on ``PATH`` is: ``orte`` (Open MPI 4), ``prrte`` (Open MPI 5)
    or ``hydra`` (MPICH, Intel MPI, MVAPICH), from its ``--version``."""
    version = subprocess.run(["mpiexec", "--version"], capture_output=True, text=True,
                             timeout=60).stdout
    if "HYDRA" in version or "Intel(R) MPI" in version:
        return "hydra"
    if "OpenRTE" in version or "(Open MPI) 4" in version:
        return "orte"
    return "prrte"


def _die_with_parent() -> None:
    """In a holder, before it execs: be killed when the process that made the cluster dies, so
    no namespace outlives a killed test run."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class NodesUnavailable(RuntimeError):
    """Namespaces cannot be created here (not root, or no ``unshare``/``nsenter``/``ip``)."""


def _check(command: List[str]) -> str:
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}): {result.stderr}")
    return result.stdout


class SimulatedNodes(Started):
    """``nodes`` simulated nodes of ``slots`` slots each, plus the launcher; :meth:`stop` (or
    leaving the ``with`` block) removes everything it made."""

    def __init__(self, nodes: int = 2, slots: int = 2, throttle: Optional[str] = None) -> None:
        self.names = [f"n{i}" for i in range(1, nodes + 1)]
        self.slots = slots
        self.throttle = throttle
        self.folder: Optional[Path] = None
        self._holders: Dict[str, subprocess.Popen] = {}

    # -- lifetime ---------------------------------------------------------------------------

    def start(self) -> "SimulatedNodes":
        if os.geteuid() != 0:
            raise NodesUnavailable("simulated nodes need root (they create namespaces)")
        missing = [t for t in ("unshare", "nsenter", "ip", *(("tc",) if self.throttle else ()))
                   if not shutil.which(t)]
        if missing:
            raise NodesUnavailable(f"simulated nodes need {', '.join(missing)} on PATH")
        self.folder = Path(tempfile.mkdtemp(prefix="tensorplay-nodes-", dir="/var/tmp"))
        self.scratch.mkdir()
        hosts = self.folder / "hosts"
        hosts.write_text("127.0.0.1 localhost\n" + "".join(
            f"{self.address(name)} {name}\n" for name in ["launcher", *self.names]))
        (self.folder / "agent").write_text(AGENT.format(folder=self.folder))
        (self.folder / "agent").chmod(0o755)
        for name in ["launcher", *self.names]:
            self._hold(name, hosts)
        self._in("launcher", "ip", "link", "add", "br0", "type", "bridge")
        self._in("launcher", "ip", "addr", "add", f"{self.address('launcher')}/24", "dev", "br0")
        self._in("launcher", "ip", "link", "set", "br0", "up")
        for name in self.names:
            self._in("launcher", "ip", "link", "add", f"v{name}", "type", "veth", "peer", "name",
                     "eth0", "netns", str(self._holders[name].pid))
            self._in("launcher", "ip", "link", "set", f"v{name}", "master", "br0", "up")
            self._in(name, "ip", "addr", "add", f"{self.address(name)}/24", "dev", "eth0")
            self._in(name, "ip", "link", "set", "eth0", "up")
            if self.throttle:
                self._in(name, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate",
                         self.throttle, "burst", THROTTLE_BURST, "latency", THROTTLE_QUEUE)
        (self.folder / "cluster.json").write_text(json.dumps(
            {"names": self.names, "slots": self.slots}))
        return self

    def _hold(self, name: str, hosts: Path) -> None:
        holder = subprocess.Popen(
            ["unshare", "--net", "--uts", "--ipc", "--mount", "--propagation", "private",
             "sh", "-c", HOLDER, "holder", name, str(hosts), str(self.folder / f"{name}.checkout"),
             str(CHECKOUT)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=_die_with_parent)
        self._holders[name] = holder
        if holder.stdout.readline().strip() != "ready":
            holder.wait(timeout=10)
            raise NodesUnavailable(f"node {name} did not start: {holder.stderr.read()}")
        (self.folder / f"{name}.pid").write_text(str(holder.pid))

    def stop(self) -> None:
        """Kill the holders (their namespaces, veths and bridge go with them), remove the folder."""
        for holder in self._holders.values():
            holder.kill()
            holder.wait()
        self._holders.clear()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)

    # -- use --------------------------------------------------------------------------------

    def address(self, name: str) -> str:
        """The bridge address of ``launcher`` or of node ``nI``."""
        return f"{SUBNET}.1" if name == "launcher" else f"{SUBNET}.{10 + int(name[1:])}"

    @property
    def scratch(self) -> Path:
        """A folder every node sees (the cluster's shared file system)."""
        return self.folder / "scratch"

    def enter(self, name: str = "launcher", wd: Optional[str] = None) -> List[str]:
        """The command prefix that runs a program in ``name``'s namespaces, in folder ``wd``
        (default: this process's working directory)."""
        pid = (self.folder / f"{name}.pid").read_text()
        return ["nsenter", "--target", pid, "--net", "--uts", "--ipc", "--mount",
                f"--wd={wd or os.getcwd()}", "--"]

    def mpiexec_flags(self, slots: Optional[int] = None) -> List[str]:
        """``mpiexec`` options that place ranks on the nodes, ``slots`` per node (default: the
        cluster's), and start the daemons through the namespace agent, over the bridge, in the
        dialect of the ``mpiexec`` on ``PATH``."""
        slots = slots or self.slots
        subnet = f"{SUBNET}.0/24"
        hosts = ",".join(f"{name}:{slots}" for name in self.names)
        agent = str(self.folder / "agent")
        dialect = launcher_dialect()
        if dialect == "hydra":
            return ["-hosts", hosts, "-launcher", "rsh", "-launcher-exec", agent,
                    "-genv", "FI_TCP_IFACE", "eth0", "-genv", ENV, str(self.folder),
                    "-genv", "TMPDIR", str(self.scratch)]
        exported = ["-x", f"{ENV}={self.folder}", "-x", f"TMPDIR={self.scratch}"]
        if dialect == "prrte":
            return ["--host", hosts, "--map-by", "slot:oversubscribe",
                    "--prtemca", "plm_ssh_agent", agent, "--prtemca", "plm_ssh_no_tree_spawn", "1",
                    "--prtemca", "oob_tcp_if_include", subnet,
                    "--mca", "btl_tcp_if_include", subnet, *exported]
        return ["--host", hosts,
                "--mca", "plm", "rsh", "--mca", "plm_rsh_agent", agent,
                "--mca", "plm_rsh_no_tree_spawn", "1",
                "--mca", "oob_tcp_if_include", subnet, "--mca", "btl_tcp_if_include", subnet,
                *exported]

    def env(self, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        """``base`` (default ``os.environ``) for a program run in the launcher."""
        return {**(os.environ if base is None else base), ENV: str(self.folder),
                "TMPDIR": str(self.scratch)}

    def job_env(self, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        """:meth:`env`, plus the network choice of :meth:`mpiexec_flags` as ``OMPI_MCA_``
        variables, for ranks that another launcher (``srun``) starts on the nodes."""
        subnet = f"{SUBNET}.0/24"
        return {**self.env(base), "OMPI_MCA_oob_tcp_if_include": subnet,
                "OMPI_MCA_btl_tcp_if_include": subnet}

    def run(self, command: List[str], node: str = "launcher", **kwargs) -> subprocess.CompletedProcess:
        """Run ``command`` in ``node``'s namespaces (``kwargs`` go to ``subprocess.run``)."""
        env = self.env(kwargs.pop("env", None))
        wd = kwargs.pop("cwd", None)
        return subprocess.run([*self.enter(node, wd and str(wd)), *command], env=env, **kwargs)

    def _in(self, name: str, *command: str) -> str:
        return _check([*self.enter(name), *command])


def from_env() -> Optional[SimulatedNodes]:
    """The cluster this process runs in (``TENSORPLAY_TEST_NODES``), or ``None`` on one node.
    The returned object only describes the cluster: it does not stop it."""
    folder = os.environ.get(ENV)
    if not folder:
        return None
    described = json.loads((Path(folder) / "cluster.json").read_text())
    cluster = SimulatedNodes(len(described["names"]), described["slots"])
    cluster.folder = Path(folder)
    return cluster


def main() -> int:
    parser = argparse.ArgumentParser(
        description="Run COMMAND in the launcher of a cluster of simulated nodes (created for "
                    "it, removed after). The command sees TENSORPLAY_TEST_NODES and can launch "
                    "with `mpiexec $(python tests/support/simulated_nodes.py --flags) ...`.")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--slots", type=int, default=2, help="ranks per node")
    parser.add_argument("--throttle", metavar="RATE",
                        help="send at most RATE from each node (tc's units: 100mbit, 1gbit)")
    parser.add_argument("--flags", action="store_true",
                        help="print the mpiexec options of the cluster this shell runs in")
    parser.add_argument("--mpiexec", action="store_true",
                        help="run `mpiexec CLUSTER-OPTIONS COMMAND` instead of COMMAND")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    args = parser.parse_args()
    if args.flags:
        cluster = from_env()
        if cluster is None:
            parser.error(f"{ENV} is not set: not inside a cluster of simulated nodes")
        print(" ".join(cluster.mpiexec_flags()))
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no COMMAND given")
    # A `timeout` around this script sends SIGTERM: leave through the cleanup below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    with SimulatedNodes(args.nodes, args.slots, args.throttle) as cluster:
        if args.mpiexec:
            command = ["mpiexec", *cluster.mpiexec_flags(), *command]
        return cluster.run(command).returncode


if __name__ == "__main__":
    sys.exit(main())
