"""Every code block of README.md and docs/ runs as written: Python on 2 ranks under mpiexec,
shell commands with the virtual environment on PATH, each page's blocks in order in a folder of
their own; blocks that are not run say why on the page (see doc_blocks.py)."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tensorplay_hpc
from doc_blocks import pages, plan
from launch import ONLY_UNDER_ONE_RANK, REPO, clean_env, mpiexec_command, single_rank

pytestmark = pytest.mark.skipif(not single_rank(), reason=ONLY_UNDER_ONE_RANK)
RANKS = 2


def _check_checkpoints(folder: Path, output: str) -> None:
    assert (folder / "ckpt" / "step-0001000.h5").is_file()
    assert (folder / "out.pt").is_file() and (folder / "back.h5").is_file()
    summary = json.loads(next(line for line in output.splitlines() if line.startswith("{")))
    assert set(summary) == {
        "path", "format_version", "package_version", "torch_version", "world_size", "step",
        "created", "replicas", "model", "optimizer", "extra_ranks", "extra_rank0", "tensors",
        "tensor_bytes", "bytes", "checksums_verified"}
    assert (summary["world_size"], summary["step"]) == (RANKS, 1000)


def _check_environment(folder: Path, output: str) -> None:
    assert isinstance(json.loads((folder / "env.json").read_text()), dict)


def _check_install(folder: Path, output: str) -> None:
    lines = output.splitlines()
    assert lines[0] == f"tensorplay-hpc {tensorplay_hpc.__version__}"
    # each rank prints its rank; mpiexec may forward the two lines' characters interleaved
    assert sorted("".join(lines[1:])) == ["0", "1"]


def _check_migrating(folder: Path, output: str) -> None:
    assert (folder / "ckpt" / "step0000000.h5").is_file()


# What a page says its blocks produce, checked after they ran.
RESULTS = {
    "docs/checkpoints.md": _check_checkpoints,
    "docs/environment.md": _check_environment,
    "docs/install.md": _check_install,
    "docs/migrating.md": _check_migrating,
}


def test_every_block_is_run_output_or_marked_not_run():
    unaccounted = [problem for page in pages() for problem in plan(page)[1]]
    assert not unaccounted, "\n".join(unaccounted)


def test_every_page_with_results_runs_something():
    assert all(plan(page)[0] for page in RESULTS)


@pytest.mark.parametrize("page", [page for page in pages() if plan(page)[0]])
def test_page_blocks_run_as_written(page, tmp_path):
    env = clean_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    output = ""
    for step in plan(page)[0]:
        if step.language == "python":
            script = tmp_path / f"block_{step.block.line}.py"
            script.write_text(step.script)
            command = mpiexec_command(RANKS, [str(script)])
        else:
            command = ["bash", "-e", "-o", "pipefail", "-c", step.script]
        result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0, (
            f"{step.block.where} ({step.language}) exited with {result.returncode}:\n"
            f"{step.block.text}\n--- stdout\n{result.stdout[-3000:]}\n"
            f"--- stderr\n{result.stderr[-3000:]}")
        if step.language == "bash":
            output += result.stdout
    if page in RESULTS:
        RESULTS[page](tmp_path, output)


REFERENCE_PAGES = {"checkpoint", "comm", "model-averaging", "optim", "parallel", "rma"}
OPTIM = "tensorplay_hpc.distributed.optim"


def test_api_reference_builds_and_its_sphinx_roles_become_links_or_code(tmp_path):
    site = tmp_path / "site"
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                             "--site-dir", str(site)], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    pages = {page.parent.name: page.read_text()
             for page in (site / "reference").glob("*/index.html")}
    assert set(pages) == REFERENCE_PAGES
    raw = {name: sorted(set(re.findall(r":(?:class|func|meth|mod|attr|data|exc|obj):", text)))
           for name, text in pages.items()}
    assert not any(raw.values()), raw
    optim = pages["optim"]
    assert f'id="{OPTIM}.zero_redundancy_optimizer.ZeroRedundancyOptimizer"' in optim
    # A role naming an object of the reference links to its entry, on its page or another...
    step = f"{OPTIM}.post_localSGD_optimizer.PostLocalSGDOptimizer.step"
    assert re.search(rf'<a [^>]*href="#{re.escape(step)}"[^>]*><code>step\(\)</code></a>', optim)
    averager = "tensorplay_hpc.distributed.algorithms.model_averaging.averagers.ModelAverager"
    assert f'href="../model-averaging/#{averager}"' in optim
    # ...and one naming an object the reference leaves out is inline code.
    assert f'<span title="{OPTIM}.ddp_overlap"><code>ddp_overlap</code></span>' in optim
    assert "Example::" not in optim
