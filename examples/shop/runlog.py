"""What every run and every beat send did, kept in Redis for the demo's view and its checks.

A task wraps its body::

    with runlog.run(self, mode="write", key=str(customer_id)):
        ...

which stores, under the task id, the lock it holds (name and fencing token),
the worker node and process, and the start and end times. Runs that
``on_conflict="skip"`` turned away are counted per task, beat processes log
each task they send, and workers and beats announce themselves. Nothing
here takes part in locking: it only watches.

Redis keys (under ``shop:``): ``runs`` (hash: task id -> JSON run),
``skips`` (hash: task name -> count), ``sends`` (list of JSON sends),
``procs`` (hash: pid -> JSON process).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
from celery import signals

from .app import app

RUNS = "shop:runs"
SKIPS = "shop:skips"
SENDS = "shop:sends"
PROCS = "shop:procs"

_connection: redis.Redis | None = None
_ran: set[str] = set()  # task ids whose body ran in this process (the others were skipped)
_beat_name: str | None = None  # set in a beat process


def connection() -> redis.Redis:
    global _connection
    if _connection is None:  # redis-py reconnects by itself in a forked child
        _connection = redis.Redis.from_url(app.conf.shop_runlog_url)
    return _connection


def node_name() -> str:
    """This process's name in the demo (SHOP_NODE), else the host name."""
    return os.environ.get("SHOP_NODE") or socket.gethostname()


@contextmanager
def run(task: Any, mode: str, key: str | None = None) -> Iterator[dict[str, Any]]:
    """Log one run of the bound ``task``, which holds ``task.lock``, while the block runs."""
    lock = getattr(task, "lock", None)
    record: dict[str, Any] = {
        "id": task.request.id,
        "task": task.name,
        "key": key,
        "lock": getattr(lock, "name", None),
        "mode": mode,
        "token": getattr(lock, "token", None),
        "worker": task.request.hostname,
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "start": time.time(),
        "end": None,
    }
    _ran.add(task.request.id)
    connection().hset(RUNS, record["id"], json.dumps(record))
    try:
        yield record
    finally:
        record["end"] = time.time()
        record["held_to_end"] = bool(getattr(lock, "held", False))
        connection().hset(RUNS, record["id"], json.dumps(record))


@signals.task_postrun.connect
def _count_skips(task_id: str, task: Any, retval: Any = None, state: str | None = None, **_: Any) -> None:
    if task_id in _ran:
        _ran.discard(task_id)
    elif state == "SUCCESS" and retval is None:
        connection().hincrby(SKIPS, task.name, 1)


@signals.before_task_publish.connect
def _log_send(headers: dict[str, Any] | None = None, **_: Any) -> None:
    if _beat_name is None or not headers:
        return
    send = {
        "task": headers.get("task"),
        "args": headers.get("argsrepr"),
        "beat": _beat_name,
        "pid": os.getpid(),
        "time": time.time(),
    }
    connection().rpush(SENDS, json.dumps(send))


def _announce(role: str, name: str) -> None:
    process = {"role": role, "name": name, "pid": os.getpid(), "host": socket.gethostname(), "start": time.time()}
    connection().hset(PROCS, str(os.getpid()), json.dumps(process))


@signals.beat_init.connect
def _beat_started(**_: Any) -> None:
    global _beat_name
    _beat_name = node_name()
    _announce("beat", _beat_name)


@signals.worker_ready.connect
def _worker_started(sender: Any = None, **_: Any) -> None:
    _announce("worker", getattr(sender, "hostname", None) or node_name())
