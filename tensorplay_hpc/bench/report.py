"""Benchmark results: one JSON object per line as each comparison is measured, and a table.
Every row names the MPI library it ran on (``library``: family and version)."""
from __future__ import annotations

import json
from typing import List, Optional

from tensorplay_hpc.comm import library
from tensorplay_hpc.comm.mpi import MPI

__all__ = ["Report"]


class Report:
    """Collects comparisons. Only world rank 0 prints."""

    def __init__(self, repeat: int = 7) -> None:
        self.repeat = repeat
        self.rows: List[dict] = []
        self.rank = MPI.COMM_WORLD.Get_rank()
        self.library = f"{library.family()} {library.version() or ''}".strip()

    def add(self, bench: str, case: str, ours_s: float, baseline: str, baseline_s: float,
            nbytes: Optional[int] = None, ranks: Optional[int] = None, **extra) -> dict:
        """Record one comparison; ``speedup`` = baseline_s / ours_s (above 1: we are faster)."""
        row = {"bench": bench, "case": case, "ranks": ranks or MPI.COMM_WORLD.Get_size(),
               "library": self.library}
        if nbytes is not None:
            row["bytes"] = nbytes
        row.update(ours_s=ours_s, baseline=baseline, baseline_s=baseline_s,
                   speedup=baseline_s / ours_s if ours_s > 0 else float("inf"))
        row.update(extra)
        self.rows.append(row)
        if self.rank == 0:
            print(json.dumps(row), flush=True)
        return row

    def print_table(self) -> None:
        """One table per benchmark, with only the columns its rows use."""
        if self.rank != 0 or not self.rows:
            return
        for bench in dict.fromkeys(r["bench"] for r in self.rows):
            rows = [r for r in self.rows if r["bench"] == bench]
            extra_keys = sorted({k for r in rows for k in r} - _FIXED)
            header = ["case", "ranks", "bytes", "ours ms", "baseline", "base ms", "speedup",
                      *extra_keys]
            lines = [header] + [
                [r["case"], str(r["ranks"]), _size(r.get("bytes")), f"{r['ours_s'] * 1e3:.3f}",
                 r["baseline"], f"{r['baseline_s'] * 1e3:.3f}", f"{r['speedup']:.2f}x",
                 *[_fmt(r.get(k)) for k in extra_keys]] for r in rows]
            widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
            print(f"\n{bench} ({self.library})")
            for i, line in enumerate(lines):
                print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())
                if i == 0:
                    print("  ".join("-" * w for w in widths))


_FIXED = {"bench", "case", "ranks", "library", "bytes", "ours_s", "baseline", "baseline_s",
          "speedup"}


def _size(nbytes: Optional[int]) -> str:
    if nbytes is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)
