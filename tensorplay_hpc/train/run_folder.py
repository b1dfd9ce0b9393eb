"""The run folder: what a run leaves there (metrics, plot, settings, checkpoints), and the rules
that a run starts only where it can write, a new run never writes over the files of an earlier
one, and a resume never writes over checkpoints it cannot continue."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List

import tensorplay_hpc
from tensorplay_hpc import checkpoint
from tensorplay_hpc.checkpoint.format import extra_group

from .config import TrainConfig, UsageError

__all__ = ["CheckpointsDoNotFit", "METRICS_FILE", "PLOT_FILE", "RunFolderInUse", "SETTINGS_FILE",
           "check_unused", "check_writable", "resumable", "write_settings"]

METRICS_FILE = "metrics.csv"
PLOT_FILE = "loss.png"
SETTINGS_FILE = "settings.json"


class RunFolderInUse(UsageError):
    """A run without ``--resume`` would write over an earlier run's metrics and checkpoints."""


class CheckpointsDoNotFit(UsageError):
    """``--resume`` with settings that none of the run's checkpoints was written with."""


def check_writable(config: TrainConfig) -> None:
    """Raise :class:`UsageError` when ``--run-dir``, ``--checkpoint-dir`` or ``--trace`` is a
    file, lies under one, or lies where this process cannot create files (a read-only file
    system, no permission). Creates nothing. Local: call it on one rank."""
    for option, folder in (("--run-dir", config.run_dir),
                           ("--checkpoint-dir", config.checkpoint_dir), ("--trace", config.trace)):
        if folder is not None:
            try:
                _check_folder(option, folder)
            except OSError as error:
                raise UsageError(f"{option} {folder}: {error.strerror or error}") from None


def _check_folder(option: str, folder: Path) -> None:
    existing = folder.absolute()
    while not existing.exists():
        existing = existing.parent
    where = f"{option} {folder}" + ("" if existing == folder.absolute() else f": {existing}")
    if not existing.is_dir():
        raise UsageError(f"{where} is a file, not a folder")
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        raise UsageError(f"{where} is on a read-only file system")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{where} is not writable by this user")


def check_unused(config: TrainConfig) -> None:
    """Raise :class:`RunFolderInUse` when ``config`` starts afresh (no ``--resume``) in a folder
    that already holds a run's metrics or checkpoints. Local: call it on one rank."""
    if config.resume:
        return
    found = [path for path in (config.run_dir / METRICS_FILE, config.run_dir / SETTINGS_FILE)
             if path.exists()]
    if config.checkpoint_dir.is_dir():
        found += sorted(config.checkpoint_dir.glob("*.h5"))[:1]
    if found:
        raise RunFolderInUse(
            f"{config.run_dir} holds an earlier run ({found[0]} exists): pass --resume to "
            "continue it, or choose another --run-dir for a new run")


def resumable(config: TrainConfig) -> List[str]:
    """The checkpoints ``--resume`` may continue from, oldest first: those of
    ``config.checkpoint_dir`` written with the settings that shape the model and the optimizer
    state (or whose settings cannot be read: loading them judges). Empty without ``--resume``.
    Local: call it on one rank.

    Raises:
        CheckpointsDoNotFit: the folder holds checkpoints and none fits, naming the settings
            that differ from the newest checkpoint's.
    """
    if not config.resume:
        return []
    found = checkpoint.checkpoints(str(config.checkpoint_dir))
    unfit = {path: config.unfit_for(_saved_settings(path)) for path in found}
    fitting = [path for path in found if not unfit[path]]
    if found and not fitting:
        raise CheckpointsDoNotFit(
            f"--resume: {'; '.join(unfit[found[-1]])}: no checkpoint in {config.checkpoint_dir} "
            "fits this run, and nothing was written; resume with the checkpoints' settings, or "
            "choose another --run-dir for a new run")
    return fitting


def _saved_settings(path: str) -> Dict[str, Any]:
    """The run settings rank 0 saved in the extras of checkpoint ``path``; empty when they
    cannot be read."""
    try:
        with checkpoint.Reader(path) as reader:
            extras = reader.decoded(extra_group(0), default={})
    except checkpoint.CheckpointError:
        return {}
    saved = extras.get("config") if isinstance(extras, dict) else None
    return saved if isinstance(saved, dict) else {}


def write_settings(config: TrainConfig, ranks: int, step: int) -> Path:
    """Write the run's settings (with the number of ranks, the step it starts at and the
    package version) to ``RUN_DIR/settings.json``. Local: call it on one rank."""
    settings: Dict[str, Any] = {**config.describe(), "ranks": ranks, "started_at_step": step,
                                "version": tensorplay_hpc.__version__}
    path = config.run_dir / SETTINGS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
    return path
