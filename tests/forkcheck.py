"""What was alive when this process forked: a thread of ours at a fork is an error (tests/test_fork_safety.py).

    from tests import forkcheck
    forkcheck.install()               # before anything forks; FORK_LOG=path also writes JSON lines
    ...                               # whatever the parent does, then os.fork() (or a pool starts)
    forkcheck.check()                 # ForkWithOurThreads if a fork happened while one ran

Each fork of this process records the names of the live threads of ours (named
``etcdlock-...``). Python 3.12+ warns "This process is multi-threaded, use of
fork() may lead to deadlocks in the child" at any fork with threads, and no
filter can make ``os.fork()`` raise it (the fork already happened; CPython drops
the error). So the warning is shown here always, and turned into an error when
a thread of ours is among the process's threads; another library's thread
is recorded, and tolerated.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import warnings
from typing import Any

OURS = "etcdlock-"  # every thread the package starts is named so
FORK_WARNING = r"This process \(pid=\d+\) is multi-threaded, use of fork\(\) may lead to deadlocks"

forks: list[dict[str, Any]] = []  # one per fork of this process: pid, ours, threads
errors: list[str] = []  # the 3.12+ warning, where a thread of ours was alive


class ForkWithOurThreads(AssertionError):
    """This process forked while a thread of ours ran."""


def our_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith(OURS))


def _write(record: dict[str, Any]) -> None:
    path = os.environ.get("FORK_LOG")
    if path:  # O_APPEND: the parent, its beat and its pool processes write whole lines to one file
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, (json.dumps(record) + "\n").encode())
        finally:
            os.close(fd)


def _before_fork() -> None:
    record = {"pid": os.getpid(), "ours": our_threads(), "threads": sorted(t.name for t in threading.enumerate())}
    forks.append(record)
    _write({"event": "fork", **record})


def install() -> None:
    """Record every fork of this process from now on, and make 3.12+'s warning an error for our threads."""
    os.register_at_fork(before=_before_fork)
    warnings.filterwarnings("always", message=FORK_WARNING, category=DeprecationWarning)
    shown = warnings.showwarning

    def showwarning(message: Any, category: type[Warning], *args: Any, **kwargs: Any) -> None:
        ours = our_threads()
        if issubclass(category, DeprecationWarning) and "use of fork()" in str(message) and ours:
            error = f"{message} (threads of ours: {', '.join(ours)})"
            errors.append(error)
            _write({"event": "error", "pid": os.getpid(), "error": error, "python": sys.version.split()[0]})
        shown(message, category, *args, **kwargs)

    warnings.showwarning = showwarning


def check() -> None:
    """ForkWithOurThreads naming the threads of ours alive at any fork so far (and 3.12+'s warnings of them)."""
    bad = [f for f in forks if f["ours"]]
    if bad or errors:
        raise ForkWithOurThreads(f"forked with threads of ours alive: {bad}; {errors}")
