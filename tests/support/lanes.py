"""The MPI library lane the tests run in (``TENSORPLAY_MPI``, see scripts/env.sh) and what it
is expected to be."""
import os
import sys


def _lane() -> str:
    # scripts/test.sh exports TENSORPLAY_MPI; `TENSORPLAY_MPI=NAME source scripts/env.sh` does
    # not, but puts the lane's .venv-NAME first, whose Python runs the tests.
    prefix = os.path.basename(sys.prefix)
    return os.environ.get("TENSORPLAY_MPI") or (
        prefix[len(".venv-"):] if prefix.startswith(".venv-") else "system")


LANE = _lane()
"""``system`` (Debian's Open MPI 4.1), ``mpich``, ``impi`` or ``openmpi5``."""

FAMILIES = {"system": "open-mpi", "mpich": "mpich", "impi": "intel-mpi", "openmpi5": "open-mpi"}
ABIS = {"system": "openmpi", "mpich": "mpich", "impi": "mpich", "openmpi5": "openmpi"}
LIBRARY_PREFIXES = {"system": "Open MPI v4.", "mpich": "MPICH Version:",
                    "impi": "Intel(R) MPI Library", "openmpi5": "Open MPI v5."}

PARALLEL_HDF5 = LANE == "system"
"""Only the system lane has h5py built against its MPI; the others use PyPI's serial h5py."""
