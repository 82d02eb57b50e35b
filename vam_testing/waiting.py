"""The one way tests wait for a condition: poll it until it holds or a deadline passes.

A test waits for something another thread or process does (a stream closed, a block freed, a
counter moved); it never sleeps a fixed time and hopes. The deadline is only a bound for a
failure to become a message: a slow machine makes the wait longer, never the test wrong.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

_Value = TypeVar("_Value")

#: Long enough for a loaded 2-core machine (and its occasional freezes of tens of seconds).
DEFAULT_TIMEOUT_S = 60.0


def wait_until(
    condition: Callable[[], _Value],
    what: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    interval_s: float = 0.05,
) -> _Value:
    """Poll ``condition`` until it returns something true and return that; raise
    ``AssertionError`` naming ``what`` (and the last value seen) once ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s (last seen: {value!r})")
        time.sleep(interval_s)
