"""Tests of the ``tensorplay-hpc`` command: version, help printed once under mpiexec, usage
errors with status 2 and no traceback, and progress lines for batch logs."""
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import tensorplay_hpc
from tensorplay_hpc.train.progress import Progress
from launch import ONLY_UNDER_ONE_RANK, REPO, clean_env, mpiexec_command, single_rank
from train_launch import on_read_only_mount, train_command

pytestmark = pytest.mark.skipif(not single_rank(), reason=ONLY_UNDER_ONE_RANK)


def run(command, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=kwargs.pop("cwd", REPO), env=clean_env(),
                          capture_output=True, text=True, timeout=300, **kwargs)


def test_version_on_every_command():
    expected = f"tensorplay-hpc {tensorplay_hpc.__version__}\n"
    for arguments in (["--version"], ["train", "--version"], ["bench", "--version"]):
        result = run([sys.executable, "-m", "tensorplay_hpc", *arguments])
        assert (result.returncode, result.stdout) == (0, expected), result.stderr
    assert tensorplay_hpc.__version__ == "0.1.0"


def test_help_and_usage_errors_print_once_under_mpiexec():
    result = run(mpiexec_command(2, ["-m", "tensorplay_hpc", "train", "--help"]))
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("usage: tensorplay-hpc train") == 1
    result = run(mpiexec_command(2, ["-m", "tensorplay_hpc", "train", "--optimizer", "adam"]))
    assert result.returncode != 0
    assert result.stderr.count("invalid choice: 'adam'") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_device_cuda_without_a_gpu_is_a_usage_error_on_every_rank(tmp_path):
    result = run(train_command(2, "--device", "cuda", "--steps", "1", "--run-dir",
                               str(tmp_path / "run")), cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("error: --device cuda, but ranks [0, 1] of 2 see no GPU") == 1
    assert "Traceback" not in result.stderr and "MPI_ABORT" not in result.stderr


@pytest.mark.timeout(300)   # six jobs, three at a time, each starting MPI and PyTorch
def test_bad_options_and_unusable_folders_are_usage_errors_before_any_work(tmp_path):
    """Each case ends with status 2 on every rank and one error line, printed once, with no
    traceback or abort, and creates nothing. Three jobs run at a time. (Every invalid setting
    takes the path of the first two: test_train.py's test_settings_are_checked has the
    messages of the others.)"""
    a_file, read_only = tmp_path / "a-file", tmp_path / "read-only"
    a_file.write_text("not a folder\n")
    read_only.mkdir()
    run_dir = ["--run-dir", str(tmp_path / "run")]
    cases = {
        "--lr must be a positive number, got nan": train_command(2, "--lr", "nan", *run_dir),
        "--width 32 is not a multiple of --heads 3": train_command(1, "--heads", "3", *run_dir),
        "--context 99000000 is longer than the validation text allows": train_command(
            1, "--context", "99000000", *run_dir),
        f"--run-dir {read_only}/run: {read_only} is on a read-only file system":
            on_read_only_mount(read_only, train_command(1, "--run-dir", f"{read_only}/run")),
        f"--run-dir {a_file}/run: {a_file} is a file, not a folder": train_command(
            1, "--run-dir", f"{a_file}/run"),
        f"--checkpoint-dir {a_file} is a file, not a folder": train_command(
            1, "--checkpoint-dir", str(a_file), *run_dir),
    }
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = dict(zip(cases, pool.map(lambda command: run(command, cwd=tmp_path),
                                           cases.values())))
    for expected, result in results.items():
        assert result.returncode == 2, (expected, result.stdout + result.stderr)
        assert result.stderr.count("tensorplay-hpc train: error: ") == 1, (expected, result.stderr)
        assert f"tensorplay-hpc train: error: {expected}" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr and "MPI_ABORT" not in result.stderr, expected
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a-file", "read-only"]
    assert list(read_only.iterdir()) == []


def test_progress_lines_without_a_bar(capsys):
    progress = Progress(rank=0, total=5, done=0, bar=False, log_every=2)
    for step, validation in ((1, None), (2, None), (3, 2.5), (4, None), (5, 2.25)):
        progress.step(loss=3.0 - step / 10, tokens_per_second=1000.0, validation=validation)
    progress.close()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("  ETA")[0] for line in lines] == [
        "step 2/5  loss 2.8000  1,000 tok/s",
        "step 3/5  loss 2.7000  validation 2.5000  1,000 tok/s",
        "step 4/5  loss 2.6000  1,000 tok/s",
        "step 5/5  loss 2.5000  validation 2.2500  1,000 tok/s",
    ]
    assert all("\r" not in line and " ETA " in line for line in lines)
    quiet = Progress(rank=1, total=5, done=0, bar=False, log_every=1)
    quiet.step(loss=1.0, tokens_per_second=1.0)
    assert capsys.readouterr().out == ""
