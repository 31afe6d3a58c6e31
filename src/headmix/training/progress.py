"""Training progress that a log can read.

On a terminal the trainer draws a tqdm bar. Off one (output redirected to a file, a cluster job's log) the bar
hides itself, so :class:`Progress` prints instead one line every ``interval`` seconds, and one when training
ends::

    [headmix] train: step 120/450 (27%), loss 5.213, 3,412 tokens/s, elapsed 0:01:05, remaining ~0:02:59

Tokens per second and the estimate of the time remaining are those of this process (a resumed run counts from
where it resumed).
"""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

#: Seconds between two progress lines off a terminal.
INTERVAL = 30.0


def clock_text(seconds: float) -> str:
    """``3725.4`` -> ``1:02:05``."""
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Progress:
    """Progress of a loop of ``total`` steps (``None``: unknown, e.g. a run bounded by time) from step ``start``, on
    ``stream`` (default: ``sys.stderr`` at creation): a tqdm bar when the stream is a terminal, else a line every
    ``interval`` seconds of ``clock`` and one at :meth:`close`."""

    def __init__(self, total: int | None, start: int = 0, *, desc: str = "train", stream: TextIO | None = None,
                 interval: float = INTERVAL, clock: Callable[[], float] = time.monotonic):
        if not interval > 0:
            raise ValueError(f"interval must be a positive number of seconds, got {interval!r}")
        self.stream = sys.stderr if stream is None else stream
        self.total, self.start, self.desc, self.interval, self.clock = total, start, desc, interval, clock
        self.step, self.loss, self.tokens = start, None, 0
        self.began = self.last = clock()
        self.printed = start  # the step of the last line
        self.bar = None
        if _is_terminal(self.stream):
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, desc=desc, unit="step", dynamic_ncols=True, file=self.stream)

    def update(self, step: int, loss: float, tokens: int) -> None:
        """Step ``step`` done, with its ``loss`` and the ``tokens`` it trained on."""
        self.step, self.loss, self.tokens = step, loss, self.tokens + tokens
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.3f}")
        elif self.clock() - self.last >= self.interval:
            self._line()

    def close(self) -> None:
        """The bar closed, or the last line printed (when a step was done since the last one)."""
        if self.bar is not None:
            self.bar.close()
        elif self.step != self.printed:
            self._line()

    def record(self) -> str:
        """The line: step (of total), loss, tokens/s, elapsed and the estimated time remaining."""
        elapsed = self.clock() - self.began
        done = self.step - self.start
        parts = [f"{self.desc}: step {self.step}" + (f"/{self.total} ({100 * self.step / self.total:.0f}%)"
                                                     if self.total else "")]
        if self.loss is not None:
            parts.append(f"loss {self.loss:.3f}")
        if elapsed > 0:
            parts.append(f"{self.tokens / elapsed:,.0f} tokens/s")
        parts.append(f"elapsed {clock_text(elapsed)}")
        if self.total and done > 0:
            parts.append(f"remaining ~{clock_text(elapsed / done * max(self.total - self.step, 0))}")
        return ", ".join(parts)

    def _line(self) -> None:
        self.last, self.printed = self.clock(), self.step
        print(f"[headmix] {self.record()}", file=self.stream, flush=True)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
