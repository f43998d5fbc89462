"""The run life cycle of a locked Celery task: take the lock, run, release it however the run ends.

    from celery_etcdlock import singleton_task, rwlock_task, SingletonTask

    @singleton_task                                       # one run at a time, cluster-wide
    def rebuild_cache(): ...

    @singleton_task(key=["customer_id"], on_conflict="retry", dedupe_enqueue=True)
    def sync_customer(customer_id, full=False): ...       # one run (and one queued) per customer

    @rwlock_task(lock="search-index", mode="read")        # many readers at once, no writer
    def query_index(q): ...

    @app.task(base=SingletonTask, bind=True, lock_ttl=60)
    def report(self):
        self.lock.token                                   # fencing token of the held lock

The lock is taken when the worker starts running the task (never at enqueue,
so a redelivered or ETA message is safe), renewed by the process's session
while it runs, and released however the run ends. A worker that dies frees
it within ``lock_ttl``. Its etcd value records the task id, task name and
worker hostname. ``dedupe_enqueue=True`` also makes ``apply_async``/``delay``
of an instance whose key is already queued or running return that
instance's ``AsyncResult`` instead of queueing another.
"""

from __future__ import annotations

import socket
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import celery
from celery.utils.log import get_logger

from ..errors import BackendUnavailable, LockLost
from ..locks.client import Client
from ..locks.mutex import Mutex
from ..locks.rwlock import RWLock
from ..locks.semaphore import Semaphore
from ..logs import shorten
from ..options import MAX_SECONDS
from ..settings import Settings, client_for
from .conflict import Attempt, TaskLock, release
from .dedupe import EnqueueMarkers, as_delivered, enqueue_delay
from .options import (
    DECORATOR_NAMES,
    LockOptions,
    check_option_names,
    lock_name_for,
    option,
    options_of,
    with_lock_options,
)

logger = get_logger(__name__)

#: the names Celery itself may put on a task class (so that a near miss of ours is not mistaken for one)
CELERY_NAMES = set(dir(celery.Task)) | {"bind", "shared", "lazy", "base", "filter", "app", "run", "__wrapped__"}


@with_lock_options
class LimitedTask(celery.Task):
    __doc__ = (
        "A task of which at most ``limit`` runs (per key) happen at once, cluster-wide.\n\n"
        "    @app.task(base=LimitedTask, bind=True, limit=3, key=['tenant'], lock_ttl=60)\n"
        "    def render(self, tenant, document):\n"
        "        self.lock.token        # the fencing token of the slot this run holds\n\n"
        "Options (class attributes, or keyword arguments of ``@app.task``), from ``LockOptions``:\n\n"
        f"{LockOptions.documented()}\n"
    )

    #: marks the tasks of this package (a beat of an app that has them warns if it does not elect a leader)
    etcdlock_locked = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # @app.task(base=..., **options) makes the options class attributes of a new subclass: take the
        # decorators' names (lock=, mode=) here, where "lock" would otherwise replace the lock property
        super().__init_subclass__(**kwargs)
        where = f"task {cls.__dict__.get('name') or cls.__qualname__}"
        for given, attribute in DECORATOR_NAMES.items():
            if given in cls.__dict__ and not isinstance(cls.__dict__[given], property):
                if attribute in cls.__dict__:
                    raise TypeError(f"{where}: give {given}= or {attribute}=, not both")
                setattr(cls, attribute, option(cls, given))
                delattr(cls, given)
        check_option_names(list(cls.__dict__), CELERY_NAMES, where)

    @classmethod
    def on_bound(cls, app: celery.Celery) -> None:
        super().on_bound(app)
        if "run" in cls.__dict__:  # a concrete task: check its options when it is registered
            options_of(cls)

    # -- the lock of the current run ------------------------------------------

    @property
    def lock(self) -> TaskLock | None:
        """The lock this task holds in the current thread's run (None outside a run)."""
        for task, held in reversed(_running.stack):
            if task is self:
                return held
        return None

    def lock_name_for(self, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None) -> str:
        """The name of the lock a run with these arguments takes."""
        return lock_name_for(self, tuple(args), dict(kwargs or {}))

    # -- running ----------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        options = options_of(type(self))
        name = self.lock_name_for(args, kwargs)
        settings = Settings.from_app(self.app)  # once per run
        client = task_client(self.app, settings)
        ttl = options.lock_ttl if options.lock_ttl is not None else settings.ttl
        request = self.request
        task_id: str | None = request.id
        hostname = request.hostname or socket.gethostname()
        data = {"task_id": task_id, "task": self.name, "hostname": hostname}
        lost = threading.Event()

        def on_lost(lock: Any) -> None:
            lost.set()
            logger.error(
                "task %s[%s] on %s lost its lock %s mid-run (%s); another run may start before this one ends",
                self.name,
                task_id,
                hostname,
                name,
                lock.lost_reason,
            )

        lock = _new_lock(options, client, name, ttl, on_lost, data)
        attempt = Attempt(
            self, options, lock, name, task_id, hostname, lambda: self._forget_marker(client, name, task_id)
        )
        try:
            acquired = options.policy(attempt)  # or it raised: TaskLocked, Retry, Ignore
        except BackendUnavailable as exc:
            raise settings.explain(exc) from exc.__cause__
        if not acquired:
            return None
        try:  # from the moment the lock is held: anything raised below (a soft time limit, too) releases it
            self._forget_marker(client, name, task_id)
            logger.debug("task %s[%s] on %s holds %s (token %s)", self.name, task_id, hostname, name, lock.token)
            _running.stack.append((self, lock))
            try:
                result = super().__call__(*args, **kwargs)
            finally:
                _running.stack.pop()
        finally:
            kept = lock.held and not lost.is_set()
            cause, reason = lock.lost_cause, lock.lost_reason
            release(lock, name, task_id, hostname)
        if not kept:
            raise LockLost(
                f"task {self.name}[{task_id}] on {hostname} lost its lock {shorten(name)} before it finished "
                f"({reason or 'not renewed in time'}); its exclusivity was not guaranteed for the whole run",
                name,
                cause,
            )
        return result

    def _forget_marker(self, client: Client, name: str, task_id: str | None) -> None:
        """The run holds its lock or gives up: its enqueue marker has done its job."""
        if options_of(type(self)).dedupe_enqueue and task_id:
            EnqueueMarkers(client).forget(name, task_id)

    # -- enqueueing ----------------------------------------------------------------

    def apply_async(self, args: Any = None, kwargs: Any = None, task_id: str | None = None, **options: Any) -> Any:
        lock_options = options_of(type(self))
        if not lock_options.dedupe_enqueue or self.app.conf.task_always_eager:
            return super().apply_async(args, kwargs, task_id=task_id, **options)
        # name the marker from the arguments as the worker will see them (a tuple arrives as a list in JSON)
        seen_args, seen_kwargs = as_delivered((args or (), kwargs or {}), options.get("serializer") or self.serializer)
        name = self.lock_name_for(tuple(seen_args), dict(seen_kwargs))
        settings = Settings.from_app(self.app)
        markers = EnqueueMarkers(task_client(self.app, settings))
        task_id = task_id or celery.uuid()
        # the marker outlives a countdown or ETA, up to the longest TTL etcd is given
        ttl = min(lock_options.dedupe_ttl + enqueue_delay(options, self.app.now), MAX_SECONDS)
        try:
            other = markers.claim(name, task_id, self.name, ttl=ttl)
        except BackendUnavailable as exc:
            raise settings.explain(exc) from exc.__cause__
        if other is not None:
            return self.AsyncResult(other)
        try:
            return super().apply_async(args, kwargs, task_id=task_id, **options)
        except BaseException:
            markers.forget(name, task_id)
            raise


class SingletonTask(LimitedTask):
    """A task of which one run (per key) happens at a time, cluster-wide: a ``LimitedTask`` of ``limit`` 1.

    Its ``on_conflict`` is ``"skip"`` by default: a run that finds the lock taken does not run.
    """

    on_conflict = "skip"


class RWLockTask(LimitedTask):
    """A task that runs under the read or write side of a named read-write lock."""

    on_conflict = "wait"
    lock_mode = "write"


# -- the life cycle of a run's lock -------------------------------------------------------


def _new_lock(
    options: LockOptions, client: Client, name: str, ttl: float, on_lost: Callable[[Any], None], data: dict[str, Any]
) -> TaskLock:
    if options.lock_mode is None:
        if options.limit == 1:
            return Mutex(client, name, ttl=ttl, on_lost=on_lost, data=data)
        return Semaphore(client, name, limit=options.limit, ttl=ttl, on_lost=on_lost, data=data)
    side = RWLock(client, name, ttl=ttl)
    if options.lock_mode == "read":
        return side.read(on_lost=on_lost, data=data)
    return side.write(on_lost=on_lost, data=data)


class _RunningLocks(threading.local):
    """The locks held by the task runs of this thread (a stack: tasks may call tasks)."""

    def __init__(self) -> None:
        self.stack: list[tuple[LimitedTask, TaskLock]] = []


_running = _RunningLocks()
#: the clients the task runs of this process used (a pool process closes them when it exits: tasks/worker.py)
used_clients: weakref.WeakSet[Client] = weakref.WeakSet()


def task_client(app: celery.Celery, settings: Settings | None = None) -> Client:
    client = client_for(app, settings)
    used_clients.add(client)
    return client
