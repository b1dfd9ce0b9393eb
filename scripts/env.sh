# shellcheck shell=bash disable=SC2034  # sourced: MPIEXEC is used by the scripts that source it
# Sourced by the scripts here: the virtual environment and the mpiexec flags for this machine.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PATH="$root/.venv/bin:$PATH"
if [ "$(id -u)" -eq 0 ]; then
    # Open MPI refuses to start as root without these.
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
# Large torch tensors on transparent huge pages, as numpy does: MPI copies them faster.
export THP_MEM_ALLOC_ENABLE=1
# More ranks than cores: let waiting ranks yield the CPU instead of spinning.
MPIEXEC=(mpiexec --oversubscribe --mca mpi_yield_when_idle 1 -x THP_MEM_ALLOC_ENABLE)
