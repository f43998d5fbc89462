"""A Celery app of singleton and read-write locked tasks, for tests with real workers.

    ETCDLOCK_TEST_ETCD_URL=etcd://127.0.0.1:40123?prefix=/t1 \\
    ETCDLOCK_TEST_REDIS_URL=redis://127.0.0.1:40125/0 \\
    celery -A tests.taskapp worker --pool=prefork --concurrency=2

Every task records what it does in Redis, under keys made from its ``tag``
argument, so a test observes runs from outside the worker:

- ``events:<tag>``: one JSON line per event (``start``/``end``/...), with
  the task id, pid, wall-clock time and the fencing token;
- ``active:<tag>``: how many runs of the tag are running now;
- ``concurrency:<tag>``: the value of ``active:<tag>`` seen by each run as
  it started, so ``max`` of it is the most runs that ever overlapped.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any
from urllib.parse import parse_qs, urlsplit

import redis
from celery import Celery

from celery_etcdlock.signals import lock_released, task_skipped
from celery_etcdlock.tasks import LimitedTask, SingletonTask, limited_task, rwlock_task, singleton_task

ETCD_URL = os.environ.get("ETCDLOCK_TEST_ETCD_URL", "etcd://127.0.0.1:2379?prefix=/etcdlock-taskapp")
REDIS_URL = os.environ.get("ETCDLOCK_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
SHORT_TTL = 2  # the lock TTL of the tasks that tests kill or stop


def _prefix(url: str) -> str:
    return parse_qs(urlsplit(url).query).get("prefix", ["/celery-etcdlock"])[0]


app = Celery("taskapp", broker=REDIS_URL, backend=REDIS_URL)
app.conf.update(
    etcdlock_url=ETCD_URL,
    etcdlock_prefix=_prefix(ETCD_URL),
    etcdlock_ttl=10,
    etcdlock_retry_max_delay=10,
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    worker_prefetch_multiplier=1,
    task_acks_late=False,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)

_redis: redis.Redis | None = None
_redis_pid = 0


def configure(etcd_url: str, redis_url: str) -> None:
    """Point this process's app (a test's client side) at the servers the worker uses."""
    global ETCD_URL, REDIS_URL, _redis
    ETCD_URL, REDIS_URL, _redis = etcd_url, redis_url, None
    app.conf.update(
        etcdlock_url=etcd_url, etcdlock_prefix=_prefix(etcd_url), broker_url=redis_url, result_backend=redis_url
    )
    # another test module may have used this app with servers it has stopped since: the app caches its
    # result backend and its pool of broker connections, which would still point there
    app._backend_cache = None  # Celery keeps a thread-safe backend here, another in app._local
    app._local.__dict__.pop("backend", None)
    app._pool = None  # the broker connections (their server is gone), and the producers made from them
    app.__dict__.pop("amqp", None)


def store() -> redis.Redis:
    global _redis, _redis_pid
    if _redis is None or _redis_pid != os.getpid():
        _redis, _redis_pid = redis.Redis.from_url(REDIS_URL), os.getpid()
    return _redis


def record(tag: str, event: str, task: Any = None, **extra: Any) -> None:
    lock = getattr(task, "lock", None)
    line = {
        "event": event,
        "task_id": getattr(getattr(task, "request", None), "id", None),
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "wall": time.time(),
        "token": getattr(lock, "token", None),
        **extra,
    }
    store().rpush(f"events:{tag}", json.dumps(line))


def body(tag: str, seconds: float, task: Any = None, **extra: Any) -> float:
    """Record the start, stay "active" for ``seconds``, record the end."""
    r = store()
    active = r.incr(f"active:{tag}")
    r.rpush(f"concurrency:{tag}", active)
    record(tag, "start", task, **extra)
    try:
        time.sleep(seconds)
    finally:
        r.decr(f"active:{tag}")
        record(tag, "end", task, held=bool(getattr(getattr(task, "lock", None), "held", False)))
    return seconds


@singleton_task(app=app, bind=True, key=["tag"])
def skip_task(self: SingletonTask, tag: str, seconds: float = 1.0) -> float:
    return body(tag, seconds, self)


@singleton_task(app=app, bind=True, key=["tag"], on_conflict="raise")
def raise_task(self: SingletonTask, tag: str, seconds: float = 1.0) -> float:
    return body(tag, seconds, self)


@singleton_task(app=app, bind=True, key=["tag"], on_conflict="retry", retry_countdown=0.3, max_retries=100)
def retry_task(self: SingletonTask, tag: str, seconds: float = 1.0) -> float:
    return body(tag, seconds, self, retries=self.request.retries)


@singleton_task(app=app, bind=True, key=["tag", "k"], on_conflict="wait", lock_timeout=30)
def wait_task(self: SingletonTask, tag: str, k: int, seconds: float = 1.0) -> float:
    return body(tag, seconds, self, k=k)


@singleton_task(app=app, bind=True, key=["tag"], on_conflict="wait", lock_timeout=0.5)
def short_wait_task(self: SingletonTask, tag: str, seconds: float = 1.0) -> float:
    return body(tag, seconds, self)


@singleton_task(app=app, bind=True, key=["tag"], max_retries=5)
def self_retry_task(self: SingletonTask, tag: str, times: int = 2) -> int:
    """Retries itself ``times`` times (same task id each time), then succeeds."""
    body(tag, 0.2, self, retries=self.request.retries)
    if self.request.retries < times:
        raise self.retry(countdown=0.2)
    return self.request.retries


@singleton_task(app=app, bind=True, key="{tag}", dedupe_enqueue=True, dedupe_ttl=30)
def dedupe_task(self: SingletonTask, tag: str, seconds: float = 1.0) -> float:
    return body(tag, seconds, self)


@singleton_task(app=app, bind=True, key=["tag"], lock_ttl=SHORT_TTL, on_conflict="wait", lock_timeout=60)
def fragile_task(self: SingletonTask, tag: str, seconds: float = 1.0) -> float:
    """A short-TTL singleton, for tests that SIGKILL or SIGSTOP the process running it."""
    return body(tag, seconds, self)


@singleton_task(app=app, bind=True, key=["tag"], lock_ttl=3)
def cluster_task(self: SingletonTask, tag: str, seconds: float = 0.3) -> float:
    """A short-TTL singleton that skips while its lock is held: tests/test_cluster_faults.py sends one every 0.2 s.

    Its skips and its lock's releases are recorded too (``lockevents:<lock name>``), so that a
    skip decided on a stale read (naming a holder long released) can be told from a right one.
    """
    return body(tag, seconds, self)


def lock_events(lock_name: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in store().lrange(f"lockevents:{lock_name}", 0, -1)]


@task_skipped.connect
def _record_skip(sender: Any = None, lock_name: str = "", holders: Any = (), **_: Any) -> None:
    if getattr(sender, "name", None) == cluster_task.name:
        line = {"event": "skip", "tokens": [h["token"] for h in holders], "pid": os.getpid(), "wall": time.time()}
        store().rpush(f"lockevents:{lock_name}", json.dumps(line))


@lock_released.connect
def _record_release(sender: Any = None, token: int | None = None, data: Any = None, **_: Any) -> None:
    if (data or {}).get("task") == cluster_task.name:
        line = {"event": "released", "token": token, "pid": os.getpid(), "wall": time.time()}
        store().rpush(f"lockevents:{sender}", json.dumps(line))


@singleton_task(app=app, bind=True, key=["tag"], lock_ttl=60)
def long_ttl_task(self: SingletonTask, tag: str, seconds: float = 30.0) -> float:
    """A singleton whose lock outlives a dead holder by a minute, to tell a release from an expiry."""
    return body(tag, seconds, self)


@singleton_task(app=app, bind=True, key=["tag"], lock_ttl=60, soft_time_limit=1)
def soft_limit_task(self: SingletonTask, tag: str, seconds: float = 30.0) -> float:
    return body(tag, seconds, self)


@rwlock_task(app=app, bind=True, lock="rw-{tag}", mode="read")
def read_task(self: SingletonTask, tag: str, seconds: float = 1.0) -> float:
    return body(tag, seconds, self, mode="read")


@rwlock_task(app=app, bind=True, lock="rw-{tag}", mode="write")
def write_task(self: SingletonTask, tag: str, seconds: float = 1.0) -> float:
    return body(tag, seconds, self, mode="write")


@app.task(base=SingletonTask, bind=True, key=["tag"])
def base_task(self: SingletonTask, tag: str, seconds: float = 1.0) -> float:
    return body(tag, seconds, self)


@singleton_task(app=app, bind=True, key=["tag"])
def process_info(self: SingletonTask, tag: str, seconds: float = 0.5) -> dict[str, Any]:
    """What the process running this task uses: its pid, client and lock holder."""
    from celery_etcdlock.locks import client as client_module
    from celery_etcdlock.settings import client_for

    assert self.lock is not None
    info = {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "client": id(client_for(self.app)),
        "clients": len(client_module._clients),
        "holders": self.lock.holders(),
        "sigterm": getattr(signal.getsignal(signal.SIGTERM), "__name__", str(signal.getsignal(signal.SIGTERM))),
    }
    body(tag, seconds, self)
    return info


@limited_task(app=app, bind=True, limit=2, key=["tag"])
def limited_task_of_two(self: LimitedTask, tag: str, seconds: float = 1.0) -> float:
    return body(tag, seconds, self)


@app.task
def plain_task(tag: str, seconds: float = 0.0) -> float:
    time.sleep(seconds)
    return seconds
