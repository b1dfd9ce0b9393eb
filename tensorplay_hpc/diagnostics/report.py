"""The report of ``tensorplay-hpc env``: versions, the MPI library (family, version, ABI), what
MPI can do for this launch (thread level and what raises it, one-sided windows within and across
nodes, CUDA-aware or not), Open MPI's components, parallel HDF5, the launcher's and the MPI
library's variables and the package's settings."""
from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from typing import Any, Dict, List, Optional

import mpi4py
import torch

import tensorplay_hpc
from tensorplay_hpc.comm import capabilities, library
from tensorplay_hpc.comm.cuda import cuda_awareness
from tensorplay_hpc.comm.communicators import free, split_by_node
from tensorplay_hpc.comm.mpi import MPI
from tensorplay_hpc.comm.small_collectives import all_gather_object, all_reduce_object

from . import settings

__all__ = ["as_text", "collect"]

_FRAMEWORKS = ("pml", "btl", "mtl", "osc", "coll")
_LAUNCHER_PREFIXES = ("SLURM_", "OMPI_COMM_WORLD_", "OMPI_UNIVERSE_SIZE", "PMIX_RANK", "PMI_",
                      "MPI4PY_", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "HYDRA_", "PRTE_")
# The variables the MPI library reads (its transports' included): Open MPI's, or the MPICH
# family's (Cray MPICH, Intel MPI and MVAPICH read MPICH's and their own).
_OPEN_MPI_PREFIXES = ("OMPI_MCA_", "PRTE_MCA_", "PMIX_MCA_", "UCX_", "FI_")
_MPICH_PREFIXES = ("MPICH_", "MPIR_CVAR_", "I_MPI_", "MV2_", "UCX_", "FI_")


def _this_rank() -> Dict[str, Any]:
    return {"host": MPI.Get_processor_name(),
            "thread_level": capabilities.thread_level_name(MPI.Query_thread()),
            "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0}


def _windows(world: MPI.Intracomm) -> Dict[str, Optional[bool]]:
    """Whether ``MPI.Win.Allocate`` works among the ranks of each node, and over all ranks when
    they span nodes (``None``: nothing to probe). Collective."""
    node = split_by_node(world)
    try:
        within = all_reduce_object(capabilities.one_sided_works(node), world, MPI.LAND)
    finally:
        free(node)
    one_node = capabilities.within_one_node(world)
    across = None if one_node else capabilities.one_sided_works(world)
    return {"within_a_node": within, "across_nodes": across}


def _hdf5() -> Dict[str, Any]:
    try:
        import h5py
    except ImportError as error:
        return {"h5py": None, "error": str(error)}
    return {"h5py": h5py.version.version, "hdf5": h5py.version.hdf5_version,
            "parallel": bool(h5py.get_config().mpi)}


def _mca_parameters() -> Dict[str, str]:
    """Open MPI's MCA parameters from its system and user files, then the environment (later
    ones win, as in Open MPI)."""
    found: Dict[str, str] = {}
    files = [os.path.join(_ompi_info_path("sysconfdir") or "/etc/openmpi",
                          "openmpi-mca-params.conf"),
             os.path.expanduser("~/.openmpi/mca-params.conf")]
    for path in files:
        if os.path.isfile(path):
            for line in open(path):
                key, sep, value = line.split("#", 1)[0].partition("=")
                if sep:
                    found[key.strip()] = value.strip()
    found.update({k[len("OMPI_MCA_"):]: v for k, v in os.environ.items()
                  if k.startswith("OMPI_MCA_")})
    return found


def _ompi_info() -> str:
    """The ``ompi_info`` of the running library: beside its ``lib`` folder, else on PATH."""
    path = library.library_path()
    if path:
        beside = os.path.join(os.path.dirname(os.path.dirname(path)), "bin", "ompi_info")
        if os.access(beside, os.X_OK):
            return beside
    return "ompi_info"


def _ompi_info_path(name: str) -> Optional[str]:
    output = _run([_ompi_info(), "--path", name])
    match = re.search(r":\s*(\S+)", output or "")
    return match.group(1) if match else None


def _run(command: List[str]) -> Optional[str]:
    if shutil.which(command[0]) is None and not os.access(command[0], os.X_OK):
        return None
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def _selected(installed: List[str], parameter: Optional[str]) -> List[str]:
    """The components a selection parameter leaves (``a,b`` includes, ``^a,b`` excludes)."""
    if not parameter:
        return installed
    names = [n.strip() for n in parameter.lstrip("^").split(",")]
    if parameter.startswith("^"):
        return [c for c in installed if c not in names]
    return [c for c in names if c in installed]


def _open_mpi() -> Optional[Dict[str, Any]]:
    if library.family() != "open-mpi":
        return None
    listing = _run([_ompi_info()]) or ""
    parameters = _mca_parameters()
    frameworks = {}
    for framework in _FRAMEWORKS:
        installed = re.findall(rf"MCA {framework}: (\w+)", listing)
        frameworks[framework] = {"installed": installed, "parameter": parameters.get(framework),
                                 "candidates": _selected(installed, parameters.get(framework))}
    return {"components": frameworks, "mca_parameters": parameters}


def collect(world: Optional[MPI.Intracomm] = None) -> Dict[str, Any]:
    """The report, complete on rank 0 (the other ranks get theirs too). Collective over
    ``world`` (default ``MPI.COMM_WORLD``): each rank tells its host, thread level and GPUs,
    and windows are tried within each node and across nodes."""
    world = MPI.COMM_WORLD if world is None else world
    ranks = all_gather_object(_this_rank(), world)
    below = all_reduce_object(library.thread_level() < MPI.THREAD_MULTIPLE, world, MPI.LOR)
    windows = _windows(world)
    aware, source = cuda_awareness()
    hosts = list(dict.fromkeys(r["host"] for r in ranks))
    return {
        "tensorplay_hpc": tensorplay_hpc.__version__,
        "python": f"{platform.python_version()} ({sys.executable})",
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "mpi4py": mpi4py.__version__,
        "mpi": {"library": library.version_text().splitlines()[0],
                "family": library.family(), "version": library.version(), "abi": library.abi(),
                "path": library.library_path(),
                "standard": "{}.{}".format(*MPI.Get_version()),
                "thread_level_requested": mpi4py.rc.thread_level,
                "thread_levels": sorted({r["thread_level"] for r in ranks}),
                "thread_variable": library.thread_variable() if below else None},
        "launch": {"ranks": world.Get_size(), "nodes": len(hosts), "hosts": hosts,
                   "ranks_per_host": {h: sum(r["host"] == h for r in ranks) for h in hosts},
                   "gpus_per_rank": sorted({r["gpus"] for r in ranks})},
        "windows": windows,
        "cuda_aware_mpi": {"answer": aware, "source": source},
        "rma_transport": os.environ.get(capabilities.TRANSPORT_ENV) or "auto",
        "open_mpi": _open_mpi() if world.Get_rank() == 0 else None,
        "hdf5": _hdf5(),
        "launcher_variables": {k: v for k, v in sorted(os.environ.items())
                               if k.startswith(_LAUNCHER_PREFIXES)},
        "library_variables": {k: v for k, v in sorted(os.environ.items())
                              if k.startswith(_OPEN_MPI_PREFIXES if library.family() == "open-mpi"
                                              else _MPICH_PREFIXES)},
        "settings": [{"name": s.name, "value": value, "default": s.default,
                      "meaning": s.meaning} for s, value in settings.current()],
        "unknown_settings": settings.unknown(),
    }


def _thread_advice(mpi: Dict[str, Any]) -> str:
    if mpi["thread_levels"] == ["MPI_THREAD_MULTIPLE"]:
        return ""
    if mpi["thread_variable"]:
        return (f"\n                  below MPI_THREAD_MULTIPLE: background work runs in the "
                f"foreground; set {mpi['thread_variable']} in the job's environment")
    return ("\n                  below MPI_THREAD_MULTIPLE, and no variable raises it: this "
            f"{mpi['family']} library was built without thread support")


def _yes(value: Optional[bool], none: str) -> str:
    return none if value is None else ("yes" if value else "no")


def as_text(report: Dict[str, Any]) -> str:
    """The report for people: one section per subject."""
    mpi, launch, windows = report["mpi"], report["launch"], report["windows"]
    hdf5 = report["hdf5"]
    lines = [
        f"tensorplay-hpc {report['tensorplay_hpc']}",
        f"  python   {report['python']}",
        f"  torch    {report['torch']} (CUDA build: {report['torch_cuda'] or 'none'})",
        f"  mpi4py   {report['mpi4py']}",
        f"  MPI      {mpi['library']} (MPI {mpi['standard']})",
        f"           family {mpi['family']}, version {mpi['version'] or '-'}, "
        f"ABI {mpi['abi']}, {mpi['path'] or 'library file not found'}",
        "",
        "this launch",
        f"  ranks           {launch['ranks']} on {launch['nodes']} node(s): "
        + ", ".join(f"{h} ({n})" for h, n in launch["ranks_per_host"].items()),
        f"  thread level    {', '.join(mpi['thread_levels'])} "
        f"(mpi4py asks for {mpi['thread_level_requested']})"
        + _thread_advice(mpi),
        f"  windows         within a node: {_yes(windows['within_a_node'], '-')}; across "
        f"nodes: {_yes(windows['across_nodes'], 'one node only, not probed')}",
        f"  GPUs per rank   {', '.join(map(str, launch['gpus_per_rank']))}",
        f"  CUDA-aware MPI  {_yes(report['cuda_aware_mpi']['answer'], '-')} "
        f"(from {report['cuda_aware_mpi']['source']})",
        f"  remote tensors  transport {report['rma_transport']}",
        f"  parallel HDF5   "
        + (f"h5py {hdf5['h5py']}, HDF5 {hdf5['hdf5']}, "
           f"{'parallel (mpio)' if hdf5['parallel'] else 'serial (enough for checkpoints)'}"
           if hdf5.get("h5py") else f"h5py missing ({hdf5.get('error')})"),
    ]
    ompi = report["open_mpi"]
    if ompi:
        lines += ["", "Open MPI components (installed; selection parameter; left)"]
        for framework, c in ompi["components"].items():
            lines.append(f"  {framework:5} {','.join(c['installed']) or '-'}; "
                         f"{c['parameter'] or '-'}; {','.join(c['candidates']) or '-'}")
    lines += ["", "launcher variables"]
    lines += [f"  {k}={v}" for k, v in report["launcher_variables"].items()] or ["  none"]
    lines += ["", "MPI library variables"]
    lines += [f"  {k}={v}" for k, v in report["library_variables"].items()] or ["  none"]
    lines += ["", "settings"]
    width = max(len(s["name"]) for s in report["settings"])
    for s in report["settings"]:
        value = f"unset (default {s['default']})" if s["value"] is None else s["value"]
        lines += [f"  {s['name']:{width}}  {value}", f"      {s['meaning']}"]
    for name in report["unknown_settings"]:
        lines.append(f"  {name}: set, but no such setting")
    return "\n".join(lines)
