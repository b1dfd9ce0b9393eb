"""The run folder: what a run leaves there (metrics, plot, settings, checkpoints), and the rule
that a new run never writes over the files of an earlier one."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict

import tensorplay_hpc

from .config import TrainConfig, UsageError

METRICS_FILE = "metrics.csv"
PLOT_FILE = "loss.png"
SETTINGS_FILE = "settings.json"


class RunFolderInUse(UsageError):
    """A run without ``--resume`` would write over an earlier run's metrics and checkpoints."""


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


def write_settings(config: TrainConfig, ranks: int, step: int) -> Path:
    """Write the run's settings (with the number of ranks, the step it starts at and the
    package version) to ``RUN_DIR/settings.json``. Local: call it on one rank."""
    settings: Dict[str, Any] = {**config.describe(), "ranks": ranks, "started_at_step": step,
                                "version": tensorplay_hpc.__version__}
    path = config.run_dir / SETTINGS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
    return path
