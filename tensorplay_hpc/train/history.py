"""The run's metrics: loss per step, validation loss, throughput and restarts.

The history travels in every checkpoint's ``extra``, so a resumed run continues the same curve
and the CSV always matches the checkpointed state.
"""
from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List

__all__ = ["History"]


@dataclass
class History:
    """Metrics of the steps done so far (all runs of a job, restarts included)."""

    losses: List[float] = field(default_factory=list)
    """Mean training loss over the ranks, one per step (``losses[s]`` is step ``s + 1``)."""
    tokens_per_second: List[float] = field(default_factory=list)
    bytes_communicated: List[int] = field(default_factory=list)
    """Bytes rank 0 handed to MPI collectives in each step (gradients, parameters, averaging,
    the loss), as :func:`tensorplay_hpc.comm.trace.bytes_communicated` counts them."""
    validation: Dict[int, float] = field(default_factory=dict)
    """Validation loss by the step after which it was measured."""
    cross_node_bytes: Dict[int, int] = field(default_factory=dict)
    """Bytes the nodes sent on their networks since the run's first step, by the step after
    which they were counted (see :class:`~tensorplay_hpc.train.cross_node.CrossNodeBytes`)."""
    restarts: List[int] = field(default_factory=list)
    """Steps at which a run resumed from a checkpoint."""
    recoveries: List[int] = field(default_factory=list)
    """Steps to which the survivors of a lost rank rolled back (``--recover``)."""

    @property
    def step(self) -> int:
        """Steps done so far."""
        return len(self.losses)

    def rolled_back_to(self, step: int) -> None:
        """Forget the metrics of the steps after ``step``."""
        later = self.step - step
        if later > 0:
            del self.losses[step:], self.tokens_per_second[step:]
            del self.bytes_communicated[max(0, len(self.bytes_communicated) - later):]
        self.validation = {s: v for s, v in self.validation.items() if s <= step}
        self.cross_node_bytes = {s: b for s, b in self.cross_node_bytes.items() if s <= step}

    def to_extra(self) -> Dict[str, Any]:
        """Plain values for a checkpoint's ``extra``."""
        return {"losses": list(self.losses), "tokens_per_second": list(self.tokens_per_second),
                "bytes_communicated": list(self.bytes_communicated),
                "validation_steps": list(self.validation),
                "validation_losses": list(self.validation.values()),
                "cross_node_steps": list(self.cross_node_bytes),
                "cross_node_bytes": list(self.cross_node_bytes.values()),
                "restarts": list(self.restarts), "recoveries": list(self.recoveries)}

    @classmethod
    def from_extra(cls, extra: Dict[str, Any]) -> "History":
        """The history saved by :meth:`to_extra`."""
        def floats(key: str) -> List[float]:
            return [float(v) for v in extra.get(key, [])]
        steps = [int(s) for s in extra.get("validation_steps", [])]
        return cls(losses=floats("losses"), tokens_per_second=floats("tokens_per_second"),
                   bytes_communicated=[int(b) for b in extra.get("bytes_communicated", [])],
                   validation=dict(zip(steps, floats("validation_losses"))),
                   cross_node_bytes={int(s): int(b) for s, b in zip(
                       extra.get("cross_node_steps", []), extra.get("cross_node_bytes", []))},
                   restarts=[int(s) for s in extra.get("restarts", [])],
                   recoveries=[int(s) for s in extra.get("recoveries", [])])

    def write_csv(self, path: Path) -> None:
        """One row per step: ``step,loss,validation_loss,tokens_per_second,bytes_communicated,
        restart,cross_node_bytes`` (bytes empty for steps of runs saved before they were
        counted; cross-node bytes only at the steps they were counted)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        restarts = set(self.restarts)
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["step", "loss", "validation_loss", "tokens_per_second",
                             "bytes_communicated", "restart", "cross_node_bytes"])
            # Counts are kept from the first step that had one.
            counts = [""] * (self.step - len(self.bytes_communicated)) + self.bytes_communicated
            for index, (loss, speed) in enumerate(zip(self.losses, self.tokens_per_second)):
                step = index + 1
                validation = self.validation.get(step)
                validation_text = "" if validation is None else f"{validation:.6f}"
                writer.writerow([step, f"{loss:.6f}", validation_text, f"{speed:.1f}",
                                 counts[index], int(step - 1 in restarts),
                                 self.cross_node_bytes.get(step, "")])
