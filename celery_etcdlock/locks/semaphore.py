"""``Semaphore``: at most ``limit`` holders at once, cluster-wide, FIFO, each with its fencing token.

    from celery_etcdlock import connect, Semaphore

    slots = Semaphore(connect(), "pdf-renderer", limit=3, ttl=30)
    with slots:                        # blocks until one of the 3 slots is ours
        render(fencing_token=slots.token)

    slot = Semaphore(client, "pdf-renderer", limit=3)
    if slot.acquire(timeout=5):        # the Mutex interface: acquire, release, held, token, on_lost, holders()
        ...

It is the same fair queue as the ``Mutex``: the first ``limit`` requests
hold a slot, the others wait in arrival order, and a crashed holder's slot
frees within ``ttl``. A waiter watches the ``limit`` requests just ahead of
it, so it is woken by whichever of them leaves first, not by a release
elsewhere in the queue (a ``Mutex`` is a semaphore of 1 on this code).

Every participant must ask for the same ``limit``: one that asks for another
is refused with ``LimitMismatch`` (a ``ValueError``) naming both, as kazoo's
Semaphore refuses a different ``max_leases``. To change a limit, stop every
participant with the old one first: while old and new participants
coexist (a rolling deploy), the newcomers are refused, and the old limit
keeps holding, until the last old participant leaves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..keys import SEMAPHORES, queue_key
from .client import Client
from .queue import SLOT, QueueLock


class Semaphore(QueueLock):
    """At most ``limit`` holders at once, cluster-wide, served in arrival order, each with a fencing token.

        slots = Semaphore(client, "pdf-renderer", limit=3, ttl=30)
        with slots:                          # blocks until one of the 3 slots is ours
            render(fencing_token=slots.token)

        slot = Semaphore(client, "pdf-renderer", limit=3)
        if slot.acquire(timeout=5):          # the Mutex interface: acquire, release, held, token, holders()
            ...

    Every participant must give the same ``limit``; another one is refused with
    ``LimitMismatch``. ``ttl``, ``on_lost`` and ``data`` (keyword only) are as for ``Mutex``.
    """

    kind = "semaphore"

    def __init__(
        self,
        client: Client,
        name: str,
        limit: int,
        ttl: float = 30,
        on_lost: Callable[[Semaphore], None] | None = None,
        *,
        data: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(client, queue_key(SEMAPHORES, name), name, ttl, SLOT, on_lost, data=data, limit=limit)

    def __repr__(self) -> str:
        return f"<Semaphore {self.name!r} limit={self.limit} held={self.held} token={self.token}>"
