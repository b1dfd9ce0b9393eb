"""What a user sees: on rank 0 a progress bar, or in batch logs a text line every few steps, and
one line per event; other ranks stay quiet."""
from __future__ import annotations

import shutil
import sys
import time
from datetime import timedelta
from typing import Optional

from tqdm import tqdm

__all__ = ["Progress"]


class Progress:
    """Step, loss, validation loss, tokens per second and ETA on rank 0; nothing elsewhere.

    Args:
        rank: this process's rank; only rank 0 prints.
        total: the last step of the run.
        done: steps already done (a resumed run starts there).
        bar: draw a tqdm bar when standard output is a terminal; otherwise (or with ``False``)
            print a plain line every ``log_every`` steps, at the last step and with each
            validation loss, so that a log file gets lines and no ``\\r`` frames.
        log_every: steps between lines without a bar.
    """

    def __init__(self, rank: int, total: int, done: int, bar: bool = True,
                 log_every: int = 50) -> None:
        self.enabled = rank == 0
        self.total, self.step_number, self.log_every = total, done, log_every
        self._first_step, self._started = done, time.perf_counter()
        self._bar: Optional[tqdm] = None
        if self.enabled and bar and sys.stdout.isatty():
            # mpiexec gives rank 0 a terminal of size 0 x 0, where tqdm would draw nothing.
            size = shutil.get_terminal_size(fallback=(100, 24))
            self._bar = tqdm(total=total, initial=done, unit="step", ncols=size.columns,
                             nrows=size.lines, file=sys.stdout, desc="train", mininterval=0.5)

    def step(self, loss: float, tokens_per_second: float,
             validation: Optional[float] = None) -> None:
        """Count one step, with its training loss and, when measured, its validation loss."""
        self.step_number += 1
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_second:,.0f}",
                                  refresh=False)
            self._bar.update(1)
            if validation is not None:
                self.say(f"step {self.step_number}: validation loss {validation:.4f}")
            return
        if (validation is not None or self.step_number == self.total
                or (self.log_every and self.step_number % self.log_every == 0)):
            shown = "" if validation is None else f"  validation {validation:.4f}"
            print(f"step {self.step_number}/{self.total}  loss {loss:.4f}{shown}  "
                  f"{tokens_per_second:,.0f} tok/s  ETA {self._eta()}", flush=True)

    def _eta(self) -> str:
        steps = self.step_number - self._first_step
        seconds = (time.perf_counter() - self._started) / steps * (self.total - self.step_number)
        return str(timedelta(seconds=round(seconds)))

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
