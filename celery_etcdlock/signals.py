"""Celery signals and events for what the locks and the elections do.

    from celery_etcdlock import signals

    @signals.task_skipped.connect
    def note_skip(sender, task_id, lock_name, holders, **kwargs):
        print(f"{sender.name}[{task_id}] skipped: {lock_name} held by {holders}")

Signals (``celery.utils.dispatch.Signal``, connected like Celery's own);
every one is sent with these keyword arguments, ``sender`` first:

- ``lock_acquired`` (sender: the lock name): ``name``, ``kind`` (``"mutex"``,
  ``"read"``, ``"write"``), ``token``, ``holder`` (``host:pid``), ``data`` (what
  the holder recorded: a task's ``task_id``, ``task``, ``hostname``), ``task_id``
  (None outside a task), ``waited`` (seconds).
- ``lock_released`` (sender: the lock name): the same, with ``held`` (seconds) for ``waited``.
- ``lock_lost`` (sender: the lock name): the same, with ``held``, ``cause``
  (``"deleted"``, ``"late"``, ``"revoked"``, ``"closed"``).
- ``task_skipped`` (sender: the task): ``task_id``, ``lock_name``, ``holders``
  (as ``Mutex.holders()`` lists them).
- ``leader_elected`` (sender: the election name): ``name``, ``identity``, ``token``.
- ``leader_deposed`` (sender: the election name): ``name``, ``identity``,
  ``token``, ``cause`` (None when it resigned).

A receiver runs on the thread that saw the event: a task's, or the renewer
of the lock's session for ``lock_lost``. Keep it short; an exception in it is
logged and dropped.

Celery events, when task events are on (``celery worker -E``, or
``worker_send_task_events = True``, which beat follows too; a worker's also
when switched on at run time by ``celery control enable_events``, as Flower
does, within a second and in its pool processes too), so that ``celery
events`` and Flower show them:

- ``task-skipped``: ``uuid`` (the task id), ``name`` (the task), ``lock``, ``holders``;
- ``task-lock-lost``: ``uuid``, ``name``, ``lock``, ``token``, ``cause``;
- ``etcdlock-leader-elected`` / ``etcdlock-leader-deposed``: ``election``,
  ``identity``, ``token``, ``cause``.

The primitives know nothing of this module: they report through
``celery_etcdlock.observe``, which this module listens to only while one of
its signals has a receiver or events are on, so that importing it costs a
process nothing. The worker and beat hooks that turn events on live in
``celery_etcdlock.tasks.worker``.
"""

from __future__ import annotations

import logging
import mmap
from typing import Any

from celery.utils.dispatch import Signal

from . import observe
from .locks.queue import Holder

logger = logging.getLogger(__name__)


class _Signal(Signal):
    """A Celery signal whose first receiver makes this module listen to the primitives.

    Until then nothing listens: a primitive's report costs one test of an empty list
    (``observe``'s promise), in every process that merely imports this module.
    """

    def connect(self, *args: Any, **kwargs: Any) -> Any:
        observe.subscribe(_from_primitives)  # before the receiver: it must not miss a report
        return super().connect(*args, **kwargs)

    def disconnect(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().disconnect(*args, **kwargs)
        finally:
            listen_as_needed()


lock_acquired = _Signal(name="lock_acquired")
lock_released = _Signal(name="lock_released")
lock_lost = _Signal(name="lock_lost")
task_skipped = _Signal(name="task_skipped")
leader_elected = _Signal(name="leader_elected")
leader_deposed = _Signal(name="leader_deposed")

_LOCK_SIGNALS = {observe.ACQUIRED: lock_acquired, observe.RELEASED: lock_released, observe.LOST: lock_lost}
_REPORTED = (lock_acquired, lock_released, lock_lost, leader_elected, leader_deposed)  # fed by observe

# -- events -----------------------------------------------------------------------------------------

_events: dict[str, Any] = {"app": None, "enabled": False, "hostname": None, "flag": None}

#: seconds between two looks of a worker's main process at its events state (``celery control enable_events``)
EVENTS_POLL = 1.0


def events_of_worker(worker: Any) -> None:
    """A worker starts with -E (``task_events``) or not, and can be switched at run time.

    ``celery control enable_events`` / ``disable_events`` (as Flower sends them) change the task
    group of the consumer's event dispatcher, in the worker's main process only. So the answer
    lives in one byte of memory shared with the pool processes (an anonymous shared mapping made
    here, before the pool forks); ``follow_consumer_events`` keeps it up to date. Called at
    ``worker_init`` (tasks/worker.py).
    """
    flag = mmap.mmap(-1, 1)  # MAP_SHARED: a forked pool process sees every later write
    flag[0] = bool(getattr(worker, "task_events", False))
    _events.update(app=getattr(worker, "app", None), enabled=bool(flag[0]),
                   hostname=getattr(worker, "hostname", None), flag=flag)  # fmt: skip
    listen_as_needed()


def follow_consumer_events(consumer: Any) -> None:
    """Copy the consumer's events state into the shared byte, now and every ``EVENTS_POLL`` s (``worker_ready``)."""
    timer = getattr(consumer, "timer", None)
    _note_consumer_events(consumer)
    if timer is not None:
        timer.call_repeatedly(EVENTS_POLL, _note_consumer_events, (consumer,))


def _note_consumer_events(consumer: Any) -> None:
    flag = _events["flag"]
    dispatcher = getattr(consumer, "event_dispatcher", None)
    if flag is None or dispatcher is None:
        return
    groups = dispatcher.groups  # None: every group (-E); else the groups sent ({"worker"}, plus "task" once enabled)
    flag[0] = bool(dispatcher.enabled and (not groups or "task" in groups))


def events_on() -> bool:
    """Whether this process sends the package's events now (a worker's may change at run time)."""
    flag = _events["flag"]
    return bool(flag[0]) if flag is not None else bool(_events["enabled"])


def events_of_beat(beat: Any) -> None:
    """A beat follows ``worker_send_task_events``. Called at ``beat_init`` (tasks/worker.py)."""
    app = getattr(beat, "app", None)
    enabled = bool(app is not None and app.conf.worker_send_task_events)
    _events.update(app=app, enabled=enabled, hostname=f"beat@{getattr(beat, 'hostname', None) or 'localhost'}")
    listen_as_needed()


def listen_as_needed() -> None:
    """Listen to the primitives while a signal has a receiver or events are on; else not at all.

    A worker's task runs call it as they start (``task_prerun``): events switched on at run time
    take effect from the next run, and a process with nothing to tell pays nothing.
    """
    if events_on() or any(signal.receivers for signal in _REPORTED):
        observe.subscribe(_from_primitives)
    else:
        observe.unsubscribe(_from_primitives)


def send_event(type_: str, **fields: Any) -> None:
    """Publish a Celery event, if task events are on in this process; never raises, never retries."""
    app = _events["app"]
    if app is None or not events_on():
        return
    try:
        with app.events.default_dispatcher(hostname=_events["hostname"]) as dispatcher:
            dispatcher.send(type_, retry=False, **fields)
    except Exception as exc:  # an event is worth less than the work that produced it
        logger.debug("could not send the %s event: %s", type_, exc)


# -- from the primitives' reports to signals and events ------------------------------------------------


def _from_primitives(event: observe.Event) -> None:
    task_id = event.data.get("task_id")
    if event.kind in _LOCK_SIGNALS and event.lock_kind != "election":
        duration = "waited" if event.kind == observe.ACQUIRED else "held"
        details = {"cause": event.cause} if event.kind == observe.LOST else {}
        _LOCK_SIGNALS[event.kind].send(
            sender=event.name,
            name=event.name,
            kind=event.lock_kind,
            token=event.token,
            holder=event.holder,
            data=event.data,
            task_id=task_id,
            **{duration: event.seconds},
            **details,
        )
        if event.kind == observe.LOST and task_id:
            send_event("task-lock-lost", uuid=task_id, name=event.data.get("task"), lock=event.name,
                       token=event.token, cause=event.cause)  # fmt: skip
    elif event.kind == observe.ELECTED:
        identity = event.data.get("identity")
        leader_elected.send(sender=event.name, name=event.name, identity=identity, token=event.token)
        send_event("etcdlock-leader-elected", election=event.name, identity=identity, token=event.token, cause=None)
    elif event.kind in (observe.DEPOSED, observe.RESIGNED):
        identity = event.data.get("identity")
        cause = event.cause if event.kind == observe.DEPOSED else None
        leader_deposed.send(sender=event.name, name=event.name, identity=identity, token=event.token, cause=cause)
        send_event("etcdlock-leader-deposed", election=event.name, identity=identity, token=event.token, cause=cause)


def skipped(task: Any, task_id: str | None, lock_name: str, holders: list[Holder]) -> None:
    """A run of ``task`` was skipped because ``lock_name`` was held: the signal, and the event if events are on."""
    task_skipped.send(sender=task, task_id=task_id, lock_name=lock_name, holders=holders)
    if task_id:
        send_event("task-skipped", uuid=task_id, name=task.name, lock=lock_name, holders=holders)
