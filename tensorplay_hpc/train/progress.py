"""What a user sees: on rank 0 a progress bar and one line per event; other ranks stay quiet."""
from __future__ import annotations

import shutil
import sys
from typing import Optional

from tqdm import tqdm


class Progress:
    """A tqdm bar (step, loss, tokens per second, ETA) on rank 0; nothing on other ranks.

    Args:
        rank: this process's rank; only rank 0 prints.
        total: the last step of the run.
        done: steps already done (a resumed run starts the bar there).
        bar: show the bar (``False`` prints only the event lines, for logs).
    """

    def __init__(self, rank: int, total: int, done: int, bar: bool = True) -> None:
        self.enabled = rank == 0
        self._bar: Optional[tqdm] = None
        if self.enabled and bar:
            # mpiexec gives rank 0 a terminal of size 0 x 0, where tqdm would draw nothing.
            size = shutil.get_terminal_size(fallback=(100, 24))
            self._bar = tqdm(total=total, initial=done, unit="step", ncols=size.columns,
                             nrows=size.lines, file=sys.stdout, desc="train", mininterval=0.5)

    def step(self, loss: float, tokens_per_second: float) -> None:
        """Advance the bar by one step."""
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_second:,.0f}",
                                  refresh=False)
            self._bar.update(1)

    def say(self, line: str) -> None:
        """Print a line (above the bar) on rank 0."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
