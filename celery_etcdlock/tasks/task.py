"""Singleton and read-write locked Celery tasks.

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

import random
import socket
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar, overload

import celery
from celery import shared_task
from celery.backends.base import DisabledBackend
from celery.exceptions import Ignore, Retry
from celery.result import AsyncResult
from celery.utils.log import get_logger

from .. import observe, signals
from ..errors import BackendUnavailable, EtcdLockError, LimitMismatch, LockLost, TaskLocked
from ..locks.client import Client
from ..locks.mutex import Mutex
from ..locks.queue import QueueState
from ..locks.rwlock import RWLock
from ..locks.semaphore import Semaphore
from ..locks.store import Fence
from ..logs import shorten
from ..options import MAX_SECONDS
from ..settings import Settings, client_for
from .dedupe import EnqueueMarkers, as_delivered, enqueue_delay
from .options import (
    DECORATOR_NAMES,
    LOCK_OPTIONS,
    KeySpec,
    NameFunction,
    check_class_options,
    check_key_names,
    check_option_names,
    check_options,
    lock_name_for,
    option,
)

logger = get_logger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

#: the message header of a rescheduled run: how often it was rescheduled, and since when (epoch seconds)
RESCHEDULED = "etcdlock_rescheduled"

#: the names Celery itself may put on a task class (so that a near miss of ours is not mistaken for one)
_CELERY_NAMES = set(dir(celery.Task)) | {"bind", "shared", "lazy", "base", "filter", "app", "run", "__wrapped__"}


class TaskLock(Fence, Protocol):
    """The lock of a run: a Mutex, or one side of an RWLock."""

    name: str
    ttl: float

    @property
    def held(self) -> bool: ...
    @property
    def token(self) -> int | None: ...
    @property
    def lost_cause(self) -> str | None: ...
    @property
    def lost_reason(self) -> str | None: ...
    @property
    def primitive(self) -> str: ...

    conflict: QueueState | None

    def acquire(
        self,
        blocking: bool = True,
        timeout: float | None = None,
        *,
        on_wait: Callable[[QueueState], None] | None = None,
    ) -> bool: ...
    def release(self) -> None: ...
    def holders(self) -> list[dict[str, Any]]: ...


class LimitedTask(celery.Task):
    """A task of which at most ``limit`` runs (per key) happen at once, cluster-wide.

    Options (class attributes, or keyword arguments of ``@app.task``):

    - ``limit``: how many runs at once (1: a singleton, under a ``Mutex``;
      more: under a ``Semaphore``).
    - ``key``: None (the limit holds for the whole task), a list of argument
      names, a format string over the arguments, or ``callable(args, kwargs) -> str``.
    - ``lock_ttl``: seconds a dead worker keeps its lock (default ``etcdlock_ttl``).
    - ``on_conflict``: ``"skip"``, ``"raise"``, ``"retry"``, ``"wait"`` or ``"reschedule"``.
    - ``lock_timeout``: how long ``"wait"`` waits (None: as long as it takes).
    - ``retry_countdown``: the countdown of ``"retry"``, in seconds.
    - ``reschedule_countdown`` / ``reschedule_max_countdown`` / ``reschedule_for``:
      ``"reschedule"`` sends the task again after ``reschedule_countdown`` seconds,
      doubling (with jitter) up to ``reschedule_max_countdown``, for at most
      ``reschedule_for`` seconds since the first attempt; it does not count
      towards ``max_retries``.
    - ``dedupe_enqueue`` / ``dedupe_ttl``: return the queued or running
      instance's AsyncResult instead of queueing another; the queued
      marker expires after ``dedupe_ttl`` seconds (plus any countdown/ETA)
      if its message is lost (singletons only).
    - ``hash_key``: put the SHA-256 of the key in the lock's name, not the argument values.
    - ``lock_name`` / ``lock_mode``: used by ``rwlock_task``: the lock's
      name (or format string, or callable), and ``"read"``/``"write"``.
    """

    #: marks the tasks of this package (a beat of an app that has them warns if it does not elect a leader)
    etcdlock_locked = True

    limit: int = 1
    key: KeySpec = None
    lock_ttl: float | None = None
    on_conflict: str = "wait"
    reschedule_countdown: float = 1.0
    reschedule_max_countdown: float = 60.0
    reschedule_for: float = 3600.0
    lock_timeout: float | None = None
    retry_countdown: float = 5.0
    dedupe_enqueue: bool = False
    dedupe_ttl: float = 3600.0
    lock_name: str | NameFunction | None = None
    lock_mode: str | None = None  # None: exclusive, named after the task and key
    hash_key: bool = False

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
        check_option_names(list(cls.__dict__), _CELERY_NAMES, where)

    @classmethod
    def on_bound(cls, app: celery.Celery) -> None:
        super().on_bound(app)
        if "run" in cls.__dict__:  # a concrete task: check its options when it is registered
            check_class_options(cls)

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
        check_class_options(type(self))
        name = self.lock_name_for(args, kwargs)
        settings = Settings.from_app(self.app)  # once per run
        client = task_client(self.app, settings)
        ttl = self.lock_ttl if self.lock_ttl is not None else settings.ttl
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

        lock = self._new_lock(client, name, ttl, on_lost, data)
        try:
            acquired = self._acquire(lock, client, name, task_id, hostname)
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
            _release(lock, name, task_id, hostname)
        if not kept:
            raise LockLost(
                f"task {self.name}[{task_id}] on {hostname} lost its lock {shorten(name)} before it finished "
                f"({reason or 'not renewed in time'}); its exclusivity was not guaranteed for the whole run",
                name,
                cause,
            )
        return result

    def _new_lock(
        self, client: Client, name: str, ttl: float, on_lost: Callable[[Any], None], data: dict[str, Any]
    ) -> TaskLock:
        if self.lock_mode is None:
            if self.limit == 1:
                return Mutex(client, name, ttl=ttl, on_lost=on_lost, data=data)
            return Semaphore(client, name, limit=self.limit, ttl=ttl, on_lost=on_lost, data=data)
        side = RWLock(client, name, ttl=ttl)
        if self.lock_mode == "read":
            return side.read(on_lost=on_lost, data=data)
        return side.write(on_lost=on_lost, data=data)

    def _acquire(self, lock: TaskLock, client: Client, name: str, task_id: str | None, hostname: str) -> bool:
        """Take the lock, or follow ``on_conflict``. False: skip this run.

        Every decision uses the queue as the acquire itself saw it (``lock.conflict``):
        a skip costs the one request that found the lock held, and the holder named in
        the log and in ``TaskLocked`` is the one that decided.
        """
        if self.on_conflict == "wait":
            return self._wait_for(lock, client, name, task_id)
        try:
            if lock.acquire(blocking=False):
                return True
        except LimitMismatch as exc:  # a deploy that changes the limit: the old one holds until its runs end
            logger.warning("task %s[%s]: %s; treating %s as taken", self.name, task_id, exc, name)
        holders = _holders_seen(lock)
        if task_id and any(h["data"].get("task_id") == task_id for h in holders):
            return self._acquire_after_own_attempt(lock, name, task_id, hostname)
        holder = _describe(holders)
        self._report_conflict(lock, name, task_id, holders)
        if self.on_conflict == "retry":
            logger.info(
                "task %s[%s] found %s held by %s; retrying in %ss",
                self.name,
                task_id,
                name,
                holder,
                self.retry_countdown,
            )
            try:
                raise self.retry(
                    countdown=self.retry_countdown,
                    exc=TaskLocked(f"{shorten(name)} is held by {holder}", lock_name=name, holder=_first(holders)),
                )
            except Retry:
                raise
            except BaseException:  # retries used up: this instance will not run, so it is not queued either
                self._forget_marker(client, name, task_id)
                raise
        if self.on_conflict == "reschedule":
            return self._reschedule(client, name, task_id, holders)
        self._forget_marker(client, name, task_id)
        if self.on_conflict == "raise":
            logger.info("task %s[%s] not run: %s is held by %s", self.name, task_id, name, holder)
            raise TaskLocked(
                f"task {self.name}[{task_id}] not run: {shorten(name)} is held by {holder}",
                lock_name=name,
                holder=_first(holders),
            )
        logger.info("task %s[%s] skipped: %s is held by %s", self.name, task_id, name, holder)
        signals.skipped(self, task_id, name, holders)
        return False

    def _report_conflict(self, lock: TaskLock, name: str, task_id: str | None, holders: list[dict[str, Any]]) -> None:
        if observe.listening():
            data = {"task": self.name, "task_id": task_id, "on_conflict": self.on_conflict}
            observe.report(
                observe.Event(
                    observe.TASK_CONFLICT, name=name, primitive=lock.primitive, data=data, holders=tuple(holders)
                )
            )

    def _wait_for(self, lock: TaskLock, client: Client, name: str, task_id: str | None) -> bool:
        """``on_conflict="wait"``: keep the place in the queue the acquire took, up to ``lock_timeout``."""
        own_attempt = False

        def waiting(state: QueueState) -> None:
            nonlocal own_attempt
            holders = state.described()
            own_attempt = bool(task_id) and any(h["data"].get("task_id") == task_id for h in holders)
            logger.info("task %s[%s] waits for %s, held by %s", self.name, task_id, name, _describe(holders))
            if not own_attempt:
                self._report_conflict(lock, name, task_id, holders)

        acquired = _acquire_despite_limit_changes(lock, self.lock_timeout, waiting)
        if own_attempt and task_id:
            return self._run_unless_a_duplicate(acquired, lock, name, task_id)
        if acquired:
            return True
        holders = _holders_seen(lock)
        self._forget_marker(client, name, task_id)
        raise TaskLocked(
            f"task {self.name}[{task_id}] gave up waiting for {shorten(name)} after {self.lock_timeout}s; "
            f"held by {_describe(holders)}",
            lock_name=name,
            holder=_first(holders),
        )

    def _reschedule(self, client: Client, name: str, task_id: str | None, holders: list[dict[str, Any]]) -> bool:
        """``on_conflict="reschedule"``: send this task again, later, without counting a retry.

        The message carries how often it was rescheduled and since when, so the
        countdown doubles (with jitter) and the task gives up after ``reschedule_for``.
        """
        request = self.request
        state = request.get(RESCHEDULED) or {}
        count = int(state.get("count", 0))
        since = float(state.get("since", time.time()))
        holder = _describe(holders)
        if time.time() - since >= self.reschedule_for:
            self._forget_marker(client, name, task_id)
            raise TaskLocked(
                f"task {self.name}[{task_id}] gave up after being rescheduled {count} times over "
                f"{self.reschedule_for:g}s: {shorten(name)} is held by {holder}",
                lock_name=name,
                holder=_first(holders),
            )
        ceiling = min(self.reschedule_max_countdown, self.reschedule_countdown * 2**count)
        countdown = ceiling / 2 + random.uniform(0, ceiling / 2)  # jitter: tasks rescheduled together part ways
        logger.info(
            "task %s[%s] found %s held by %s; rescheduled in %.1fs (%d times so far)",
            self.name,
            task_id,
            name,
            holder,
            countdown,
            count,
        )
        if request.called_directly or request.is_eager:
            raise TaskLocked(
                f"{shorten(name)} is held by {holder} (an eager run cannot be rescheduled)", lock_name=name
            )
        headers = {**(request.headers or {}), RESCHEDULED: {"count": count + 1, "since": since}}
        # as Task.retry sends it (same task id, options and route), but with the retry count unchanged
        again = self.signature_from_request(request, countdown=countdown, retries=request.retries, headers=headers)
        again.apply_async()
        raise Retry(exc=TaskLocked(f"{shorten(name)} is held by {holder}", lock_name=name), when=countdown, sig=again)

    def _acquire_after_own_attempt(self, lock: TaskLock, name: str, task_id: str, hostname: str) -> bool:
        # The holder is an earlier attempt of this very task id: a message
        # redelivered while it still runs (visibility timeout, acks_late), or
        # an attempt that died (its entry expires within the TTL). Waiting one
        # TTL tells the two apart; running now would run the task twice at once.
        logger.warning(
            "task %s[%s] on %s: %s is held by an earlier attempt of the same task id; waiting up to %ss",
            self.name,
            task_id,
            hostname,
            name,
            lock.ttl,
        )
        return self._run_unless_a_duplicate(lock.acquire(timeout=float(lock.ttl) + 1.0), lock, name, task_id)

    def _run_unless_a_duplicate(self, acquired: bool, lock: TaskLock, name: str, task_id: str) -> bool:
        """After waiting behind an earlier delivery of this very task id: run only if that one did not finish."""
        if acquired and not _finished(self, task_id):
            return True
        if acquired:
            _release(lock, name, task_id, self.request.hostname or socket.gethostname())
            logger.warning("task %s[%s]: duplicate delivery of a finished run; not run again", self.name, task_id)
        else:
            logger.warning(
                "task %s[%s]: duplicate delivery while the first delivery still runs and holds %s; not run",
                self.name,
                task_id,
                name,
            )
        raise Ignore()

    def _forget_marker(self, client: Client, name: str, task_id: str | None) -> None:
        """The run holds its lock or gives up: its enqueue marker has done its job."""
        if self.dedupe_enqueue and task_id:
            EnqueueMarkers(client).forget(name, task_id)

    # -- enqueueing ----------------------------------------------------------------

    def apply_async(self, args: Any = None, kwargs: Any = None, task_id: str | None = None, **options: Any) -> Any:
        if not self.dedupe_enqueue or self.app.conf.task_always_eager:
            return super().apply_async(args, kwargs, task_id=task_id, **options)
        check_class_options(type(self))
        # name the marker from the arguments as the worker will see them (a tuple arrives as a list in JSON)
        seen_args, seen_kwargs = as_delivered((args or (), kwargs or {}), options.get("serializer") or self.serializer)
        name = self.lock_name_for(tuple(seen_args), dict(seen_kwargs))
        settings = Settings.from_app(self.app)
        markers = EnqueueMarkers(task_client(self.app, settings))
        task_id = task_id or celery.uuid()
        # the marker outlives a countdown or ETA, up to the longest TTL etcd is given
        ttl = min(self.dedupe_ttl + enqueue_delay(options, self.app.now), MAX_SECONDS)
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


# -- decorators -------------------------------------------------------------------


@overload
def singleton_task(fun: F) -> Any: ...
@overload
def singleton_task(
    *,
    key: KeySpec = None,
    lock_ttl: float | None = None,
    on_conflict: str = "skip",
    lock_timeout: float | None = None,
    retry_countdown: float = 5.0,
    dedupe_enqueue: bool = False,
    dedupe_ttl: float = 3600.0,
    app: celery.Celery | None = None,
    base: type[celery.Task] | None = None,
    **options: Any,
) -> Callable[[F], Any]: ...
def singleton_task(fun: Callable[..., Any] | None = None, **options: Any) -> Any:
    """Register ``fun`` as a task of which one run (per key) happens at a time, cluster-wide.

    Accepts every option ``celery.shared_task`` accepts, ``app=`` to register
    on that app, and the lock options of :class:`SingletonTask`.
    """
    return _decorator(fun, SingletonTask, options, "singleton_task")


@overload
def limited_task(fun: F) -> Any: ...
@overload
def limited_task(
    *,
    limit: int,
    key: KeySpec = None,
    lock_ttl: float | None = None,
    on_conflict: str = "wait",
    lock_timeout: float | None = None,
    retry_countdown: float = 5.0,
    reschedule_countdown: float = 1.0,
    reschedule_max_countdown: float = 60.0,
    reschedule_for: float = 3600.0,
    hash_key: bool = False,
    app: celery.Celery | None = None,
    base: type[celery.Task] | None = None,
    **options: Any,
) -> Callable[[F], Any]: ...
def limited_task(fun: Callable[..., Any] | None = None, **options: Any) -> Any:
    """Register ``fun`` as a task of which at most ``limit`` runs (per key) happen at once, cluster-wide.

    Takes the options of ``singleton_task``; ``on_conflict`` is ``"wait"`` by default.
    """
    if fun is not None or "limit" not in options:
        raise TypeError("limited_task needs limit=: use @limited_task(limit=3, ...)")
    return _decorator(None, LimitedTask, options, "limited_task")


@overload
def rwlock_task(fun: F) -> Any: ...
@overload
def rwlock_task(
    *,
    lock: str | NameFunction,
    mode: str,
    lock_ttl: float | None = None,
    on_conflict: str = "wait",
    lock_timeout: float | None = None,
    retry_countdown: float = 5.0,
    app: celery.Celery | None = None,
    base: type[celery.Task] | None = None,
    **options: Any,
) -> Callable[[F], Any]: ...
def rwlock_task(fun: Callable[..., Any] | None = None, **options: Any) -> Any:
    """Register ``fun`` as a task that runs under the ``mode`` side of the read-write lock ``lock``.

    ``lock`` is a name, a format string over the arguments, or a callable
    ``(args, kwargs) -> str``; ``mode`` is ``"read"`` (many at once) or
    ``"write"`` (alone).
    """
    if fun is not None:
        raise TypeError("rwlock_task needs lock= and mode=: use @rwlock_task(lock=..., mode=...)")
    for required in ("lock", "mode"):
        if required not in options:
            raise TypeError(f"rwlock_task() missing the {required}= argument")
    if "dedupe_enqueue" in options:
        raise TypeError("rwlock_task does not take dedupe_enqueue (readers with one lock are not duplicates)")
    options["lock_name"] = options.pop("lock")
    options["lock_mode"] = options.pop("mode")
    return _decorator(None, RWLockTask, options, "rwlock_task")


def _decorator(
    fun: Callable[..., Any] | None, default_base: type[LimitedTask], options: dict[str, Any], what: str
) -> Any:
    app = options.pop("app", None)
    base = options.pop("base", None) or default_base
    if not isinstance(base, type) or not issubclass(base, celery.Task):
        raise TypeError(f"{what}(base=...) must be a celery Task subclass, not {base!r}")
    if not issubclass(base, LimitedTask):
        # keep the user's base behaviour and add the lock around it
        base = type(f"{default_base.__name__}{base.__name__}", (default_base, base), {})
    check_option_names(list(options), _CELERY_NAMES, what)
    lock_options = {k: options[k] for k in LOCK_OPTIONS if k in options}
    check_options(lock_options, what)

    def register(function: Callable[..., Any]) -> Any:
        if not callable(function):
            raise TypeError(f"{what} decorates a function, not {function!r}")
        check_key_names(function, bool(options.get("bind")), lock_options.get("key"), what)
        if app is not None:
            return app.task(base=base, **options)(function)
        return shared_task(base=base, **options)(function)

    return register(fun) if fun is not None else register


# -- the life cycle of a run's lock -------------------------------------------------------


class _RunningLocks(threading.local):
    """The locks held by the task runs of this thread (a stack: tasks may call tasks)."""

    def __init__(self) -> None:
        self.stack: list[tuple[LimitedTask, TaskLock]] = []


_running = _RunningLocks()
used_clients: weakref.WeakSet[Client] = weakref.WeakSet()


def task_client(app: celery.Celery, settings: Settings | None = None) -> Client:
    client = client_for(app, settings)
    used_clients.add(client)
    return client


def _release(lock: TaskLock, name: str, task_id: str | None, hostname: str) -> None:
    try:
        lock.release()
    except EtcdLockError as exc:
        logger.warning(
            "task %s on %s could not release %s (%s); it expires within %ss", task_id, hostname, name, exc, lock.ttl
        )
    else:
        logger.debug("task %s on %s released %s", task_id, hostname, name)


def _acquire_despite_limit_changes(
    lock: TaskLock, timeout: float | None, on_wait: Callable[[QueueState], None]
) -> bool:
    """A waiting acquire that outlasts a deploy changing a semaphore's limit: while participants with the
    old limit remain, the new ones are refused; retry once a TTL until they are gone, or the timeout."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            return lock.acquire(timeout=remaining, on_wait=on_wait)
        except LimitMismatch as exc:
            if remaining == 0:
                return False
            logger.warning("%s; trying again in %ss", exc, lock.ttl)
            time.sleep(min(lock.ttl, remaining if remaining is not None else lock.ttl))


def _holders_seen(lock: TaskLock) -> list[dict[str, Any]]:
    """The holders as the lock's last acquire saw them when it could not take it."""
    return lock.conflict.described() if lock.conflict is not None else []


def _first(holders: list[dict[str, Any]]) -> dict[str, Any] | None:
    return holders[0] if holders else None


def _describe(holders: list[dict[str, Any]]) -> str:
    if not holders:
        return "another holder (gone by now)"
    described = []
    for h in holders:
        data = h.get("data") or {}
        if data.get("task_id"):
            described.append(f"task {data.get('task')}[{data['task_id']}] on {data.get('hostname')}")
        else:
            described.append(str(h.get("holder")))
    return ", ".join(described)


def _finished(task: LimitedTask, task_id: str, patience: float = 2.0) -> bool:
    """Whether the result backend has (or within ``patience`` seconds gets) a final state for ``task_id``.

    A run releases its lock just before its worker stores the result, so a
    duplicate that acquired right after it gives the result a moment to land.
    False when unknown: no result backend, results ignored, or the backend down.
    """
    if task.ignore_result or isinstance(task.backend, DisabledBackend):
        return False
    result = AsyncResult(task_id, app=task.app, backend=task.backend)
    deadline = time.monotonic() + patience
    try:
        while not result.ready():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
    except Exception:  # the backend is down: assume not finished
        return False
    return True
