"""The settings of a training run, with the defaults of ``tensorplay-hpc train``."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

__all__ = ["COMM_HOOKS", "DELTA_DTYPES", "DEVICES", "INNER_OPTIMIZERS", "OPTIMIZERS", "TrainConfig",
           "UsageError"]

OPTIMIZERS = ("zero", "postlocal", "ddp", "local", "fsdp", "hsdp", "diloco")
COMM_HOOKS = ("none", "fp16", "bf16", "powersgd", "hierarchical")
INNER_OPTIMIZERS = ("sgd", "adam", "adamw")
DEVICES = ("cpu", "cuda")
DELTA_DTYPES = ("float32", "bfloat16", "float16")

# Settings that shape the model and the optimizer's state: a run resumes only from a checkpoint
# written with the same values.
_STATE_SHAPE = ("layers", "width", "heads", "context", "inner")
# Settings that change only what is printed or how fast: a resume may change them silently.
_PRESENTATION = ("resume", "progress", "log_every", "threads", "collective_timeout", "trace",
                 "recover", "recover_every", "min_ranks")


class UsageError(ValueError):
    """A setting that cannot work for this launch; ``tensorplay-hpc train`` prints it and exits
    with status 2, as for a bad option."""


@dataclass
class TrainConfig:
    """What to train, how, and where the files go (see ``tensorplay-hpc train --help``)."""

    optimizer: str = "zero"
    inner: str = "adamw"
    lr: float = 3e-3
    batch_size: int = 32
    layers: int = 2
    width: int = 128
    heads: int = 4
    context: int = 64
    steps: int = 1600
    average_period: int = 4
    warmup_steps: int = 50
    comm_hook: str = "none"
    powersgd_rank: int = 4
    sync_every: int = 64
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    fragments: int = 1
    delta_dtype: str = "float32"
    overlap_steps: int = 0
    node_local: bool = False
    recover: bool = False
    recover_every: int = 1
    min_ranks: int = 1
    eval_every: int = 100
    eval_batches: int = 4
    run_dir: Path = Path("run")
    checkpoint_dir: Optional[Path] = None
    checkpoint_every: int = 200
    keep: int = 3
    resume: bool = False
    device: str = "cpu"
    seed: int = 0
    threads: int = 0
    collective_timeout: float = 600.0
    progress: bool = True
    log_every: int = 50
    trace: Optional[Path] = None

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        self.trace = None if self.trace is None else Path(self.trace)
        self.checkpoint_dir = Path(self.checkpoint_dir or self.run_dir / "checkpoints")
        choices = {"optimizer": OPTIMIZERS, "inner": INNER_OPTIMIZERS, "device": DEVICES,
                   "comm_hook": COMM_HOOKS, "delta_dtype": DELTA_DTYPES}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"--{name.replace('_', '-')} must be one of "
                                 f"{', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.comm_hook != "none" and self.optimizer not in ("zero", "ddp"):
            raise ValueError(f"--comm-hook {self.comm_hook} needs --optimizer zero or ddp (the "
                             "DistributedDataParallel kinds; postlocal has its own hook), got "
                             f"--optimizer {self.optimizer}")
        if self.node_local and self.optimizer != "diloco":
            raise ValueError(f"--node-local needs --optimizer diloco, got --optimizer "
                             f"{self.optimizer}")
        for name in ("batch_size", "layers", "width", "heads", "context", "average_period",
                     "eval_batches", "powersgd_rank", "sync_every", "fragments", "min_ranks",
                     "recover_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, "
                                 f"got {getattr(self, name)}")
        for name in ("steps", "warmup_steps", "eval_every", "checkpoint_every", "keep", "threads",
                     "collective_timeout", "log_every", "overlap_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must not be negative, "
                                 f"got {getattr(self, name)}")
        if not math.isfinite(self.collective_timeout):
            raise ValueError(f"--collective-timeout must be a number of seconds, got "
                             f"{self.collective_timeout}")
        for name in ("lr", "outer_lr"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number, "
                                 f"got {getattr(self, name)}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"--outer-momentum must be at least 0 and below 1, got "
                             f"{self.outer_momentum}")
        if self.width % self.heads:
            raise ValueError(f"--width {self.width} is not a multiple of --heads {self.heads}")

    def check_ranks(self, ranks: int) -> None:
        """Raise ``ValueError`` when the global batch does not split evenly over ``ranks``."""
        if self.batch_size % ranks:
            raise ValueError(f"--batch-size {self.batch_size} is not a multiple of the {ranks} "
                             "ranks")

    def describe(self) -> Dict[str, Any]:
        """The settings as plain values, for a checkpoint's ``extra``."""
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()
                if v is not None}

    def unfit_for(self, saved: Dict[str, Any]) -> List[str]:
        """Why a checkpoint written with the settings ``saved`` cannot be continued by this run:
        one entry per setting that shapes the model or the optimizer state and differs, e.g.
        ``--width 48 but the checkpoints were written with --width 32``. Settings missing from
        ``saved`` are not compared."""
        return [f"--{name} {getattr(self, name)} but the checkpoints were written with "
                f"--{name} {saved[name]}"
                for name in _STATE_SHAPE if name in saved and saved[name] != getattr(self, name)]

    def changes_from(self, saved: Dict[str, Any]) -> List[str]:
        """How this run's settings differ from a checkpoint's (other than in presentation),
        one readable entry per setting, e.g. ``--lr was 0.003 when the checkpoint was saved, now
        0.01``."""
        current = self.describe()
        return [f"--{name.replace('_', '-')} was {saved[name]} when the checkpoint was saved, "
                f"now {current[name]}"
                for name in sorted(current)
                if name not in _PRESENTATION and name in saved and saved[name] != current[name]]
