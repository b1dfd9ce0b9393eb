# shellcheck shell=bash
# Sourced by the job scripts: run a training command so that a preemption warning reaches it.
#
# run_preemptible CMD ARGS... starts CMD in the background, turns SIGUSR1 and SIGTERM received
# by this shell (Slurm's `--signal=B:USR1@...`, a scheduler's TERM, `kill`) into SIGUSR1 for
# CMD (srun and mpiexec forward it to every rank), and returns CMD's exit status. The training
# then finishes its step, checkpoints and exits with EXIT_PREEMPTED.

# Exit status of `tensorplay-hpc train` after a checkpoint written on a signal (resume it).
EXIT_PREEMPTED=85
# Exit status of the survivors of a lost rank that `train --recover` could not go on with
# (resume from the last checkpoint).
EXIT_UNRECOVERABLE=86

# srun options for such a training. Its planned stop is a non-zero status, which ranks on
# different nodes reach seconds apart (MPI_Finalize waits only for the ranks of its own node):
# --kill-on-bad-exit (or a site's KillOnBadExit=1) would cancel the ranks still finishing at
# the first 85, and srun would fail instead of returning 85. So the step is not cancelled on a
# non-zero status, but ends at most 60 s after its first rank does (a rank killed by a signal
# makes PMIx cancel the step at once).
# shellcheck disable=SC2034 # used by the scripts that source this file
PREEMPTIBLE_SRUN=(srun --kill-on-bad-exit=0 --wait=60)

run_preemptible() {
    local child status forwarded
    "$@" &
    child=$!
    forwarded=0
    # shellcheck disable=SC2064 # the child's pid is fixed now, on purpose
    trap "forwarded=1; echo \"[job] \$(date +%T) signal received: asking the training to checkpoint and stop\"; kill -USR1 $child 2>/dev/null || true" USR1 TERM
    while :; do
        status=0
        wait "$child" || status=$?
        # A trapped signal interrupts `wait` with a status above 128: wait again for the child.
        if [ "$forwarded" -eq 1 ] && [ "$status" -gt 128 ]; then
            forwarded=0
            continue
        fi
        break
    done
    trap - USR1 TERM
    return "$status"
}

# run_requeueable CMD ARGS... (in a Slurm batch script): run_preemptible CMD; when it stopped at
# a checkpoint, or lost a rank it could not recover from, requeue this job (the next run
# resumes from the last checkpoint) and exit 0; otherwise exit with its status.
run_requeueable() {
    local status=0
    run_preemptible "$@" || status=$?
    if [ "$status" -eq "$EXIT_PREEMPTED" ] || [ "$status" -eq "$EXIT_UNRECOVERABLE" ]; then
        if [ "$status" -eq "$EXIT_PREEMPTED" ]; then
            echo "[job] $(date +%T) checkpoint written: requeueing job $SLURM_JOB_ID to resume"
        else
            echo "[job] $(date +%T) a rank was lost: requeueing job $SLURM_JOB_ID to resume"
        fi
        scontrol requeue "$SLURM_JOB_ID"
        exit 0
    fi
    echo "[job] $(date +%T) training exited with status $status"
    exit "$status"
}
