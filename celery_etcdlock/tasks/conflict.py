"""What a run does when its lock is taken: ``on_conflict`` as small policies, chosen once from a table.

    policy = POLICIES[options.on_conflict]    # "skip", "raise", "retry", "wait" or "reschedule"
    if not policy(attempt):                   # True: the lock is ours, run; False: skip this run
        return None                           # or it raised: TaskLocked, celery's Retry, or Ignore

A policy is a callable over an ``Attempt`` (the task, its lock, the lock's
name, the holders), in tenacity's style. ``wait`` queues for the lock up to
``lock_timeout``; the others try once without waiting (``at_once``) and, if
the lock is taken, decide: ``skip`` returns False, ``refuse`` raises
``TaskLocked``, ``retry`` is Celery's retry, ``reschedule`` sends the task again
later without counting a retry. A run that will not run raises one
``TaskLocked``, built by ``Attempt.locked``.

Every decision uses the queue as the acquire itself saw it (``lock.conflict``):
a skip costs the one request that found the lock held, and the holder named
in the log and in ``TaskLocked`` is the one that decided.

A holder that is an earlier delivery of this very task id is no conflict but
a duplicate: a message redelivered while the first delivery still runs
(visibility timeout, acks_late), or an attempt that died (its entry expires
within the TTL). Every policy waits one TTL to tell the two apart, and runs
only if the first delivery did not finish.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from celery.backends.base import DisabledBackend
from celery.exceptions import Ignore, Retry
from celery.result import AsyncResult
from celery.utils.log import get_logger

from .. import observe, signals
from ..errors import EtcdLockError, LimitMismatch, TaskLocked
from ..locks.queue import Holder, QueueState
from ..locks.store import Fence
from ..logs import shorten

logger = get_logger(__name__)

#: the message header of a rescheduled run: how often it was rescheduled, and since when (epoch seconds)
RESCHEDULED = "etcdlock_rescheduled"


class TaskLock(Fence, Protocol):
    """The lock of a run: a Mutex, a Semaphore, or one side of an RWLock."""

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
    def kind(self) -> str: ...

    conflict: QueueState | None

    def acquire(
        self,
        blocking: bool = True,
        timeout: float | None = None,
        *,
        on_wait: Callable[[QueueState], None] | None = None,
    ) -> bool: ...
    def release(self) -> None: ...
    def holders(self) -> list[Holder]: ...


class ConflictOptions(Protocol):
    """The lock options a policy reads (``LockOptions`` has them all)."""

    @property
    def on_conflict(self) -> str: ...
    @property
    def lock_timeout(self) -> float | None: ...
    @property
    def retry_countdown(self) -> float: ...
    @property
    def reschedule_countdown(self) -> float: ...
    @property
    def reschedule_max_countdown(self) -> float: ...
    @property
    def reschedule_for(self) -> float: ...


@dataclass
class Attempt:
    """One run's attempt at its lock: what a conflict policy decides over."""

    task: Any  # the LimitedTask that runs (celery.Task is untyped)
    options: ConflictOptions
    lock: TaskLock
    name: str
    task_id: str | None
    hostname: str
    forget_marker: Callable[[], None]  # the run will not happen: its enqueue marker must not keep others out

    @property
    def where(self) -> str:
        return f"task {self.task.name}[{self.task_id}]"

    @property
    def shown(self) -> str:
        """The lock's name in an error message: bounded, since a key may carry a huge argument."""
        return shorten(self.name)

    def holders(self) -> list[Holder]:
        """The holders as the lock's last acquire saw them when it could not take it."""
        return self.lock.conflict.described() if self.lock.conflict is not None else []

    def is_own(self, holders: list[Holder]) -> bool:
        """Whether an earlier delivery of this very task id is among ``holders``."""
        return bool(self.task_id) and any(h["data"].get("task_id") == self.task_id for h in holders)

    def locked(self, message: str, holders: list[Holder]) -> TaskLocked:
        """The one ``TaskLocked`` of a run that will not run, naming the holder that decided it."""
        return TaskLocked(message, lock_name=self.name, holder=holders[0] if holders else None)

    def report(self, holders: list[Holder]) -> None:
        if observe.listening():
            data = {"task": self.task.name, "task_id": self.task_id, "on_conflict": self.options.on_conflict}
            observe.report(
                observe.Event(
                    observe.TASK_CONFLICT, name=self.name, lock_kind=self.lock.kind, data=data,
                    holders=tuple(holders),
                )
            )  # fmt: skip

    def release(self) -> None:
        """Give the lock back; a failure is logged (the entry expires within the TTL), never raised."""
        release(self.lock, self.name, self.task_id, self.hostname)


Policy = Callable[[Attempt], bool]
Decision = Callable[[Attempt, list[Holder]], bool]  # after a try that found the lock taken by ``holders``


# -- waiting ------------------------------------------------------------------------------------------


def wait(attempt: Attempt) -> bool:
    """``"wait"``: keep the place in the queue the acquire took, up to ``lock_timeout``."""
    own_attempt = False

    def waiting(state: QueueState) -> None:
        nonlocal own_attempt
        holders = state.described()
        own_attempt = attempt.is_own(holders)
        logger.info("%s waits for %s, held by %s", attempt.where, attempt.name, describe(holders))
        if not own_attempt:
            attempt.report(holders)

    acquired = _acquire_despite_limit_changes(attempt.lock, attempt.options.lock_timeout, waiting)
    if own_attempt:
        return _run_unless_a_duplicate(attempt, acquired)
    if acquired:
        return True
    holders = attempt.holders()
    attempt.forget_marker()
    raise attempt.locked(
        f"{attempt.where} gave up waiting for {attempt.shown} after {attempt.options.lock_timeout}s; "
        f"held by {describe(holders)}",
        holders,
    )


# -- trying once, then deciding -----------------------------------------------------------------------


def at_once(decide: Decision) -> Policy:
    """A policy that tries the lock without waiting and, if it is taken, lets ``decide`` say what the run does."""

    def policy(attempt: Attempt) -> bool:
        try:
            if attempt.lock.acquire(blocking=False):
                return True
        except LimitMismatch as exc:  # a deploy that changes the limit: the old one holds until its runs end
            logger.warning("%s: %s; treating %s as taken", attempt.where, exc, attempt.name)
        holders = attempt.holders()
        if attempt.is_own(holders):
            return _wait_out_own_attempt(attempt)
        attempt.report(holders)
        return decide(attempt, holders)

    policy.__name__ = policy.__qualname__ = f"at_once({decide.__name__})"
    return policy


def skip(attempt: Attempt, holders: list[Holder]) -> bool:
    """``"skip"``: do not run, say so (log, ``task_skipped`` signal, ``task-skipped`` event)."""
    attempt.forget_marker()
    logger.info("%s skipped: %s is held by %s", attempt.where, attempt.name, describe(holders))
    signals.skipped(attempt.task, attempt.task_id, attempt.name, holders)
    return False


def refuse(attempt: Attempt, holders: list[Holder]) -> bool:
    """``"raise"``: do not run; the run fails with ``TaskLocked``."""
    attempt.forget_marker()
    logger.info("%s not run: %s is held by %s", attempt.where, attempt.name, describe(holders))
    raise attempt.locked(f"{attempt.where} not run: {attempt.shown} is held by {describe(holders)}", holders)


def retry(attempt: Attempt, holders: list[Holder]) -> bool:
    """``"retry"``: Celery's retry after ``retry_countdown`` (it counts towards ``max_retries``)."""
    countdown = attempt.options.retry_countdown
    logger.info("%s found %s held by %s; retrying in %ss", attempt.where, attempt.name, describe(holders), countdown)
    try:
        raise attempt.task.retry(countdown=countdown, exc=attempt.locked(_held_by(attempt, holders), holders))
    except Retry:
        raise
    except BaseException:  # retries used up: this instance will not run, so it is not queued either
        attempt.forget_marker()
        raise


def reschedule(attempt: Attempt, holders: list[Holder]) -> bool:
    """``"reschedule"``: send this task again, later, without counting a retry.

    The message carries how often it was rescheduled and since when, so the
    countdown doubles (with jitter) and the task gives up after ``reschedule_for``.
    """
    task, options = attempt.task, attempt.options
    request = task.request
    state = request.get(RESCHEDULED) or {}
    count = int(state.get("count", 0))
    since = float(state.get("since", time.time()))
    if time.time() - since >= options.reschedule_for:
        attempt.forget_marker()
        raise attempt.locked(
            f"{attempt.where} gave up after being rescheduled {count} times over {options.reschedule_for:g}s: "
            f"{attempt.shown} is held by {describe(holders)}",
            holders,
        )
    ceiling = min(options.reschedule_max_countdown, options.reschedule_countdown * 2**count)
    countdown = ceiling / 2 + random.uniform(0, ceiling / 2)  # jitter: tasks rescheduled together part ways
    logger.info(
        "%s found %s held by %s; rescheduled in %.1fs (%d times so far)",
        attempt.where,
        attempt.name,
        describe(holders),
        countdown,
        count,
    )
    if request.called_directly or request.is_eager:
        raise attempt.locked(f"{_held_by(attempt, holders)} (an eager run cannot be rescheduled)", holders)
    headers = {**(request.headers or {}), RESCHEDULED: {"count": count + 1, "since": since}}
    # as Task.retry sends it (same task id, options and route), but with the retry count unchanged
    again = task.signature_from_request(request, countdown=countdown, retries=request.retries, headers=headers)
    again.apply_async()
    raise Retry(exc=attempt.locked(_held_by(attempt, holders), holders), when=countdown, sig=again)


#: ``on_conflict`` -> its policy: the one list of the values ``on_conflict`` may take
POLICIES: dict[str, Policy] = {
    "skip": at_once(skip),
    "raise": at_once(refuse),
    "retry": at_once(retry),
    "wait": wait,
    "reschedule": at_once(reschedule),
}


def _held_by(attempt: Attempt, holders: list[Holder]) -> str:
    return f"{attempt.shown} is held by {describe(holders)}"


# -- an earlier delivery of the same task id ------------------------------------------------------------


def _wait_out_own_attempt(attempt: Attempt) -> bool:
    # Waiting one TTL tells a redelivery (the first one still runs) from a dead attempt (its entry
    # expires); running now would run the task twice at once.
    logger.warning(
        "task %s[%s] on %s: %s is held by an earlier attempt of the same task id; waiting up to %ss",
        attempt.task.name,
        attempt.task_id,
        attempt.hostname,
        attempt.name,
        attempt.lock.ttl,
    )
    return _run_unless_a_duplicate(attempt, attempt.lock.acquire(timeout=float(attempt.lock.ttl) + 1.0))


def _run_unless_a_duplicate(attempt: Attempt, acquired: bool) -> bool:
    """After waiting behind an earlier delivery of this very task id: run only if that one did not finish."""
    if acquired and attempt.task_id and not _finished(attempt.task, attempt.task_id):
        return True
    if acquired:
        attempt.release()
        logger.warning("%s: duplicate delivery of a finished run; not run again", attempt.where)
    else:
        logger.warning(
            "%s: duplicate delivery while the first delivery still runs and holds %s; not run",
            attempt.where,
            attempt.name,
        )
    raise Ignore()


def _finished(task: Any, task_id: str, patience: float = 2.0) -> bool:
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
            time.sleep(0.05)  # the result backend has no way to wait for a result here
    except Exception:  # the backend is down: assume not finished
        return False
    return True


# -- helpers of the run --------------------------------------------------------------------------------


def release(lock: TaskLock, name: str, task_id: str | None, hostname: str) -> None:
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


def describe(holders: list[Holder]) -> str:
    """The holders in a log line: a task's name, id and worker, else the holder's ``host:pid``."""
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
