"""A Celery app with one CPU-bound singleton task, for workers of every pool (tests/test_pools.py).

    ETCDLOCK_TEST_ETCD_URL=etcd3://127.0.0.1:40123?prefix=/p \\
    ETCDLOCK_TEST_REDIS_URL=redis://127.0.0.1:40125/1 \\
    celery -A tests.poolapp worker -P gevent -Q gevent

``compute(tag, seconds)`` holds the lock of ``tag`` while it computes for
``seconds`` without yielding, and records in Redis how many runs of the tag
were active when it started (``concurrency:<tag>``), so that a test sees two
runs at once if they ever happen.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import redis
from celery import Celery

from celery_etcdlock.tasks import SingletonTask, singleton_task

LOCK_TTL = 3  # seconds; etcd is asked for 2 (see backends.base.server_ttl), renewed every 2/3 s
REDIS_URL = os.environ.get("ETCDLOCK_TEST_REDIS_URL", "redis://127.0.0.1:6379/1")

app = Celery("poolapp", broker=REDIS_URL, backend=REDIS_URL)
app.conf.update(
    etcdlock_url=os.environ.get("ETCDLOCK_TEST_ETCD_URL", "etcd3://127.0.0.1:2379?prefix=/etcdlock-poolapp"),
    etcdlock_retry_max_delay=10,
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)


def _redis() -> redis.Redis:
    return redis.Redis.from_url(REDIS_URL)


@singleton_task(app=app, bind=True, key=["tag"], lock_ttl=LOCK_TTL, on_conflict="skip")
def compute(self: SingletonTask, tag: str, seconds: float) -> dict[str, Any]:
    """Compute for ``seconds`` in pure Python, never yielding; what the lock looked like at the end.

    ``ticks`` counts what a ``threading.Thread`` ticking every 10 ms managed meanwhile: under
    gevent that thread is a greenlet, and 0 ticks shows that this run never let the hub run.
    """
    store = _redis()
    store.rpush(f"concurrency:{tag}", store.incr(f"active:{tag}"))
    assert self.lock is not None
    token = self.lock.token
    ticks, stop = [0], threading.Event()

    def tick() -> None:
        while not stop.wait(0.01):
            ticks[0] += 1

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    started = time.monotonic()
    loops = 0
    while time.monotonic() - started < seconds:
        loops += 1
    computed = time.monotonic() - started
    ticks_while_computing = ticks[0]
    held = self.lock.held
    stop.set()
    ticker.join()
    store.decr(f"active:{tag}")
    return {"token": token, "held": held, "computed": computed, "loops": loops, "ticks": ticks_while_computing}
