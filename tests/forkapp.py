"""A Celery app whose worker parent does, before its pool forks, what users' apps do (tests/test_fork_safety.py).

    FORK_LOG=/tmp/forks.jsonl ETCDLOCK_TEST_ETCD_URL=etcd3://127.0.0.1:40123?prefix=/f \\
    ETCDLOCK_TEST_REDIS_URL=redis://127.0.0.1:40125/1 \\
    celery -A tests.forkapp worker -P prefork -c 1 --max-tasks-per-child=1 -B -s /tmp/beat

In the worker's parent, before anything forks:

- ``forkcheck`` records every fork from here on (and 3.12+'s fork-with-threads warning);
- a client is ``connect()``-ed at import, and read through (``Mutex.holders``) at
  ``worker_init``; the tasks take their locks through it too;
- at ``worker_init`` the package checks the settings and turns the metrics on.

With ``--max-tasks-per-child=1`` the parent forks a new pool process after every task,
long after it started: after the beat process (``-B``, a ``LeaderScheduler``, forked too)
sent ``tick`` and after the consumer handed a revoked task's enqueue marker to its
background forgetter. Runs are recorded in Redis: ``ticks`` (pids) and ``jobs:<tag>``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery, signals

from celery_etcdlock import Mutex, connect
from celery_etcdlock.tasks import singleton_task
from tests import forkcheck

if os.environ.get("FORK_LOG"):  # in the worker, not in the tests that import this module
    forkcheck.install()

ETCD_URL = os.environ.get("ETCDLOCK_TEST_ETCD_URL", "etcd3://127.0.0.1:2379?prefix=/etcdlock-forkapp")
REDIS_URL = os.environ.get("ETCDLOCK_TEST_REDIS_URL", "redis://127.0.0.1:6379/1")
LOCK_TTL = 3  # seconds

app = Celery("forkapp", broker=REDIS_URL, backend=REDIS_URL)
app.conf.update(
    etcdlock_url=ETCD_URL,
    etcdlock_retry_max_delay=10,
    etcdlock_beat_ttl=3,
    beat_scheduler="celery_etcdlock.beat:LeaderScheduler",
    beat_schedule={"tick": {"task": "tests.forkapp.tick", "schedule": 1.0, "options": {"expires": 30}}},
    beat_max_loop_interval=1,
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)

parent_client = connect(ETCD_URL)  # at import: in the worker's parent, inherited by every pool process


@signals.worker_init.connect(weak=False)
def _read_in_the_parent(sender: Any = None, **_: Any) -> None:
    # Celery's signals are global: a test run that imported this module starts workers of other apps
    # (test_tasks' in-process ones), and a read of the default etcd here held each one's start for 30 s
    if getattr(sender, "app", None) is not app:
        return
    Mutex(parent_client, "forkapp-parent", ttl=LOCK_TTL).holders()  # a read: kept-alive sockets, no thread


def store() -> redis.Redis:
    return redis.Redis.from_url(REDIS_URL)


@app.task
def tick() -> int:
    store().rpush("ticks", os.getpid())
    return os.getpid()


@singleton_task(app=app, key=["tag"], lock_ttl=LOCK_TTL, on_conflict="skip", dedupe_enqueue=True)
def job(tag: str) -> dict[str, Any]:
    """A locked task that also locks through the client connect()-ed in the parent."""
    with Mutex(parent_client, f"job-{tag}", ttl=LOCK_TTL) as inner:
        run = {"pid": os.getpid(), "token": inner.token, "at": time.time()}
    store().rpush(f"jobs:{tag}", json.dumps(run))
    return run
