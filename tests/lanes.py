"""The MPI library lane the tests run in (``TENSORPLAY_MPI``, see scripts/env.sh) and what it
is expected to be."""
import os

LANE = os.environ.get("TENSORPLAY_MPI", "system")
"""``system`` (Debian's Open MPI 4.1), ``mpich``, ``impi`` or ``openmpi5``."""

FAMILIES = {"system": "open-mpi", "mpich": "mpich", "impi": "intel-mpi", "openmpi5": "open-mpi"}
ABIS = {"system": "openmpi", "mpich": "mpich", "impi": "mpich", "openmpi5": "openmpi"}
LIBRARY_PREFIXES = {"system": "Open MPI v4.", "mpich": "MPICH Version:",
                    "impi": "Intel(R) MPI Library", "openmpi5": "Open MPI v5."}

PARALLEL_HDF5 = LANE == "system"
"""Only the system lane has h5py built against its MPI; the others use PyPI's serial h5py."""
