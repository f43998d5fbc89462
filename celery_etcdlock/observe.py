"""What the primitives report, and who listens.

The primitives must not know about Celery, Prometheus or anyone else who
wants to see what they do. They call ``report(Event(...))``; the Celery layer
(signals and task events) and the metrics subscribe. With nobody subscribed,
a report costs one test of an empty list.

    def show(event: Event) -> None:
        print(event.kind, event.name, event.token)

    subscribe(show)     # every event from now on, from whichever thread reports it
    unsubscribe(show)

A subscriber runs on the reporting thread (a task's, or a session's renewer):
keep it short, and never raise (an exception is logged and dropped).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

# What happened (Event.kind):
ACQUIRED = "acquired"  # a lock (or a slot, or a read share) was taken; ``seconds`` waited
RELEASED = "released"  # it was given back; ``seconds`` held
LOST = "lost"  # it was lost while held; ``cause`` says why, ``seconds`` held
CONFLICT = "conflict"  # an acquire found it taken and gave up at once (a skip) or began to wait
TIMED_OUT = "timed_out"  # an acquire waited ``seconds`` and gave up
ELECTED = "elected"  # this process leads the election ``name``
DEPOSED = "deposed"  # it stopped leading without resigning
RESIGNED = "resigned"  # it stopped leading by resigning
STANDBY = "standby"  # it campaigns while another candidate leads (``holders``: the leader)
TASK_CONFLICT = "task_conflict"  # a task run found its lock held; ``data["on_conflict"]`` says what it does about it
BEAT_SENT = "beat_sent"  # the beat leader sent the periodic task ``data["entry"]`` of beat ``name``
RETRY = "retry"  # an etcd request failed transiently and is retried (``endpoint``, ``operation``)
FAILED = "failed"  # an etcd operation gave up (``endpoint``, ``operation``)

# Why a lock was lost (Event.cause, LockLost.cause):
DELETED = "deleted"  # its key was deleted: force-released (celery etcdlock release) or by another client
LATE = "late"  # no renewal succeeded in time: etcd unreachable, or this process was paused
REVOKED = "revoked"  # its lease was revoked or expired on the server while the holder was still renewing
CLOSED = "closed"  # its client was closed


@dataclass(frozen=True)
class Event:
    kind: str
    name: str = ""  # the lock or election name ("" for RETRY/FAILED)
    lock_kind: str = ""  # the lock's kind: "mutex", "read", "write", "semaphore", "election"
    token: int | None = None
    holder: str | None = None  # "host:pid" of this process, or the identity of a candidate
    data: dict[str, Any] = field(default_factory=dict)  # what the holder recorded (task id, task name, worker)
    seconds: float | None = None  # waited (ACQUIRED, TIMED_OUT) or held (RELEASED, LOST)
    cause: str | None = None  # LOST only
    holders: tuple[Mapping[str, Any], ...] = ()  # CONFLICT, TIMED_OUT: who held it, as ``holders()`` describes them
    blocking: bool = False  # CONFLICT: the acquire goes on to wait (else it gave up at once)
    endpoint: str | None = None  # RETRY, FAILED
    operation: str | None = None  # RETRY, FAILED


Subscriber = Callable[[Event], None]
_subscribers: list[Subscriber] = []


def subscribe(subscriber: Subscriber) -> None:
    """Call ``subscriber(event)`` for every event reported from now on (once, however often subscribed)."""
    if subscriber not in _subscribers:
        _subscribers.append(subscriber)


def unsubscribe(subscriber: Subscriber) -> None:
    if subscriber in _subscribers:
        _subscribers.remove(subscriber)


def report(event: Event) -> None:
    for subscriber in tuple(_subscribers):
        try:
            subscriber(event)
        except Exception:  # a listener must never break a lock
            logger.exception("observer %r failed on %s of %s", subscriber, event.kind, event.name)


def listening() -> bool:
    """True if anyone subscribed: reporters may skip building an event nobody reads."""
    return bool(_subscribers)
