"""``RWLock``: many readers or one writer, served in arrival order.

    from celery_etcdlock import connect, RWLock

    rw = RWLock(connect(), "search-index", ttl=10)
    with rw.read():            # shared with other readers
        search()
    with rw.write():           # alone
        rebuild()

Readers and writers share one queue. A reader waits only for the last writer
queued before it, so readers overlap, and a reader arriving after a waiting
writer never overtakes it (writers do not starve). A writer waits only for
the entry just before it. Each side is a full lock object (``acquire``,
``release``, ``held``, ``token``, ``on_lost``, context manager). A request
that dies while queued leaves the queue within its TTL; a live one waits as
long as it likes, since its entry is renewed like a held lock.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..keys import LOCKS, queue_key
from ..options import check_ttl
from .client import Client, check_client
from .queue import READ, WRITE, QueueLock


class RWLock:
    def __init__(self, client: Client, name: str, ttl: float = 30) -> None:
        self.client = check_client(client)
        self.name = name
        self.ttl = check_ttl(ttl)
        self.queue = queue_key(LOCKS, name)  # also checks the name

    def read(self, on_lost: Callable[[QueueLock], None] | None = None, data: dict[str, Any] | None = None) -> QueueLock:
        """A new shared (reader) lock object on this name."""
        return QueueLock(self.client, self.queue, self.name, self.ttl, READ, on_lost, data)

    def write(
        self, on_lost: Callable[[QueueLock], None] | None = None, data: dict[str, Any] | None = None
    ) -> QueueLock:
        """A new exclusive (writer) lock object on this name."""
        return QueueLock(self.client, self.queue, self.name, self.ttl, WRITE, on_lost, data)

    def __repr__(self) -> str:
        return f"<RWLock {self.name!r} ttl={self.ttl}>"
