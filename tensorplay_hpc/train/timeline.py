"""A timeline of the last few training steps as a PNG, drawn from a merged trace
(:mod:`tensorplay_hpc.comm.trace`): for each rank a compute row (forward, backward, optimizer
step, checkpoint) above a communication row, so that their overlap shows."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Tuple

__all__ = ["COMMUNICATION", "COMPUTE_COLOURS", "STEPS", "Span", "TIMELINE_FILE", "plot_timeline",
           "spans_by_rank"]

TIMELINE_FILE = "timeline.png"
STEPS = 3
"""How many steps (the last ones of the trace) the timeline shows."""
COMPUTE_COLOURS = {"forward": "tab:blue", "backward": "tab:orange",
                   "optimizer step": "tab:green", "checkpoint save": "tab:purple"}
COMMUNICATION = ("collective", "rma")
BLOCKING, NONBLOCKING = "tab:red", "lightcoral"

Span = Tuple[str, str, float, float, bool]   # name, category, start, end (us), nonblocking


def spans_by_rank(events: List[dict]) -> Dict[int, List[Span]]:
    """The timed spans of Chrome trace ``events``, per process (rank): complete events, and
    begin/end pairs of nonblocking operations."""
    spans: Dict[int, List[Span]] = {}
    begun: Dict[Tuple[int, int], dict] = {}
    for event in events:
        if event["ph"] == "X":
            spans.setdefault(event["pid"], []).append(
                (event["name"], event["cat"], event["ts"], event["ts"] + event["dur"], False))
        elif event["ph"] == "b":
            begun[event["pid"], event["id"]] = event
        elif event["ph"] == "e":
            start = begun.pop((event["pid"], event["id"]))
            spans.setdefault(event["pid"], []).append(
                (start["name"], start["cat"], start["ts"], event["ts"], True))
    return spans


def _window(spans: Dict[int, List[Span]], steps: int) -> Tuple[float, float, List[str]]:
    """The time range of the last ``steps`` step spans over all ranks, and their names (the
    whole trace when it has no steps)."""
    names = sorted({s[0] for rank in spans.values() for s in rank
                    if s[1] == "compute" and s[0].startswith("step ")},
                   key=lambda name: int(name.split()[1]))[-steps:]
    chosen = [s for rank in spans.values() for s in rank if s[1] == "compute" and s[0] in names]
    every = chosen or [s for rank in spans.values() for s in rank]
    if not every:
        return 0.0, 1.0, names
    return min(s[2] for s in every), max(s[3] for s in every), names


def plot_timeline(trace_file: Path, path: Path, steps: int = STEPS) -> None:
    """Draw the last ``steps`` steps of the merged trace ``trace_file`` to ``path`` with
    matplotlib's Agg backend."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot
    from matplotlib.patches import Patch

    spans = spans_by_rank(json.loads(trace_file.read_text())["traceEvents"])
    begin, end, names = _window(spans, steps)
    ranks = sorted(spans)
    figure, axes = pyplot.subplots(figsize=(11, 1.2 + 1.1 * len(ranks)), dpi=100)
    ticks, labels = [], []
    for row, rank in enumerate(reversed(ranks)):
        compute_y, comm_y = 2 * row + 1, 2 * row
        for name, category, start, stop, nonblocking in spans[rank]:
            if stop < begin or start > end:
                continue
            bar = [((start - begin) / 1e3, max(stop - start, 1.0) / 1e3)]
            if category == "compute" and name.startswith("step "):
                axes.broken_barh(bar, (compute_y - 0.45, 0.9), facecolors="0.9")
            elif category not in COMMUNICATION:
                axes.broken_barh(bar, (compute_y - 0.35, 0.7),
                                 facecolors=COMPUTE_COLOURS.get(name, "tab:gray"))
            else:
                axes.broken_barh(bar, (comm_y - 0.35, 0.7),
                                 facecolors=NONBLOCKING if nonblocking else BLOCKING)
        ticks += [comm_y, compute_y]
        labels += [f"rank {rank} communication", f"rank {rank} compute"]
    axes.set_yticks(ticks, labels)
    axes.set_xlim(0, (end - begin) / 1e3)
    axes.set_xlabel("milliseconds")
    shown = f"{names[0]} to {names[-1]}" if names else "the whole trace"
    axes.set_title(f"compute and communication per rank, {shown}")
    legend = [Patch(color=colour, label=name) for name, colour in COMPUTE_COLOURS.items()]
    legend += [Patch(color=BLOCKING, label="collective or one-sided (blocking)"),
               Patch(color=NONBLOCKING, label="nonblocking collective, in flight")]
    axes.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=3,
                fontsize="small")
    axes.grid(axis="x", alpha=0.3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    pyplot.close(figure)
