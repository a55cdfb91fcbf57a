"""Progress of long work (the demo, train-local): a tqdm bar on a terminal, plain lines otherwise.

On a terminal the bar redraws in place (tqdm: rate, elapsed, remaining, and a postfix with the
loss and tokens/s); into a file or a pipe (CI logs, `demo > log`) a bar's carriage returns are
noise, so the same numbers go out as one plain line at most every `line_every_s` seconds, and
once more at the end.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Callable, Optional

from tqdm import tqdm

__all__ = ["Progress"]


class Progress:
    def __init__(self, total: int, description: str, *, stream: IO[str] = sys.stderr, line_every_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        self.total, self.description, self.stream = total, description, stream
        self._clock, self._line_every_s = clock, line_every_s
        self._bar: Optional[tqdm] = None
        self._last_line = -float("inf")
        self._done = 0
        self._postfix = ""
        if stream.isatty():
            self._bar = tqdm(total=total, desc=description, file=stream, unit="batch", dynamic_ncols=True,
                             leave=True)

    def update(self, done: int, postfix: str, force: bool = False) -> None:
        """`done` out of `total` so far, and what to show beside it."""
        done = min(done, self.total)
        if self._bar is not None:
            if done > self._done:
                self._bar.update(done - self._done)
            if postfix != self._postfix:
                self._bar.set_postfix_str(postfix, refresh=True)
        elif force or self._clock() - self._last_line >= self._line_every_s:
            self.stream.write(f"{self.description}: {done}/{self.total} {postfix}\n")
            self.stream.flush()
            self._last_line = self._clock()
        self._done, self._postfix = done, postfix

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
