"""``Mutex``: one holder at a time, cluster-wide, FIFO, with a fencing token.

    from celery_etcdlock import connect, Mutex

    client = connect("etcd3://127.0.0.1:2379")
    with Mutex(client, "reports/daily", ttl=10) as lock:
        write_report(fencing_token=lock.token)

The lock is renewed in the background while held (by the session's
renewer thread), so a holder may keep it for hours; a holder that dies frees
it within ``ttl`` seconds. A holder that cannot renew in time sees ``held``
turn False, and its ``on_lost(lock)`` called, before anyone else can acquire.
Waiters are woken by a watch on the one entry ahead of them, so a release
wakes exactly one waiter. A Mutex is the write side of the ``RWLock`` of the
same name: the two exclude each other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..keys import LOCKS, queue_key
from .client import Client
from .queue import WRITE, QueueLock


class Mutex(QueueLock):
    """One holder at a time, cluster-wide, served in arrival order, with a fencing token.

        m = Mutex(client, "reports/daily", ttl=10, on_lost=None, data={"job": 7})
        if m.acquire(blocking=True, timeout=None):   # True once held
            try:
                write_report(fencing_token=m.token)  # greater for every later holder of the name
            finally:
                m.release()

        with Mutex(client, "reports/daily", ttl=10) as m:   # blocks until held
            ...                                             # LockLost on leaving, if it was lost meanwhile

        Mutex(client, "reports/daily").holders()            # [Holder(holder, token, mode, data)]

    ``ttl`` bounds how long a holder that died keeps the lock; a live holder's
    entry is renewed in the background, so it may hold for hours. ``on_lost(lock)``
    runs (on the renewer thread) when the lock was lost while held; ``held`` is
    False by then. ``data`` (keyword only) is recorded in the holder's entry for
    ``holders()`` and the CLI. An object is used by one thread at a time.
    """

    kind = "mutex"

    def __init__(
        self,
        client: Client,
        name: str,
        ttl: float = 30,
        on_lost: Callable[[Mutex], None] | None = None,
        *,
        data: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(client, queue_key(LOCKS, name), name, ttl, WRITE, on_lost, data=data)
