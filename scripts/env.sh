# shellcheck shell=bash disable=SC2034  # sourced: MPIEXEC is used by the scripts that source it
# Sourced by the scripts here: the virtual environment and the mpiexec flags for this machine.
#
# TENSORPLAY_MPI picks the MPI library (the lane): `system` (default: the MPI on PATH, Debian's
# Open MPI 4.1 here, with .venv), or a PyPI wheel in .venv-NAME that scripts/setup.sh makes:
# `mpich` (MPICH 5, the ABI of Cray MPICH and MVAPICH), `impi` (Intel MPI) or `openmpi5`.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
lane=${TENSORPLAY_MPI:-system}
if [ "$lane" = system ]; then
    export PATH="$root/.venv/bin:$PATH"
else
    export PATH="$root/.venv-$lane/bin:$root/.venv/bin:$PATH"
fi
if [ "$(id -u)" -eq 0 ]; then
    # Open MPI refuses to start as root without these.
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
# Large torch tensors on transparent huge pages, as numpy does: MPI copies them faster.
export THP_MEM_ALLOC_ENABLE=1
# More ranks than cores: waiting ranks yield the CPU instead of spinning, in each library's words.
case $lane in
    system)
        MPIEXEC=(mpiexec --oversubscribe --mca mpi_yield_when_idle 1 -x THP_MEM_ALLOC_ENABLE) ;;
    openmpi5)
        export PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
        MPIEXEC=(mpiexec --mca mpi_yield_when_idle 1 -x THP_MEM_ALLOC_ENABLE) ;;
    mpich)
        export FI_PROVIDER=tcp UCX_TLS=tcp,sm,self MPIR_CVAR_CH4_PROGRESS_THROTTLE=true \
            MPIR_CVAR_POLLS_BEFORE_YIELD=1
        MPIEXEC=(mpiexec) ;;
    impi)
        export I_MPI_FABRICS=shm FI_PROVIDER=tcp FI_TCP_IFACE=lo I_MPI_PIN=0
        MPIEXEC=(mpiexec) ;;
    *)
        echo "TENSORPLAY_MPI=$lane: choose system, mpich, impi or openmpi5" >&2
        return 2 ;;
esac
# The same launch for jobs that tests start themselves (tests/support/launch.py reads it).
export TENSORPLAY_MPIEXEC="${MPIEXEC[*]}"
