"""Everything this package does to a Celery worker or beat: every signal hook, in one place.

    import celery_etcdlock.tasks.worker     # done for you by celery_etcdlock.tasks, .beat and the CLI

| Celery signal             | what happens                                                             |
| ------------------------- | ------------------------------------------------------------------------ |
| ``worker_init``           | metrics on, as ``etcdlock_metrics`` says (before the pool forks);        |
|                           | task events on with ``-E``; a pool that cannot keep locks alive          |
|                           | (eventlet) stops the start of a worker that has locked tasks             |
| ``worker_ready``          | the consumer's events state (``celery control enable_events``, as        |
|                           | Flower sends it) is followed, every second, by the pool processes too    |
| ``task_prerun``           | the primitives are listened to while events are on or signals have       |
|                           | receivers (events switched on at run time count from the next run)       |
| ``worker_process_init``   | a pool process notes it is one (``memory://`` is refused there); the     |
|                           | metrics forget the held locks of pool processes that died                |
| ``worker_process_shutdown`` | a pool process gives its locks back (v3 revokes its lease), and its    |
|                           | metrics count it dead                                                    |
| ``task_revoked``          | a revoked or expired message's enqueue marker is deleted (in the         |
|                           | background: the consumer must never wait for etcd)                       |
| ``celeryd_after_setup``   | the ``etcdlock_*`` settings are checked (settings.check_at_start): a     |
|                           | bad one stops the worker with one line; unknown and other libraries'     |
|                           | names are warnings; an unreachable etcd is one WARNING line              |
| ``beat_init``             | task events on as ``worker_send_task_events`` says; a beat of an app     |
|                           | that uses etcdlock but not the leader scheduler says that every beat     |
|                           | host sends every entry; its settings are checked (a ``LeaderScheduler``  |
|                           | checks them itself, when beat creates it, before this signal)            |

Nothing else is hooked. The one change to Celery itself that is not a signal,
masking ``etcdlock_url``'s password in Celery's settings dumps, is made by
the package's import (``celery_etcdlock.masking``), because it must hold in
processes that never load the task layer.

Each prefork child builds its own connections, session and renewer thread on
first use (Client and Session reset themselves after fork), so the parent
holds nothing. ``revoke(terminate=True)`` and the soft time limit raise in the
child (billiard turns SIGTERM into SystemExit), so a run's ``finally`` releases
its lock; SIGKILL and the hard time limit leave it to the TTL.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from celery import signals as celery_signals

from .. import green, metrics, settings, signals
from ..errors import UnsupportedPool
from .dedupe import forget_in_background
from .task import LimitedTask, task_client, used_clients

logger = logging.getLogger(__name__)


# -- worker_init: in the worker's main process, before its pool forks --------------------------------


def _worker_metrics(sender: Any = None, **_: Any) -> None:
    """Metrics on in the main process, so that its pool processes inherit them."""
    app = getattr(sender, "app", None)
    if app is not None:
        settings.enable_metrics(app)


def _worker_events(sender: Any = None, **_: Any) -> None:
    signals.events_of_worker(sender)


def _refuse_unsupported_pool(sender: Any = None, **_: Any) -> None:
    """A worker whose pool cannot keep locks alive (eventlet) does not start: every locked task would fail.

    Only a worker with locked tasks: this module is loaded by every ``celery`` command (the CLI
    entry point), also for apps that do not use this package.
    """
    app = getattr(sender, "app", None)
    if app is not None and not any(isinstance(task, LimitedTask) for task in app.tasks.values()):
        return
    try:
        green.check_pool()
    except UnsupportedPool as exc:
        raise SystemExit(f"celery_etcdlock: {exc}") from None  # Celery logs and ignores a handler's Exception


def _check_worker_settings(sender: Any = None, instance: Any = None, **_: Any) -> None:
    """After the worker's logging is set up, before its pool starts (a SystemExit here stops it cleanly)."""
    app = getattr(instance, "app", None)
    checked = settings.check_at_start(app, "worker") if app is not None else None
    if checked is not None:
        settings.probe(checked, "worker")


# -- pool processes ------------------------------------------------------------------------------------


def _note_pool_process(**_: Any) -> None:
    settings.note_pool_process()


def _forget_dead_pool_processes(**_: Any) -> None:
    """A new pool process often replaces one that was killed: its held locks must stop counting."""
    with contextlib.suppress(Exception):  # metrics never stop a worker
        metrics.forget_dead_processes()


def _close_clients(**_: Any) -> None:
    """A recycled pool child gives its sessions back at once (v3 revokes its lease)."""
    for client in list(used_clients):
        with contextlib.suppress(Exception):
            client.close()


def _pool_process_exits(**_: Any) -> None:
    with contextlib.suppress(Exception):
        metrics.mark_this_process_dead()


# -- the consumer ----------------------------------------------------------------------------------------


def _forget_marker_of_revoked(sender: Any = None, request: Any = None, **_: Any) -> None:
    """A revoked or expired message never runs: its enqueue marker must not keep others out.

    This runs in the worker's consumer, which must never wait for etcd: the delete is
    handed to a background thread (a marker that is not deleted expires anyway).
    """
    if not isinstance(sender, LimitedTask) or not sender.dedupe_enqueue or request is None or not request.id:
        return
    with contextlib.suppress(Exception):  # never fail the worker's revoke handling
        name = sender.lock_name_for(tuple(request.args or ()), dict(request.kwargs or {}))
        forget_in_background(task_client(sender.app), name, request.id)


# -- beat_init -------------------------------------------------------------------------------------------


def _check_beat_settings(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is not None:
        settings.check_at_start(app, "beat")


def _follow_worker_events(sender: Any = None, **_: Any) -> None:
    """``worker_ready``'s sender is the consumer, whose event dispatcher ``enable_events`` switches."""
    if sender is not None:
        signals.follow_consumer_events(sender)


def _events_as_now(**_: Any) -> None:
    """A task run starts: listen to the primitives if events are on now (they may have been switched)."""
    signals.listen_as_needed()


def _beat_events(sender: Any = None, **_: Any) -> None:
    signals.events_of_beat(sender)


def _warn_if_every_beat_sends(sender: Any = None, **_: Any) -> None:
    """A plain beat next to leader-elected ones sends every entry again: say so at its start."""
    app, scheduler = getattr(sender, "app", None), getattr(sender, "scheduler", None)
    if app is None or scheduler is None or getattr(scheduler, "elects_a_leader", False):
        return
    if not settings.uses_etcdlock(app):
        return
    logger.warning(
        "celery beat runs with %s, not %s: this beat sends every periodic task itself, and so does every other "
        "beat host; run each beat with -S %s (or set beat_scheduler) so that only the elected leader sends",
        type(scheduler).__module__ + "." + type(scheduler).__qualname__,
        settings.LEADER_SCHEDULER,
        settings.LEADER_SCHEDULER,
    )


# In the order they run; weak=False: these functions live as long as the module anyway.
HOOKS = (
    (celery_signals.worker_init, _worker_metrics),
    (celery_signals.worker_init, _worker_events),
    (celery_signals.worker_init, _refuse_unsupported_pool),
    (celery_signals.celeryd_after_setup, _check_worker_settings),
    (celery_signals.worker_ready, _follow_worker_events),
    (celery_signals.task_prerun, _events_as_now),
    (celery_signals.worker_process_init, _note_pool_process),
    (celery_signals.worker_process_init, _forget_dead_pool_processes),
    (celery_signals.worker_process_shutdown, _pool_process_exits),
    (celery_signals.worker_process_shutdown, _close_clients),
    (celery_signals.task_revoked, _forget_marker_of_revoked),
    (celery_signals.beat_init, _check_beat_settings),
    (celery_signals.beat_init, _warn_if_every_beat_sends),
    (celery_signals.beat_init, _beat_events),
)
for _signal, _hook in HOOKS:
    _signal.connect(_hook, weak=False)
