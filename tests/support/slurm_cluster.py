"""A real Slurm for tests of ``jobs/``: munge and Debian's ``slurm-wlm``, run as root without
systemd, state and logs in a temporary folder, stopped afterwards. One node (this machine), or
one per simulated node (``tests/support/simulated_nodes.py``):

    with SlurmCluster() as cluster:
        job = cluster.sbatch(["jobs/train.sbatch", "--steps", "10"], cwd=repo)

    with SimulatedNodes(nodes=2, slots=2) as nodes, SlurmCluster(nodes=nodes) as cluster:
        job = cluster.sbatch(["--nodes=2", "jobs/train.sbatch"], cwd=repo)

The packages are installed with apt when missing (``SlurmUnavailable`` if that is impossible).
The daemons run in the foreground as children of this process, on free ports, with
``SLURM_CONF`` pointing at the generated ``slurm.conf``; the client commands get the same
variable through :meth:`SlurmCluster.env`. On simulated nodes ``slurmctld`` runs in the
launcher (the login node, where the client commands run too) and ``slurmd -N nI`` in each node's
namespaces; the folder is in the nodes' shared scratch, and the one ``munged`` of this machine
serves them all (its socket is in ``/run/munge``, a folder the namespaces share).
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from simulated_nodes import SimulatedNodes
from started import Started

PACKAGES = ("slurm-wlm", "munge")
MUNGE_KEY = Path("/etc/munge/munge.key")
MUNGE_SOCKET_DIR = Path("/run/munge")


class SlurmUnavailable(RuntimeError):
    """Slurm cannot run here (not root, or the packages cannot be installed)."""


def _run(command: List[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, **kwargs)


def ensure_installed() -> None:
    """Install ``slurm-wlm`` and ``munge`` with apt when ``slurmctld`` is missing."""
    if shutil.which("slurmctld") and shutil.which("munged") and shutil.which("sbatch"):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise SlurmUnavailable("slurm-wlm and munge are not installed, and apt-get as root is "
                               "not available to install them")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-qq"],
                    ["apt-get", "install", "-y", "-qq", *PACKAGES]):
        result = _run(command, env=env, timeout=900)
        if result.returncode != 0:
            raise SlurmUnavailable(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _munge_works() -> bool:
    if not shutil.which("munge"):
        return False
    credential = _run(["munge", "-n"])
    return credential.returncode == 0 and _run(["unmunge"], input=credential.stdout).returncode == 0


class SlurmCluster(Started):
    """Start munged (unless one answers already), slurmctld and a slurmd per node; stop what was
    started. Without ``nodes`` the cluster is this machine, with ``cpus`` CPUs (default all);
    with ``nodes``, one Slurm node per simulated node, of its ``slots`` CPUs."""

    def __init__(self, cpus: Optional[int] = None,
                 nodes: Optional[SimulatedNodes] = None) -> None:
        self.nodes = nodes
        if nodes is None:
            self.cpus = cpus or os.cpu_count() or 1
            self.controller = socket.gethostname().split(".")[0]
            self.names = [self.controller]
        else:
            self.cpus = cpus or nodes.slots
            self.controller = "launcher"
            self.names = nodes.names
        self.folder = Path(tempfile.mkdtemp(prefix="tensorplay-slurm-",
                                            dir=nodes and nodes.scratch))
        self.conf = self.folder / "slurm.conf"
        self._daemons: List[subprocess.Popen] = []

    # -- setup ------------------------------------------------------------------------------

    def _write_conf(self) -> None:
        for sub in ("state", *(f"spool/{name}" for name in self.names), "log"):
            (self.folder / sub).mkdir(parents=True)
        f = self.folder
        names = ",".join(self.names)

        def address(name: str, form: str) -> str:
            """``form`` around host ``name``'s bridge address on simulated nodes, else nothing."""
            return "" if self.nodes is None else form.format(self.nodes.address(name))

        self.conf.write_text("\n".join([
            "ClusterName=tensorplay-test",
            f"SlurmctldHost={self.controller}{address(self.controller, '({})')}",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            # A requeued job waits the credential lifetime (120 s by default) before it runs again.
            "AuthInfo=cred_expire=10",
            "CredType=cred/munge",
            f"StateSaveLocation={f / 'state'}",
            # slurmd puts its node's name for %n: every node has folders of its own.
            f"SlurmdSpoolDir={f / 'spool' / '%n'}",
            f"SlurmctldPidFile={f / 'slurmctld.pid'}",
            f"SlurmdPidFile={f / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={f / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={f / 'log' / 'slurmd-%n.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "SchedulerType=sched/builtin",
            # Look at pending jobs every 2 s, not 60: a requeued job starts when it may.
            "SchedulerParameters=sched_interval=2",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "ReturnToService=2",
            "JobRequeue=1",
            "KillWait=10",
            "MinJobAge=600",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "JobAcctGatherType=jobacct_gather/none",
            # The CPUs configured count, not those slurmd finds (simulated nodes share the cores).
            "SlurmdParameters=config_overrides",
            *(f"NodeName={name} CPUs={self.cpus} State=UNKNOWN{address(name, ' NodeAddr={}')}"
              for name in self.names),
            f"PartitionName=test Nodes={names} Default=YES MaxTime=INFINITE "
            "OverSubscribe=YES State=UP",
            "",
        ]))

    def _start_munge(self) -> None:
        if _munge_works():
            return
        if not MUNGE_KEY.exists():
            MUNGE_KEY.parent.mkdir(parents=True, exist_ok=True)
            MUNGE_KEY.write_bytes(os.urandom(1024))
        MUNGE_SOCKET_DIR.mkdir(parents=True, exist_ok=True)
        for path in (MUNGE_KEY, MUNGE_KEY.parent, MUNGE_SOCKET_DIR):
            shutil.chown(path, "munge", "munge")
        MUNGE_KEY.chmod(0o400)
        Path("/var/log/munge").mkdir(parents=True, exist_ok=True)
        Path("/var/lib/munge").mkdir(parents=True, exist_ok=True)
        for path in ("/var/log/munge", "/var/lib/munge"):
            shutil.chown(path, "munge", "munge")
        self._daemons.append(subprocess.Popen(
            ["runuser", "-u", "munge", "--", "munged", "--foreground"],
            stdout=subprocess.DEVNULL, stderr=open(self.folder / "munged.log", "w")))
        self._until(_munge_works, 30, "munged did not start")

    def _until(self, ready, seconds: float, failure: str) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if ready():
                return
            for daemon in self._daemons:
                if daemon.poll() is not None:
                    raise RuntimeError(f"{failure}: {daemon.args} exited with {daemon.returncode}\n"
                                       f"{self.logs()}")
            time.sleep(0.5)
        raise RuntimeError(f"{failure} within {seconds} s\n{self.logs()}")

    def _nodes_idle(self) -> bool:
        result = self.run(["sinfo", "-h", "-N", "-o", "%T"])
        states = [state.rstrip("*") for state in result.stdout.split()]
        return result.returncode == 0 and states == ["idle"] * len(self.names)

    def _on(self, name: str, wd: Optional[str] = None) -> List[str]:
        """The prefix that runs a command on host ``name`` of this cluster (in folder ``wd``)."""
        return [] if self.nodes is None else self.nodes.enter(name, wd)

    def _start_daemon(self, name: str, command: List[str], log: str) -> None:
        self._daemons.append(subprocess.Popen(
            [*self._on(name), *command, "-D", "-f", str(self.conf)], env=self.env(),
            stdout=subprocess.DEVNULL, stderr=open(self.folder / "log" / log, "w")))

    def start(self) -> "SlurmCluster":
        ensure_installed()
        if os.geteuid() != 0:
            raise SlurmUnavailable("the test cluster runs its daemons as root")
        self._write_conf()
        self._start_munge()
        self._start_daemon(self.controller, ["slurmctld"], "slurmctld.err")
        for name in self.names:
            self._start_daemon(name, ["slurmd", "-N", name], f"slurmd-{name}.err")
        self._until(self._nodes_idle, 60, "the Slurm nodes did not become idle")
        return self

    def stop(self) -> None:
        """Cancel the jobs, stop the daemons this object started, remove its folder."""
        if self._daemons:
            self.run(["scancel", "--full", "--quiet", "--partition=test"])
        for daemon in reversed(self._daemons):
            if daemon.poll() is None:
                daemon.terminate()
                try:
                    daemon.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait()
        self._daemons.clear()
        shutil.rmtree(self.folder, ignore_errors=True)

    # -- use --------------------------------------------------------------------------------

    def env(self, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        """``base`` (default ``os.environ``) with ``SLURM_CONF`` for this cluster; on simulated
        nodes also what jobs need there (see :meth:`SimulatedNodes.job_env`)."""
        env = {**(os.environ if base is None else base), "SLURM_CONF": str(self.conf)}
        return env if self.nodes is None else self.nodes.job_env(env)

    def run(self, command: List[str], **kwargs) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster, on its controller's host (the
        launcher of simulated nodes)."""
        env = self.env(kwargs.pop("env", None))
        cwd = kwargs.get("cwd")
        command = [*self._on(self.controller, cwd and str(cwd)), *command]
        return _run(command, env=env, timeout=kwargs.pop("timeout", 60), **kwargs)

    def sbatch(self, arguments: List[str], **kwargs) -> str:
        """Submit a batch job; returns its id."""
        result = self.run(["sbatch", "--parsable", *arguments], **kwargs)
        if result.returncode != 0:
            raise RuntimeError(f"sbatch failed: {result.stderr}")
        return result.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> Dict[str, str]:
        """``scontrol show job`` as a dict (``JobState``, ``Restarts``, ``ExitCode``...)."""
        result = self.run(["scontrol", "show", "job", "-o", job_id])
        fields = {}
        for word in result.stdout.split():
            key, _, value = word.partition("=")
            fields.setdefault(key, value)
        return fields

    def logs(self) -> str:
        """The tail of each daemon log, for failure messages."""
        parts = []
        for path in sorted(self.folder.glob("**/*.log")) + sorted(self.folder.glob("**/*.err")):
            tail = path.read_text(errors="replace").splitlines()[-30:]
            parts.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(parts)
