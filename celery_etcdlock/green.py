"""Green pools: keeping locks alive while tasks run as greenlets (``celery worker -P gevent``).

gevent's monkey-patching makes ``threading.Thread`` start a greenlet, and makes
sockets, locks and sleeps wait by switching to the hub. A renewer that were a
greenlet would renew only when the running task yields: a task that computes,
or blocks in a C call, for longer than its TTL would lose its lock while it
still runs, and another worker would start the same key. So in a patched
process a session's renewer is a real OS thread that never waits on the hub:

- it is started with the standard library's own ``start_new_thread``
  (``NativeThread``) and sleeps on native locks (``NativeCondition``);
- the state it shares with greenlets is guarded by native locks
  (``native_lock``), which no code holds across I/O, a log call or a callback,
  so a greenlet never waits on one for more than a few bytecodes;
- its requests go through connections of its own, on unpatched sockets
  (the backend's ``native_twin``), and its retry pauses are the real
  ``time.sleep`` (``native_sleep``);
- the ``on_lost`` callbacks it reports run in a greenlet of the thread that
  took the lock (``hub_runner``), when that thread's hub next runs: they touch
  that thread's green objects (events, queues, signal handlers), which are not
  safe to use from another OS thread.

eventlet is refused (``check_pool`` raises ``UnsupportedPool``): its hub cannot
be reached safely from another OS thread, its locks (the logging module's among
them) cannot be waited on from one, and eventlet itself is deprecated.

In a process that is not patched, nothing here is used but ``native_lock``,
which is then ``threading.Lock``: prefork, threads and solo pools run the code
they always did.

    pool = check_pool()        # "gevent", or None; UnsupportedPool under eventlet
    lock = native_lock()       # a lock a greenlet and a native thread can share
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Callable
from typing import Any

from .errors import UnsupportedPool

GEVENT = "gevent"
EVENTLET = "eventlet"


def patched_by() -> str | None:
    """The green library that monkey-patched this process: ``"gevent"``, ``"eventlet"`` or None.

    Patched means ``threading`` (a renewer would be a greenlet) or ``socket`` (its requests
    would wait on a hub) was replaced. Asks only a library that is already imported:
    patching imports it first, and a process that never imported it is not patched.
    """
    monkey = sys.modules.get("gevent.monkey")
    if monkey is not None and (monkey.is_module_patched("threading") or monkey.is_module_patched("socket")):
        return GEVENT
    patcher = sys.modules.get("eventlet.patcher")
    if patcher is not None and (patcher.is_monkey_patched("thread") or patcher.is_monkey_patched("socket")):
        return EVENTLET
    return None


def check_pool() -> str | None:
    """``patched_by()``, or ``UnsupportedPool`` if it is a library whose pool cannot keep locks alive."""
    green = patched_by()
    if green == EVENTLET:
        raise UnsupportedPool(
            "celery_etcdlock does not support eventlet (celery worker -P eventlet): a task that does not yield "
            "for longer than its lock's TTL would stop the lock's renewal, and the lock would be lost while the "
            "task still runs. Renewal must run in an OS thread of its own, and eventlet cannot be used safely from "
            "one (eventlet is also deprecated). Use -P gevent, -P threads or -P prefork."
        )
    return green


def original(module: str, name: str) -> Any:
    """``module.name`` as the standard library defines it, even after gevent replaced it."""
    monkey = sys.modules.get("gevent.monkey")
    if monkey is not None:
        return monkey.get_original(module, name)
    return getattr(importlib.import_module(module), name)


def native_lock() -> threading.Lock:
    """A lock of the OS, whatever the patching: ``threading.Lock`` in a process that is not patched.

    Under gevent, a greenlet that waits for it blocks its whole thread (no other greenlet
    runs meanwhile): hold it only for bookkeeping, never across I/O, a log call or a callback.
    """
    lock: threading.Lock = original("_thread", "allocate_lock")()
    return lock


def native_sleep() -> Callable[[float], None]:
    """The real ``time.sleep`` (gevent's would wait on the hub)."""
    sleep: Callable[[float], None] = original("time", "sleep")
    return sleep


class NativeCondition:
    """The part of ``threading.Condition`` the renewer uses, on native locks, for one waiting thread.

    gevent's ``Condition`` waits on the hub, which a task that does not yield starves. A
    ``notify()`` with nobody waiting makes the next ``wait()`` return at once; the renewer
    checks what is due after every wake-up anyway.
    """

    def __init__(self) -> None:
        self._lock = native_lock()
        self._alarm = native_lock()  # held while no notify is pending: wait() blocks on it
        self._alarm.acquire()

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def wait(self, timeout: float) -> bool:
        """Release the lock, sleep until ``notify()`` or ``timeout`` seconds, take the lock again (it must be held)."""
        self._lock.release()
        try:
            return self._alarm.acquire(timeout=min(max(0.0, timeout), threading.TIMEOUT_MAX))
        finally:
            self._lock.acquire()

    def notify(self) -> None:
        """Wake the waiting thread (the lock must be held: notifiers take turns)."""
        if self._alarm.locked():
            self._alarm.release()


class NativeThread:
    """The part of ``threading.Thread`` the session uses, as a real OS thread (under gevent, Thread is a greenlet)."""

    def __init__(self, target: Callable[[], None], name: str, daemon: bool = True) -> None:
        # daemon: a thread started with start_new_thread is never joined at exit, like a daemon thread
        self.name = name
        self._target = target
        self._running = False

    def start(self) -> None:
        self._running = True
        try:
            original("_thread", "start_new_thread")(self._run, ())
        except BaseException:
            self._running = False
            raise

    def is_alive(self) -> bool:
        return self._running

    def _run(self) -> None:
        try:
            self._target()
        finally:
            self._running = False


def hub_runner() -> Callable[..., None]:
    """A function that runs ``fn(*args)`` in a new greenlet of the calling thread, called from any OS thread.

    ``hub_runner()(fn, arg)`` returns at once; ``fn`` starts when that thread's hub next gets
    control (a busy greenlet delays it, as it delays every other greenlet of that thread). A
    greenlet, not the hub's own callback: ``fn`` may block (log, take a lock, send an event).
    """
    gevent = sys.modules["gevent"]
    loop = gevent.get_hub().loop

    def run(fn: Callable[..., Any], *args: Any) -> None:
        loop.run_callback_threadsafe(gevent.spawn_raw, fn, *args)

    return run
