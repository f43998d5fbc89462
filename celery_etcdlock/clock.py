"""The clock a holder's deadline is kept on.

A holder must step down before etcd can expire its lease, and etcd's clock
keeps running while a host or VM is suspended. ``time.monotonic()`` stops
during a suspend on Linux, so a holder that wakes up would believe its lease
still had the time it had before the suspend. ``now()`` reads
``CLOCK_BOOTTIME`` instead, which counts suspended time, where the platform
has it, and falls back to ``time.monotonic()`` elsewhere.
"""

from __future__ import annotations

import time
from collections.abc import Callable


def _boottime() -> Callable[[], float] | None:
    clock_id = getattr(time, "CLOCK_BOOTTIME", None)
    if clock_id is None:
        return None
    try:
        time.clock_gettime(clock_id)
    except OSError:  # defined but not supported by this kernel
        return None
    return lambda: time.clock_gettime(clock_id)


#: seconds on a clock that never goes back and counts time spent suspended (where the platform allows)
now: Callable[[], float] = _boottime() or time.monotonic
SUSPEND_AWARE = now is not time.monotonic
