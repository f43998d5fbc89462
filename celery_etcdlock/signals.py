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
``worker_send_task_events = True``, which beat follows too), so that
``celery events`` and Flower show them:

- ``task-skipped``: ``uuid`` (the task id), ``name`` (the task), ``lock``, ``holders``;
- ``task-lock-lost``: ``uuid``, ``name``, ``lock``, ``token``, ``cause``;
- ``etcdlock-leader-elected`` / ``etcdlock-leader-deposed``: ``election``,
  ``identity``, ``token``, ``cause``.

The primitives know nothing of this module: they report through
``celery_etcdlock.observe``, which this module listens to.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import signals as celery_signals
from celery.utils.dispatch import Signal

from . import observe

logger = logging.getLogger(__name__)

lock_acquired = Signal(name="lock_acquired")
lock_released = Signal(name="lock_released")
lock_lost = Signal(name="lock_lost")
task_skipped = Signal(name="task_skipped")
leader_elected = Signal(name="leader_elected")
leader_deposed = Signal(name="leader_deposed")

_LOCK_SIGNALS = {observe.ACQUIRED: lock_acquired, observe.RELEASED: lock_released, observe.LOST: lock_lost}

# -- events -----------------------------------------------------------------------------------------

_events: dict[str, Any] = {"app": None, "enabled": False, "hostname": None}


@celery_signals.worker_init.connect(weak=False)
def _worker_events(sender: Any = None, **_: Any) -> None:
    """A worker decides with -E (``task_events``); its pool children inherit the answer through fork."""
    _events.update(app=getattr(sender, "app", None), enabled=bool(getattr(sender, "task_events", False)),
                   hostname=getattr(sender, "hostname", None))  # fmt: skip


@celery_signals.beat_init.connect(weak=False)
def _beat_events(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    enabled = bool(app is not None and app.conf.worker_send_task_events)
    _events.update(app=app, enabled=enabled, hostname=f"beat@{getattr(sender, 'hostname', None) or 'localhost'}")


def send_event(type_: str, **fields: Any) -> None:
    """Publish a Celery event, if task events are on in this process; never raises, never retries."""
    app = _events["app"]
    if not _events["enabled"] or app is None:
        return
    try:
        with app.events.default_dispatcher(hostname=_events["hostname"]) as dispatcher:
            dispatcher.send(type_, retry=False, **fields)
    except Exception as exc:  # an event is worth less than the work that produced it
        logger.debug("could not send the %s event: %s", type_, exc)


# -- from the primitives' reports to signals and events ------------------------------------------------


def _from_primitives(event: observe.Event) -> None:
    task_id = event.data.get("task_id")
    if event.kind in _LOCK_SIGNALS and event.primitive != "election":
        duration = "waited" if event.kind == observe.ACQUIRED else "held"
        details = {"cause": event.cause} if event.kind == observe.LOST else {}
        _LOCK_SIGNALS[event.kind].send(
            sender=event.name,
            name=event.name,
            kind=event.primitive,
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


observe.subscribe(_from_primitives)


def skipped(task: Any, task_id: str | None, lock_name: str, holders: list[dict[str, Any]]) -> None:
    """A run of ``task`` was skipped because ``lock_name`` was held: the signal, and the event if events are on."""
    task_skipped.send(sender=task, task_id=task_id, lock_name=lock_name, holders=holders)
    if task_id:
        send_event("task-skipped", uuid=task_id, name=task.name, lock=lock_name, holders=holders)
