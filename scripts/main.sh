#!/usr/bin/env bash
# Set up (when needed), then run the main job: `tensorplay-hpc train` on 2 ranks under mpiexec,
# a character-level transformer learning the source of Python's standard library. Partway through
# (just after its first periodic checkpoint) the job is sent SIGUSR1, as Slurm does before a time
# limit: the ranks write a checkpoint and stop; the job is started again and resumes from that
# checkpoint to the end. Prints where the loss plot, the metrics and the checkpoints are.
#
#   bash scripts/main.sh [train options]      e.g. --optimizer postlocal --steps 600
#
# RANKS (default 2) processes; RUN_DIR (default runs/main-DATE-TIME) for the files.
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

echo "=== training on $RANKS ranks; after the first checkpoint, SIGUSR1 simulates a preemption ==="
bash jobs/local.sh --run-dir "$run_dir" "$@" &
job=$!
while kill -0 "$job" 2>/dev/null && ! compgen -G "$run_dir/checkpoints/step-*.h5" >/dev/null; do
    sleep 1
done
kill -USR1 "$job" 2>/dev/null || true
status=0
wait "$job" || status=$?
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
