#!/usr/bin/env bash
# Set up (when needed), then run every test under each MPI library (lane, see env.sh):
#
#   system (Debian's Open MPI 4.1): mpiexec with 1, 2 and 4 ranks on one node, and 4 ranks over
#           2 simulated nodes, the tests marked scale at 8 ranks over 4 and those marked
#           resume_smoke at 16 ranks over 4 (as root);
#   mpich, openmpi5: 4 ranks over 2 simulated nodes (not root: 2 and 4 ranks on one node
#           instead); openmpi5 also runs the recovery tests (ULFM) on 1 rank;
#   impi:   4 ranks on one node.
#
# TENSORPLAY_MPI=NAME runs one lane only. Extra arguments go to pytest (a test file, -k EXPR).
# docs/developers.md says why each lane runs what it runs.
set -euo pipefail
here=$(dirname "${BASH_SOURCE[0]}")

if [ -z "${TENSORPLAY_MPI:-}" ]; then
    status=0
    for lane in system mpich impi openmpi5; do
        TENSORPLAY_MPI=$lane bash "$0" "$@" || status=1
    done
    exit $status
fi

bash "$here/setup.sh"
# shellcheck source=scripts/env.sh
source "$here/env.sh"
cd "$root"

# Test folders on a file system that every node sees (a node's /tmp is its own).
TMPDIR=$(mktemp -d /var/tmp/tensorplay-tests-XXXXXX)
export TMPDIR
trap 'rm -rf "$TMPDIR"' EXIT

# suite LIMIT MARKS LAUNCH...: pytest under LAUNCH (the command line before `python`), bounded by
# LIMIT seconds, on the tests marked MARKS (all when empty) among this script's arguments or,
# without any, in two runs: the rest of the suite, then tests/train (the training job in
# process). Run after the rest in the same processes, those training runs over several ranks
# now and then stalled for tens of seconds each (the mpich lane over 2 simulated nodes: 400-600
# s as one run, 226 s + 34 s as two). Status: the first failed run's, else 5 where no run
# selected a test, else 0.
args=("$@")
suite() {
    local limit=$1 marks=$2 code result=5 failed=0
    shift 2
    local parts=("--ignore=tests/train" "tests/train")
    if [ ${#args[@]} -gt 0 ]; then
        parts=("")
    fi
    for part in "${parts[@]}"; do
        code=0
        timeout "$limit" "$@" python -m pytest --with-mpi -q ${marks:+-m "$marks"} \
            ${part:+"$part"} ${args[@]+"${args[@]}"} || code=$?
        if [ "$code" -ne 0 ] && [ "$code" -ne 5 ] && [ "$failed" -eq 0 ]; then
            failed=$code
        fi
        if [ "$code" -eq 0 ]; then
            result=0
        fi
    done
    if [ "$failed" -ne 0 ]; then
        return "$failed"
    fi
    return "$result"
}

status=0
case $lane in
    system) rank_counts=(1 2 4); nodes=yes ;;
    impi) rank_counts=(4); nodes=no ;;
    *) rank_counts=(); nodes=yes ;;
esac
if [ "$nodes" = yes ] && [ "$(id -u)" -ne 0 ] && [ "$lane" != system ]; then
    rank_counts=(2 4)   # without the pass over nodes, 2 and 4 ranks on one node
fi

if [ "$lane" = system ]; then
    echo "=== shellcheck and the documentation ==="
    if command -v shellcheck >/dev/null 2>&1; then
        shellcheck jobs/*.sh jobs/*.sbatch scripts/*.sh || { echo "=== shellcheck FAILED ==="; status=1; }
    else
        echo "no shellcheck on PATH: shell scripts not checked"
    fi
    mkdocs build --strict --quiet --site-dir "$root/site" || { echo "=== mkdocs FAILED ==="; status=1; }
fi

for ranks in "${rank_counts[@]}"; do
    echo "=== $lane: pytest under mpiexec -n $ranks ==="
    # A whole run is bounded too, in case a rank wedges outside a test's own timeout.
    # (The 1-rank pass, with the jobs the tests launch, takes about twenty minutes.)
    if ! suite 2700 "" "${MPIEXEC[@]}" -n "$ranks"; then
        echo "=== $lane: FAILED with $ranks ranks ==="
        status=1
    fi
done
if [ "$lane" = openmpi5 ] && [ $# -eq 0 ]; then
    # ULFM (recovery from a lost rank) needs Open MPI 5; these tests launch jobs of their own.
    echo "=== $lane: the recovery tests (ULFM) under mpiexec -n 1 ==="
    if ! timeout 900 "${MPIEXEC[@]}" -n 1 python -m pytest --with-mpi -q \
            tests/comm/test_fault_tolerance.py tests/train/test_recovery.py \
            tests/optim/test_distributed_optimizer_recovery.py; then
        echo "=== $lane: the recovery tests FAILED ==="
        status=1
    fi
fi
if [ "$nodes" = yes ] && [ "$(id -u)" -eq 0 ]; then
    echo "=== $lane: pytest under mpiexec -n 4 over 2 simulated nodes of 2 ranks (TCP between them) ==="
    if ! suite 1800 "" python tests/support/simulated_nodes.py --nodes 2 --slots 2 --mpiexec -- \
            "${MPIEXEC[@]:1}" -n 4; then
        echo "=== $lane: FAILED with 4 ranks over 2 nodes ==="
        status=1
    fi
    if [ "$lane" = system ]; then
        # The tests marked `scale` depend on the rank count or the node layout: again at 8 ranks
        # over 4 nodes.
        echo "=== $lane: tests marked scale under mpiexec -n 8 over 4 simulated nodes of 2 ranks ==="
        scale=0
        suite 1200 scale python tests/support/simulated_nodes.py --nodes 4 --slots 2 \
            --mpiexec -- "${MPIEXEC[@]:1}" -n 8 || scale=$?
        if [ "$scale" -ne 0 ] && [ "$scale" -ne 5 ]; then   # 5: none of the tests is marked
            echo "=== $lane: FAILED with 8 ranks over 4 nodes ==="
            status=1
        fi
        # The training job's exact resume after a preemption, every --optimizer, in process.
        echo "=== $lane: tests marked resume_smoke under mpiexec -n 16 over 4 simulated nodes ==="
        smoke=0
        timeout 900 python tests/support/simulated_nodes.py --nodes 4 --slots 4 --mpiexec -- \
            "${MPIEXEC[@]:1}" -n 16 python -m pytest --with-mpi -q -m resume_smoke \
            "${@:-tests/train}" || smoke=$?
        if [ "$smoke" -ne 0 ] && [ "$smoke" -ne 5 ]; then
            echo "=== $lane: FAILED with 16 ranks over 4 nodes ==="
            status=1
        fi
    fi
elif [ "$nodes" = yes ]; then
    echo "=== $lane: not root: the pass over simulated nodes (Linux namespaces) is skipped ==="
fi
if [ "$lane" = system ] && python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "=== GPU checks ==="
    "${MPIEXEC[@]}" -n 2 python tests/support/gpu_check.py || status=1
fi
exit $status
