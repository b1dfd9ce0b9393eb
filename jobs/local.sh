#!/usr/bin/env bash
# Train on a workstation with mpiexec, resuming from the newest checkpoint if there is one.
#
#   jobs/local.sh [train options]          RANKS=4 jobs/local.sh --steps 1000
#
# RANKS (default 2) processes; options go to `tensorplay-hpc train` (see --help). Ctrl-C
# aborts; `kill -USR1` or `kill -TERM` of this script (or of mpiexec) makes the ranks
# checkpoint and stop with exit status 85: run the script again to continue from there.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=jobs/preemptible.sh
source "$root/jobs/preemptible.sh"
if [ -f "$root/scripts/env.sh" ]; then
    # shellcheck source=scripts/env.sh
    source "$root/scripts/env.sh"
else
    MPIEXEC=(mpiexec)
fi
version=$(mpiexec --version 2>/dev/null || true)
if [[ $version == *"Open MPI"* || $version == *"OpenRTE"* ]]; then
    # No "process returned a non-zero exit code" banner: status 85 is a planned stop.
    MPIEXEC+=(--quiet)
fi

# Open MPI gives each rank a pseudo-terminal even when this script's output goes to a file:
# without a terminal here, ask for progress lines instead of a progress bar.
output=()
[ -t 1 ] || output=(--no-progress)

status=0
run_preemptible "${MPIEXEC[@]}" -n "${RANKS:-2}" python -m tensorplay_hpc train --resume \
    "${output[@]}" "$@" || status=$?
if [ "$status" -eq "$EXIT_PREEMPTED" ]; then
    echo "[job] stopped at a checkpoint: run $0 again with the same options to resume"
fi
exit "$status"
