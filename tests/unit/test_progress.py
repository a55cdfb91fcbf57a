"""Progress output: a tqdm bar on a terminal, plain lines (at most one per interval) otherwise."""

from __future__ import annotations

import io

from agora.node.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_when_not_a_terminal_at_most_one_per_interval_and_the_last():
    now = [0.0]
    out = io.StringIO()
    progress = Progress(10, "demo", stream=out, line_every_s=10.0, clock=lambda: now[0])
    for done in range(1, 11):
        now[0] += 3.0  # 3 s per batch: a line at most every 10 s
        progress.update(done, f"loss {10 - done}", force=done == 10)
    progress.close()
    lines = out.getvalue().splitlines()
    assert lines == ["demo: 1/10 loss 9", "demo: 5/10 loss 5", "demo: 9/10 loss 1", "demo: 10/10 loss 0"]
    assert "\r" not in out.getvalue()


def test_a_bar_on_a_terminal():
    out = Terminal()
    progress = Progress(4, "train-local", stream=out)
    for done in range(1, 5):
        progress.update(done, f"loss {done}")
    progress.close()
    assert "\r" in out.getvalue() and "4/4" in out.getvalue() and "loss 4" in out.getvalue()
