"""The loss curve as a PNG: training and validation loss against the step, restarts marked."""
from __future__ import annotations

from pathlib import Path

from .history import History

__all__ = ["plot_losses"]


def plot_losses(history: History, path: Path, title: str) -> None:
    """Draw ``history`` to ``path`` with matplotlib's Agg backend (no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(8, 4.5), dpi=100)
    steps = range(1, history.step + 1)
    axes.plot(steps, history.losses, linewidth=1, label="training loss")
    if history.validation:
        axes.plot(list(history.validation), list(history.validation.values()), "o-",
                  label="validation loss")
    for number, step in enumerate(history.restarts):
        axes.axvline(step, color="tab:red", linestyle="--", linewidth=1,
                     label="resumed from checkpoint" if number == 0 else None)
    axes.set_xlabel("step")
    axes.set_ylabel("cross-entropy (nats per byte)")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    pyplot.close(figure)
