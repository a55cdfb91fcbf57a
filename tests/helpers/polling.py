"""Waiting for what a real DHT or process does eventually: a predicate polled until it holds."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def eventually(predicate: Callable[[], T], *, timeout: float, what: str) -> T:
    """The predicate's first true value, polled every 50 ms; AssertionError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not (result := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)
    return result
