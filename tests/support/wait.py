"""Polls with a deadline: how the tests wait for something, instead of sleeping."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class TimedOut(AssertionError):
    """A poll-with-deadline ran out: in a test, a failed assertion."""


def wait_until(predicate: Callable[[], T | None], timeout: float, what: str = "", interval: float = 0.02) -> T:
    """Poll ``predicate()`` until it returns something truthy (and return that), or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise TimedOut(f"timed out after {timeout:g}s waiting for {what or predicate}")
        time.sleep(interval)
