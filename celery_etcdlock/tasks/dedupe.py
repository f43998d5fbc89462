"""Enqueue-time deduplication: at most one instance per lock name queued or running.

    markers = EnqueueMarkers(client)
    ttl = dedupe_ttl + enqueue_delay(options, app.now)
    other = markers.claim(lock_name, task_id, task.name, ttl=ttl)
    if other is not None:
        return task.AsyncResult(other)          # already queued or running
    ...send the message; markers.forget(lock_name, task_id) if sending fails

A marker is a ``DocumentStore`` document of kind ``"enqueued"`` named after
the lock the task will take, holding the queued task id. It is created by
compare-and-swap, so of two callers racing only one queues. The run forgets
it as soon as it holds its lock (the lock's holder data then names the
running instance) or gives up the run; should the message be lost, the
marker expires after ``dedupe_ttl`` seconds plus any countdown or ETA.
"""

from __future__ import annotations

import collections
import datetime
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from celery.utils.time import maybe_make_aware
from kombu import serialization

from ..errors import EtcdLockError, TaskLocked
from ..keys import LOCKS, queue_key
from ..locks.client import Client
from ..locks.queue import read_state
from ..locks.store import DocumentStore

logger = logging.getLogger(__name__)

MARKERS = "enqueued"  # the DocumentStore kind of the markers
CLAIM_ATTEMPTS = 5  # compare-and-swap rounds lost to other callers before giving up


class EnqueueMarkers:
    def __init__(self, client: Client) -> None:
        self.client = client
        self.store = DocumentStore(client, MARKERS)

    def claim(self, name: str, task_id: str, task: str, *, ttl: float) -> str | None:
        """Record ``task_id`` as the instance queued for ``name``.

        None if recorded (or already ours); else the id of the other instance
        already queued or running, which the caller returns instead of queueing.
        """
        for _attempt in range(CLAIM_ATTEMPTS):
            marker = self.store.get(name)
            if marker is not None:
                queued = marker.value.get("task_id")
                if queued and queued != task_id:
                    logger.info("task %s already queued as %s (%s); not queued again", task, queued, name)
                    return str(queued)
                return None  # our own marker: a retry re-sending this instance
            running = self._running_task_id(name)
            if running and running != task_id:
                logger.info("task %s already running as %s (%s); not queued again", task, running, name)
                return running
            if self.store.put(name, {"task_id": task_id, "task": task}, expect=None, ttl=ttl) is not None:
                return None
        raise TaskLocked(f"could not record the enqueue marker of {name}: it kept changing", lock_name=name)

    def forget(self, name: str, task_id: str) -> None:
        """Delete the marker of ``name`` if it is ``task_id``'s (never another instance's)."""
        try:
            marker = self.store.get(name)
            if marker is not None and marker.value.get("task_id") == task_id:
                self.store.delete(name, expect=marker)
        except EtcdLockError as exc:
            logger.warning("could not delete the enqueue marker of %s (task %s): %s", name, task_id, exc)

    def _running_task_id(self, name: str) -> str | None:
        try:
            holders = read_state(self.client, queue_key(LOCKS, name)).described()
        except EtcdLockError as exc:
            logger.warning("could not read the holders of %s: %s", name, exc)
            return None
        for holder in holders:
            task_id = holder["data"].get("task_id")
            if task_id:
                return str(task_id)
        return None


class _Forgetter:
    """Deletes enqueue markers for callers that must not wait for etcd (the worker's consumer).

        forgetter.put(client, name, task_id)    # returns at once; False if BACKLOG deletes wait

    Its thread runs only while deletes wait, and a fork waits up to ``FORK_PATIENCE`` seconds
    for it to finish: the consumer runs in a prefork worker's parent, which forks a new pool
    process whenever one exits, and a thread alive at a fork may hold a lock (ours, logging's,
    prometheus_client's) that the child then never gets (Python 3.12+ warns of exactly that).
    A child starts with no deletes and no thread. At most ``BACKLOG`` deletes wait; beyond
    that a marker is left to expire by its TTL, which is what happens to all of them anyway
    while etcd is down.
    """

    BACKLOG = 1000
    FORK_PATIENCE = 2.0  # seconds; a delete is two requests, unless etcd is down (then the fork goes on)

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(before=self._before_fork, after_in_child=self._reset)

    def _reset(self) -> None:
        self._mutex = threading.Lock()
        self._todo: collections.deque[tuple[Client, str, str]] = collections.deque()
        self._thread: threading.Thread | None = None  # the running one, or the last one (finished)
        self._running = False

    def put(self, client: Client, name: str, task_id: str) -> bool:
        with self._mutex:
            if len(self._todo) >= self.BACKLOG:
                return False
            self._todo.append((client, name, task_id))
            if not self._running:
                self._running = True
                self._thread = threading.Thread(target=self._run, name="etcdlock-marker-forgetter", daemon=True)
                self._thread.start()
        return True

    def _run(self) -> None:
        while True:
            with self._mutex:
                if not self._todo:
                    self._running = False  # the next put() starts another thread
                    return
                client, name, task_id = self._todo.popleft()
            EnqueueMarkers(client).forget(name, task_id)  # logs, never raises

    def _before_fork(self) -> None:
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(self.FORK_PATIENCE)


_forgetter = _Forgetter()


def forget_in_background(client: Client, name: str, task_id: str) -> None:
    """``EnqueueMarkers(client).forget(name, task_id)`` on a background thread; returns at once."""
    if not _forgetter.put(client, name, task_id):
        logger.warning("too many markers to delete; the marker of %s (task %s) expires by itself", name, task_id)


def as_delivered(value: Any, serializer: str | None) -> Any:
    """``value`` after the round trip through the task's serializer that a worker will see."""
    content_type, encoding, data = serialization.dumps(value, serializer=serializer)
    return serialization.loads(data, content_type, encoding, accept={content_type})


def enqueue_delay(options: dict[str, Any], now: Callable[[], datetime.datetime]) -> float:
    """Seconds a message sent with these ``apply_async`` options waits before it may run."""
    countdown = options.get("countdown")
    if countdown is not None:
        return max(0.0, float(countdown))
    eta = options.get("eta")
    if isinstance(eta, str):
        eta = datetime.datetime.fromisoformat(eta)
    if isinstance(eta, datetime.datetime):
        return max(0.0, float((maybe_make_aware(eta) - now()).total_seconds()))
    return 0.0
