#!/usr/bin/env bash
# Set up (when needed), then run the main job: `tensorplay-hpc train` on 2 ranks under mpiexec,
# a character-level transformer learning the source of Python's standard library. Partway through
# the job is sent SIGUSR1, as Slurm does before a time limit: the ranks write a checkpoint and
# stop; the job is started again and resumes from that checkpoint to the end. Prints where the
# loss plot, the metrics and the checkpoints are.
#
#   bash scripts/main.sh [train options]      e.g. --optimizer postlocal --steps 600
#
# RANKS (default 2) processes; STOP_AFTER seconds (default 60) before the simulated preemption;
# RUN_DIR (default runs/main-DATE-TIME) for the files.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
bash "$here/setup.sh"
# shellcheck source=scripts/env.sh
source "$here/env.sh"
# shellcheck source=jobs/preemptible.sh
source "$root/jobs/preemptible.sh"
cd "$root"

run_dir=$(realpath -m "${RUN_DIR:-runs/main-$(date +%Y%m%d-%H%M%S)}")
export RANKS=${RANKS:-2}
stop_after=${STOP_AFTER:-60}

echo "=== training on $RANKS ranks; SIGUSR1 after ${stop_after} s simulates a preemption ==="
status=0
timeout --preserve-status --signal=USR1 "$stop_after" \
    bash jobs/local.sh --run-dir "$run_dir" "$@" || status=$?
if [ "$status" -ne 0 ] && [ "$status" -ne "$EXIT_PREEMPTED" ]; then
    echo "=== training failed with status $status ===" >&2
    exit "$status"
fi

echo "=== starting again: the job resumes from its newest checkpoint ==="
bash jobs/local.sh --run-dir "$run_dir" "$@"

echo "=== files ==="
echo "loss plot:   $run_dir/loss.png"
echo "metrics:     $run_dir/metrics.csv"
echo "checkpoints: $run_dir/checkpoints"
