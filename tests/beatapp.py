"""A Celery app for the beat tests, configured by environment variables.

    BEATAPP_BROKER=redis://127.0.0.1:6379/0 ETCDLOCK_URL=etcd://127.0.0.1:2379?prefix=/t1 \\
    BEATAPP_BEAT_TTL=3 BEATAPP_SCHEDULE=every,cron \\
        celery -A tests.beatapp beat -S celery_etcdlock.beat:LeaderScheduler
    celery -A tests.beatapp worker -P solo

- ``BEATAPP_BROKER``: the Redis broker URL (also where runs are recorded).
- ``BEATAPP_RUNS``: the Redis list each run is appended to (JSON), default "beatapp:runs".
- ``BEATAPP_QUEUE``: the queue name, so that tests sharing a Redis do not mix.
- ``ETCDLOCK_URL``, ``ETCDLOCK_PREFIX``, ``BEATAPP_BEAT_TTL``, ``BEATAPP_BEAT_NAME``,
  ``BEATAPP_RETRY_MAX_DELAY``: the etcdlock settings.
- ``BEATAPP_SCHEDULE``: comma-separated entries to schedule, among ``every`` (1 s interval,
  args and kwargs), ``every2`` (2 s), ``cron`` (crontab, every minute), ``solar``
  (sunset in Paris, never due in a test).

Each run records ``{"entry", "sender", "sent_at", "ran_at"}``: ``sender``
(``host:pid``) and ``sent_at`` are evaluated in the beat process when it sends
(``BeatLazyFunc``), ``ran_at`` in the worker.
"""

from __future__ import annotations

import json
import os
import socket
import time
from datetime import timedelta

import redis
from celery import Celery
from celery.beat import BeatLazyFunc
from celery.schedules import crontab, solar
from celery.signals import after_task_publish
from celery.utils.log import get_logger

BROKER = os.environ.get("BEATAPP_BROKER", "redis://127.0.0.1:6379/0")
RUNS = os.environ.get("BEATAPP_RUNS", "beatapp:runs")
QUEUE = os.environ.get("BEATAPP_QUEUE", "beatapp")

app = Celery("beatapp", broker=BROKER)
app.conf.update(
    task_default_queue=QUEUE,
    task_ignore_result=True,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    beat_max_loop_interval=5,
    etcdlock_url=os.environ.get("ETCDLOCK_URL", "etcd://127.0.0.1:2379"),
    etcdlock_beat_ttl=float(os.environ.get("BEATAPP_BEAT_TTL", "10")),
    etcdlock_retry_max_delay=float(os.environ.get("BEATAPP_RETRY_MAX_DELAY", "5")),
    beat_scheduler="celery_etcdlock.beat:LeaderScheduler",
)
if os.environ.get("ETCDLOCK_PREFIX"):
    app.conf.etcdlock_prefix = os.environ["ETCDLOCK_PREFIX"]
if os.environ.get("BEATAPP_BEAT_NAME"):
    app.conf.etcdlock_beat_name = os.environ["BEATAPP_BEAT_NAME"]


def sender() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


ENTRIES = {
    "every": {
        "task": "tests.beatapp.record",
        "schedule": timedelta(seconds=1),
        "args": (BeatLazyFunc(sender), BeatLazyFunc(time.time)),
        "kwargs": {"entry": "every"},
        "options": {"expires": 30},
    },
    "every2": {
        "task": "tests.beatapp.record",
        "schedule": 2.0,
        "args": (BeatLazyFunc(sender), BeatLazyFunc(time.time)),
        "kwargs": {"entry": "every2"},
    },
    "cron": {
        "task": "tests.beatapp.record",
        "schedule": crontab(minute="*"),
        "args": (BeatLazyFunc(sender), BeatLazyFunc(time.time)),
        "kwargs": {"entry": "cron"},
    },
}
SCHEDULED = [name for name in os.environ.get("BEATAPP_SCHEDULE", "every").split(",") if name]
if "solar" in SCHEDULED:  # needs ephem (celery[solar])
    ENTRIES["solar"] = {
        "task": "tests.beatapp.record",
        "schedule": solar("sunset", 48.85, 2.35),
        "args": (BeatLazyFunc(sender), BeatLazyFunc(time.time)),
        "kwargs": {"entry": "solar"},
    }
app.conf.beat_schedule = {name: ENTRIES[name] for name in SCHEDULED}

_redis: redis.Redis | None = None
logger = get_logger(__name__)


def origin_identity(origin: object) -> str:
    """A message's ``origin`` header (``gen<pid>@<host>``) as a beat's identity (``<host>:<pid>``)."""
    text = str(origin or "?")
    pid, _, host = text.partition("@")
    return f"{host}:{pid.removeprefix('gen')}" if host else text


@after_task_publish.connect
def log_published(headers: dict | None = None, body: object = None, **_: object) -> None:
    """One line per message the beat published, for tests to count (``PUBLISHED <entry> <sender>``).

    The sender is the first argument of the static entries, and for runtime entries (JSON
    arguments only) the message's origin.
    """
    if isinstance(body, tuple) and len(body) >= 2:
        args, kwargs = body[0], body[1]
        sender = args[0] if args else origin_identity((headers or {}).get("origin"))
        logger.warning("PUBLISHED %s %s %.6f", kwargs.get("entry"), sender, time.time())


@app.task(name="tests.beatapp.record_runtime", bind=True)
def record_runtime(self: object, entry: str = "") -> None:
    """A runtime entry's run (its arguments are JSON): the sender is the message's origin."""
    global _redis
    if _redis is None:
        _redis = redis.Redis.from_url(BROKER)
    request = self.request  # type: ignore[attr-defined]
    ran_at = time.time()  # no time from the beat: the arguments are the entry's JSON
    run = {"entry": entry, "sender": origin_identity(request.origin), "sent_at": ran_at, "ran_at": ran_at}
    _redis.rpush(RUNS, json.dumps(run))


@app.task(name="tests.beatapp.record")
def record(sender: str, sent_at: float, entry: str = "") -> None:
    global _redis
    if _redis is None:
        _redis = redis.Redis.from_url(BROKER)
    run = {"entry": entry, "sender": sender, "sent_at": sent_at, "ran_at": time.time()}
    _redis.rpush(RUNS, json.dumps(run))
