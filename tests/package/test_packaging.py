"""The package as users install it: ``python -m build`` gives an sdist and a wheel; the wheel,
installed (not editable) into a fresh environment, runs a 2-rank job with the core dependencies
only, under this lane's mpiexec."""
import json
import os
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

from launch import MPIEXEC, REPO, SUPPORT, clean_env, only_in_single_rank_run

try:
    import tomllib
except ImportError:  # Python < 3.11
    tomllib = None

pytestmark = only_in_single_rank_run


def pyproject_version() -> str:
    """``tensorplay_hpc.__version__`` as the checkout states it (pyproject reads it from there)."""
    text = (REPO / "tensorplay_hpc" / "__init__.py").read_text()
    return next(line.split("=")[1].strip().strip("\"'") for line in text.splitlines()
                if line.startswith("__version__"))


def run(command, **kwargs) -> subprocess.CompletedProcess:
    timeout = kwargs.pop("timeout", 120)
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """The sdist and the wheel, built as a user builds them (the wheel from the sdist)."""
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(REPO)],
        cwd=REPO, env=clean_env())
    return out


def test_pyproject_core_and_extras():
    if tomllib is None:
        pytest.skip("tomllib needs Python 3.11")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["dependencies"] == ["torch", "mpi4py>=4", "numpy", "h5py"]
    extras = project["optional-dependencies"]
    assert extras["train"] == ["tqdm", "matplotlib"]
    assert extras["fast"] == ["isal"]
    assert {"pytest", "pytest-mpi", "pytest-timeout", "mkdocs", "build"} <= set(extras["test"])


def test_sdist_holds_the_package_and_no_tests(dist):
    version = pyproject_version()
    (sdist,) = dist.glob("tensorplay[-_]hpc-*.tar.gz")   # setuptools < 69: tensorplay-hpc-...
    assert sdist.name in (f"tensorplay_hpc-{version}.tar.gz", f"tensorplay-hpc-{version}.tar.gz")
    top = sdist.name[:-len(".tar.gz")] + "/"
    with tarfile.open(sdist) as archive:
        names = {name[len(top):] for name in archive.getnames() if name.startswith(top)}
    tracked = subprocess.run(["git", "ls-files", "tensorplay_hpc"], cwd=REPO, capture_output=True,
                             text=True).stdout.split()
    if tracked:  # in a git checkout: every tracked module of the package is in the sdist
        missing = {name for name in tracked if name.endswith(".py")} - names
        assert not missing, missing
    assert {"pyproject.toml", "README.md", "PKG-INFO", "tensorplay_hpc/__init__.py",
            "tensorplay_hpc/distributed/optim/zero_redundancy_optimizer.py"} <= names
    assert not [name for name in names if name.startswith(("tests/", "docs/", "jobs/", "scripts/"))
                or name.endswith((".pyc", ".h5")) or "__pycache__" in name]


def test_wheel_installs_and_runs_on_two_ranks(dist, tmp_path):
    version = pyproject_version()
    (wheel,) = dist.glob("tensorplay_hpc-*.whl")
    assert wheel.name == f"tensorplay_hpc-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as archive:
        assert all(name.startswith(("tensorplay_hpc/", f"tensorplay_hpc-{version}.dist-info/"))
                   for name in archive.namelist())
        metadata = archive.read(f"tensorplay_hpc-{version}.dist-info/METADATA").decode()
    assert f"\nVersion: {version}\n" in metadata
    assert 'Requires-Dist: tqdm; extra == "train"' in metadata

    # A fresh environment whose other packages (torch, mpi4py, h5py, this lane's MPI wheel)
    # come from the running one, through a .pth file processed after its own site-packages.
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    site_packages = Path(run([str(python), "-c", "import sysconfig; "
                              "print(sysconfig.get_path('purelib'))"]).stdout.strip())
    running = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    (site_packages / "zz-running-environment.pth").write_text(
        "".join(f"import site; site.addsitedir({path!r})\n" for path in sorted(running)))
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
         "--no-index", "--disable-pip-version-check", str(wheel)], timeout=180)

    env = clean_env()
    env.pop("PYTHONPATH", None)
    # mpi4py looks for libmpi beside the interpreter's environment: a lane's MPI wheel lies in
    # the running environment, not the new one.
    lane_lib = Path(sys.prefix) / "lib"
    if any(lane_lib.glob("libmpi.so*")):
        env["MPI4PY_LIBMPI"] = str(lane_lib)
    result = run([str(venv / "bin" / "tensorplay-hpc"), "--version"], cwd=tmp_path, env=env)
    assert result.stdout == f"tensorplay-hpc {version}\n"

    out = tmp_path / "found.json"
    command = [*MPIEXEC, "-n", "2", str(python), str(SUPPORT / "packaging_smoke.py"),
               str(out), str(tmp_path / "smoke.h5")]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=150)
    assert result.returncode == 0, result.stdout + result.stderr
    found = json.loads(out.read_text())
    assert [rank["size"] for rank in found] == [2, 2]
    for rank in found:
        assert rank["version"] == version
        assert Path(rank["file"]).is_relative_to(venv), rank["file"]  # the wheel's, not the checkout's
        assert rank["zero_equals_local"] and rank["loaded_equals_saved"], rank
        assert rank["step"] == 3
        assert rank["crc32_module"] == "zlib"   # isal not importable: zlib's CRC-32
        assert rank["train_status"] == 2
    assert found[0]["state_equal"]
    hint = 'tensorplay-hpc train: error: tensorplay-hpc train needs tqdm and matplotlib'
    assert result.stderr.count(hint) == 1, result.stderr
    assert 'pip install "tensorplay-hpc[train]"' in result.stderr
