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


class ReadLock(QueueLock):
    """The shared side of an ``RWLock``: held by many readers at once, never beside a writer.

    lock = RWLock(client, "search-index", ttl=10).read(on_lost=None, data={"query": 7})
    if lock.acquire(timeout=5):          # the Mutex interface: acquire, release, held, token, holders()
        try:
            search()
        finally:
            lock.release()
    """

    kind = "read"

    def __init__(
        self,
        client: Client,
        name: str,
        ttl: float = 30,
        on_lost: Callable[[ReadLock], None] | None = None,
        *,
        data: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(client, queue_key(LOCKS, name), name, ttl, READ, on_lost, data=data)


class WriteLock(QueueLock):
    """The exclusive side of an ``RWLock``: one writer, no readers (the same lock as a ``Mutex`` of the name).

    with RWLock(client, "search-index", ttl=10).write() as lock:
        rebuild(fencing_token=lock.token)
    """

    kind = "write"

    def __init__(
        self,
        client: Client,
        name: str,
        ttl: float = 30,
        on_lost: Callable[[WriteLock], None] | None = None,
        *,
        data: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(client, queue_key(LOCKS, name), name, ttl, WRITE, on_lost, data=data)


class RWLock:
    """Many readers or one writer, served in arrival order: a writer never starves.

        rw = RWLock(client, "search-index", ttl=10)
        with rw.read():                      # a ReadLock: shared with other readers
            search()
        with rw.write():                     # a WriteLock: alone
            rebuild()

        lock = rw.read(on_lost=None, data={"query": 7}); lock.acquire(timeout=5); lock.release()

    Each ``read()`` or ``write()`` is a new lock object with the interface of ``Mutex``
    (``acquire``, ``release``, ``held``, ``token``, ``on_lost``, ``holders()``, a context manager).
    """

    def __init__(self, client: Client, name: str, ttl: float = 30) -> None:
        self.client = check_client(client)
        self.name = name
        self.ttl = check_ttl(ttl)
        self.queue = queue_key(LOCKS, name)  # also checks the name

    def read(
        self, on_lost: Callable[[ReadLock], None] | None = None, *, data: dict[str, Any] | None = None
    ) -> ReadLock:
        """A new shared (reader) lock object on this name."""
        return ReadLock(self.client, self.name, self.ttl, on_lost, data=data)

    def write(
        self, on_lost: Callable[[WriteLock], None] | None = None, *, data: dict[str, Any] | None = None
    ) -> WriteLock:
        """A new exclusive (writer) lock object on this name."""
        return WriteLock(self.client, self.name, self.ttl, on_lost, data=data)

    def __repr__(self) -> str:
        return f"<RWLock {self.name!r} ttl={self.ttl}>"
