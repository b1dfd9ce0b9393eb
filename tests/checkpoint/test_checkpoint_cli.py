"""Tests of ``tensorplay-hpc checkpoint info|list|export|import`` (and ``python -m
tensorplay_hpc.checkpoint``), run as real commands on files made here."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import tensorplay_hpc
from tensorplay_hpc import checkpoint
from launch import ONLY_UNDER_ONE_RANK, REPO, clean_env, mpiexec_command, single_rank
from test_checkpoint import corrupt

pytestmark = pytest.mark.skipif(not single_rank(), reason=ONLY_UNDER_ONE_RANK)

COMMANDS = {"tensorplay-hpc": ["-m", "tensorplay_hpc", "checkpoint"],
            "module": ["-m", "tensorplay_hpc.checkpoint"]}


def command(*arguments, via="tensorplay-hpc") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *COMMANDS[via], *map(str, arguments)], cwd=REPO,
                          env=clean_env(), capture_output=True, text=True, timeout=300)


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def trained(seed=0):
    """A model and an AdamW optimizer after two steps (so the state holds real values)."""
    model = make_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.03, weight_decay=0.1)
    for step in range(2):
        optimizer.zero_grad()
        torch.manual_seed(100 + step)
        model(torch.randn(5, 4)).square().sum().backward()
        optimizer.step()
    return model, optimizer


def assert_same_state(model, optimizer, expected_model, expected_optimizer):
    for (key, value), (other_key, other) in zip(model.state_dict().items(),
                                                expected_model.state_dict().items()):
        assert key == other_key and torch.equal(value, other)
    if optimizer is not None:
        ours, theirs = optimizer.state_dict(), expected_optimizer.state_dict()
        assert ours["param_groups"] == theirs["param_groups"]
        assert sorted(ours["state"]) == sorted(theirs["state"]) == [0, 1, 2, 3]
        for index, state in theirs["state"].items():
            assert sorted(ours["state"][index]) == sorted(state)
            for key, value in state.items():
                assert torch.equal(ours["state"][index][key], value)


def one_error_line(result, status=2):
    assert result.returncode == status, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize("layout", ["export", "tutorial", "state_dict", "bare"])
def test_import_accepts_the_common_layouts_and_loads_exactly(tmp_path, layout):
    model, optimizer = trained()
    source, target = tmp_path / "source.pt", tmp_path / "imported.h5"
    with_optimizer = layout in ("export", "tutorial")
    if layout == "export":              # what `checkpoint export` writes
        saved = checkpoint.save(str(tmp_path / "saved.h5"), model, optimizer)
        result = command("export", saved, source)
        assert (result.returncode, result.stdout) == (0, f"wrote {source}\n"), result.stderr
    elif layout == "tutorial":          # PyTorch's "saving a general checkpoint" recipe
        torch.save({"epoch": 3, "model_state_dict": model.state_dict(),
                    "optimizer_state_dict": optimizer.state_dict(),
                    "loss": torch.tensor(0.25)}, source)
    elif layout == "state_dict":
        torch.save({"state_dict": model.state_dict()}, source)
    else:
        torch.save(model.state_dict(), source)
    options = ["--optimizer-class", "torch.optim.AdamW"] if with_optimizer else []
    via = "module" if layout in ("tutorial", "bare") else "tensorplay-hpc"
    result = command("import", source, target, *options, via=via)
    assert (result.returncode, result.stdout, result.stderr) == (0, f"wrote {target}\n", "")

    fresh = make_model(seed=7)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.5) if with_optimizer else None
    extra = checkpoint.load(str(target), fresh, fresh_optimizer)
    assert_same_state(fresh, fresh_optimizer, model, optimizer)
    if layout == "tutorial":
        assert sorted(extra) == ["epoch", "loss"] and extra["epoch"] == 3
        assert torch.equal(extra["loss"], torch.tensor(0.25))
    else:
        assert extra == {}
    summary = json.loads(command("info", "--json", target).stdout)
    assert summary["optimizer"] == (None if not with_optimizer else {
        "class": "torch.optim.adamw.AdamW", "kind": "local", "param_groups": 1,
        "state_entries": 4, "values": 4 + 2 * 23, "attributes": {}})
    assert summary["model"] == {"class": "imported", "entries": 4, "values": 12 + 3 + 6 + 2}


def test_import_refuses_an_unknown_layout_listing_its_keys(tmp_path):
    model, _ = trained()
    source = tmp_path / "odd.pt"
    torch.save({"weights": model.state_dict(), "epoch": 3}, source)
    line = one_error_line(command("import", source, tmp_path / "out.h5"))
    assert line == (f"error: {source}: unknown layout, keys found: ['weights', 'epoch']; "
                    "expected 'model' and 'optimizer', 'model_state_dict' and "
                    "'optimizer_state_dict', 'state_dict', or a model state_dict (every value a "
                    "tensor)")
    torch.save({"model": {"weight": torch.ones(2), "note": "x"}}, source)
    line = one_error_line(command("import", source, tmp_path / "out.h5", via="module"))
    assert line == f"error: {source}: 'model' is not a model state_dict (not tensors: ['note'])"
    assert not (tmp_path / "out.h5").exists()


def test_import_of_a_missing_or_unreadable_file_is_one_line(tmp_path):
    missing = tmp_path / "missing.pt"
    assert one_error_line(command("import", missing, tmp_path / "out.h5")) == \
        f"error: {missing}: no such file"
    junk = tmp_path / "junk.pt"
    junk.write_text("not a torch file")
    line = one_error_line(command("import", junk, tmp_path / "out.h5", via="module"))
    assert line.startswith(f"error: {junk}: cannot read it as a torch.save file: ")
    assert one_error_line(command("import", tmp_path, tmp_path / "out.h5")) == \
        f"error: {tmp_path}: is a folder, not a torch.save file"
    assert not (tmp_path / "out.h5").exists()


def test_import_resolves_and_checks_the_optimizer_class(tmp_path):
    model, optimizer = trained()
    source, target = tmp_path / "plain.pt", tmp_path / "out.h5"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, source)
    assert one_error_line(command("import", source, target)) == (
        f"error: {source}: holds optimizer state: name its class with --optimizer-class (for "
        "example torch.optim.AdamW)")
    assert one_error_line(command("import", source, target, "--optimizer-class",
                                  "torch.optim.lr_scheduler.StepLR")) == (
        "error: --optimizer-class torch.optim.lr_scheduler.StepLR: optimizer_class must be a "
        "torch.optim.Optimizer subclass, got the class StepLR, which is not an Optimizer "
        "subclass")
    assert one_error_line(command("import", source, target, "--optimizer-class",
                                  "torch.optim.AdamX")) == (
        "error: --optimizer-class torch.optim.AdamX: no such class (give it as a module path, "
        "e.g. torch.optim.AdamW)")
    torch.save(model.state_dict(), tmp_path / "bare.pt")
    assert one_error_line(command("import", tmp_path / "bare.pt", target, "--optimizer-class",
                                  "AdamW")) == (
        f"error: {tmp_path / 'bare.pt'}: --optimizer-class AdamW given, but the file holds no "
        "optimizer state")
    assert not target.exists()
    # Short and full names record the class that checkpoint.load compares.
    for name in ("AdamW", "torch.optim.adamw.AdamW"):
        assert command("import", source, target, "--optimizer-class", name).returncode == 0
        assert json.loads(command("info", "--json", target).stdout)["optimizer"]["class"] == \
            "torch.optim.adamw.AdamW"


def test_help_names_the_inputs_and_outputs():
    for via in COMMANDS:
        result = command("import", "--help", via=via)
        assert result.returncode == 0, result.stderr
        text = " ".join(result.stdout.split())
        assert "usage: tensorplay-hpc checkpoint import [-h] [--optimizer-class CLASS] SOURCE " \
               "CHECKPOINT" in text
        for words in ("Read SOURCE with torch.load(weights_only=True) and write the checkpoint "
                      "CHECKPOINT.", "'model_state_dict'", "become the extras checkpoint.load "
                      "returns.", "SOURCE the torch.save file (.pt) to read",
                      "CHECKPOINT the checkpoint file (.h5) to write"):
            assert words in text
    text = " ".join(command("--help").stdout.split())
    assert "2 for a bad argument or an input file that cannot be imported." in text
    for action in ("info", "list", "export", "import"):
        assert f" {action} " in text
    text = " ".join(command("export", "--help").stdout.split())
    assert "CHECKPOINT the checkpoint file (.h5) to read OUTPUT the torch.save file (.pt) to " \
           "write" in text
    assert "checkpoint" in " ".join(subprocess.run(
        [sys.executable, "-m", "tensorplay_hpc", "--help"], cwd=REPO, env=clean_env(),
        capture_output=True, text=True, timeout=300).stdout.split())


def test_version():
    for via in COMMANDS:
        result = command("--version", via=via)
        assert (result.returncode, result.stdout) == (
            0, f"tensorplay-hpc {tensorplay_hpc.__version__}\n"), result.stderr


def test_info_json_and_text(tmp_path):
    model, optimizer = trained()
    path = checkpoint.save(str(tmp_path / "step-7.h5"), model, optimizer, extra={"step": 7})
    result = command("info", "--json", path)
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 1
    summary = json.loads(result.stdout)
    with checkpoint.Reader(path) as reader:
        created, tensors = reader.metadata["created"], len(reader.catalog.names)
    assert tensors == 4 + 4 * 3          # the model's entries, then step, exp_avg, exp_avg_sq each
    assert summary == {
        "path": path, "format_version": 5, "package_version": tensorplay_hpc.__version__,
        "torch_version": torch.__version__, "world_size": 1, "step": 7, "created": created,
        "replicas": 1, "model": {"class": "Sequential", "entries": 4, "values": 23},
        "optimizer": {"class": "torch.optim.adamw.AdamW", "kind": "local", "param_groups": 1,
                      "state_entries": 4, "values": 4 + 2 * 23, "attributes": {}},
        "extra_ranks": 1, "extra_rank0": ["step"], "tensors": tensors,
        "tensor_bytes": 4 * 23 + 4 * 4 + 2 * 4 * 23, "bytes": os.path.getsize(path),
        "checksums_verified": True}
    result = command("info", path, via="module")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"checkpoint {path}"
    assert "  step: 7" in lines and "  world_size: 1" in lines and "  format_version: 5" in lines
    assert "  model: Sequential, 4 entries, 23 values" in lines
    assert ("  optimizer: torch.optim.adamw.AdamW (local), 1 param groups, state for 4 "
            "parameters, 50 values") in lines
    assert lines[-1] == "  checksums: all verified"
    corrupt(path, "model/0.weight", 2)
    line = one_error_line(command("info", "--json", path), status=1)
    assert line == f"error: {path}: checksum mismatch in dataset 'model/0.weight': the file is " \
                   "corrupted"
    assert one_error_line(command("info", tmp_path / "none.h5"), status=1) == \
        f"error: {tmp_path / 'none.h5'}: no such checkpoint file"


def test_list_oldest_first_marking_the_newest_good_one(tmp_path):
    model, optimizer = trained()
    # Names in another order than creation: the list follows the recorded creation time.
    paths = [checkpoint.save(str(tmp_path / name), model, optimizer, extra={"step": step})
             for name, step in (("c.h5", 10), ("a.h5", 20), ("b.h5", 30))]
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    corrupt(paths[2], "model/0.weight")
    assert checkpoint.latest(str(tmp_path)) == paths[1]
    result = command("list", tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert re.split(r"\s+", lines[0]) == ["STEP", "CREATED", "SIZE", "FILE"]
    rows = [re.split(r"\s{2,}", line.strip()) for line in lines[1:]]
    for row, path in zip(rows, paths):
        with checkpoint.Reader(path) as reader:
            step, created = reader.metadata["step"], reader.metadata["created"]
        kib = f"{os.path.getsize(path) / 1024:.1f} KiB"
        assert row[:4] == [str(step), created, kib, os.path.basename(path)]
    assert [row[0] for row in rows] == ["10", "20", "30"]
    assert [row[4:] for row in rows] == [[], ["<- latest"], ["(checksums do not verify)"]]
    empty = tmp_path / "empty"
    empty.mkdir()
    result = command("list", empty, via="module")
    assert (result.returncode, result.stdout) == (0, f"no checkpoints in {empty}\n")
    assert one_error_line(command("list", tmp_path / "nowhere")) == \
        f"error: {tmp_path / 'nowhere'}: no such folder"


def test_under_mpiexec_only_the_first_rank_acts(tmp_path):
    model, optimizer = trained()
    path = checkpoint.save(str(tmp_path / "one.h5"), model, optimizer, extra={"step": 1})
    result = subprocess.run(mpiexec_command(2, [*COMMANDS["tensorplay-hpc"], "info", "--json",
                                                path]),
                            cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 1 and json.loads(result.stdout)["step"] == 1
