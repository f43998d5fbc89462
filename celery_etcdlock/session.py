"""Sessions: what keeps a process's queue entries alive, and says when they are not.

As in etcd's ``concurrency`` package, a process has one session per client
and TTL, and one background thread (the renewer) renews every session of
the process, whatever the number of locks held or waited for. In v3 a
session is one lease, kept alive every ttl/3; in v2 it is the group of keys
that each renewal round refreshes (``refresh=true``, which wakes no watcher).

The session keeps a local deadline: the *send* time (monotonic clock) of the
last renewal that succeeded, plus the TTL, minus a safety margin. The server
cannot expire the entries before that moment, so a holder that checks the
deadline steps down before anyone else can step in. When the deadline
passes, or a renewal finds an entry gone, every claim concerned is marked
lost at once and its ``on_lost`` callback runs (on the renewer thread).

    session = client.session(ttl=10)
    claim, snapshot = session.join("locks/x", {"mode": "write"}, on_lost=print)
    claim.alive        # False once lost, or in a forked child
    session.leave(claim)

Sessions do not survive ``fork()``: the child starts with none and builds
its own on first use (see ``Client``).
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from celery.utils.log import get_logger

from . import retry
from .backends.base import Backend, Entry, Lease, LeaseExpired, Snapshot, server_ttl
from .errors import BackendError

logger = get_logger(__name__)


def check_ttl(value: object, name: str = "ttl") -> float:
    """A TTL is a positive, finite number of seconds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, not {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")
    return float(value)


TIDY_DELAY = 5.0  # seconds a released queue stays unused before its (v2) directory is removed


def safety_margin(ttl: float) -> float:
    """How long before the server could expire an entry its holder gives up on it.

    Covers clock-rate differences and the time a renewal takes to be applied.
    """
    return min(max(0.1, 0.05 * ttl), ttl / 4)


class Claim:
    """One entry this process created and keeps alive until it leaves."""

    def __init__(self, session: Session, queue: str, entry: Entry, on_lost: Callable[[str], None] | None) -> None:
        self.session = session
        self.queue = queue
        self.entry = entry
        self.on_lost = on_lost
        self.pid = os.getpid()
        self.lost_reason: str | None = None
        self.lost = threading.Event()

    @property
    def alive(self) -> bool:
        return not self.lost.is_set() and self.pid == os.getpid() and time.monotonic() < self.session.deadline

    def __repr__(self) -> str:
        return f"<Claim {self.entry.key} token={self.entry.token} alive={self.alive}>"


class Session:
    """The entries one process holds or queues with one TTL, on one client."""

    def __init__(self, backend: Backend, ttl: float, retry_max_delay: float) -> None:
        self.backend = backend
        self.ttl = ttl
        self.server_ttl = server_ttl(ttl)  # what etcd is asked for: the clock below runs on it
        self.margin = safety_margin(self.server_ttl)
        self.retry_max_delay = retry_max_delay
        self._mutex = threading.Lock()
        self._lease: Lease | None = None
        self._claims: dict[str, Claim] = {}
        self.deadline = 0.0  # monotonic; entries cannot expire on the server before it
        self.next_renewal = float("inf")
        self._tidy: dict[str, float] = {}  # queue -> when to remove its container if still unused

    @property
    def next_due(self) -> float:
        """When the renewer should next call ``renew()``."""
        return min(self.next_renewal, min(self._tidy.values(), default=float("inf")))

    # -- used by the primitives ---------------------------------------------

    def join(
        self, queue: str, value: dict[str, Any], on_lost: Callable[[str], None] | None = None
    ) -> tuple[Claim, Snapshot]:
        """Create a new entry in ``queue``, kept alive until ``leave``; and the queue as it then was."""
        for _attempt in range(3):
            lease = self._current_lease()
            sent = time.monotonic()
            try:
                entry, snapshot = self.backend.join_queue(queue, value, lease)
            except LeaseExpired:
                with self._mutex:
                    lost = self._expire("its lease expired on the server") if self._lease is lease else []
                _notify(lost)
                continue
            with self._mutex:
                self._tidy.pop(queue, None)
                if self.backend.creating_renews and not self._claims:
                    self._restart_clock(sent)
                claim = Claim(self, queue, entry, on_lost)
                self._claims[entry.key] = claim
                # an idle session was not being renewed: resume ttl/3 after the last renewal
                self.next_renewal = min(self.next_renewal, self.deadline + self.margin - self.server_ttl * 2 / 3)
            _renewer().schedule(self)
            return claim, snapshot
        raise BackendError(f"could not create an entry in {queue}: its lease kept expiring")

    def leave(self, claim: Claim) -> bool:
        """Stop renewing ``claim`` and delete its entry (guarded). False if it was already gone."""
        with self._mutex:
            self._claims.pop(claim.entry.key, None)
        if claim.pid != os.getpid():
            return False  # a parent's entry, inherited through fork: not ours to delete
        try:
            return self.backend.delete_entry(claim.entry)
        except BackendError as exc:
            logger.warning("could not delete %s (%s); it expires within %ss", claim.entry.key, exc, self.ttl)
            return False
        finally:
            # v2 queues are directories, which outlive their last entry: remove one that stays unused
            with self._mutex:
                self._tidy[claim.queue] = time.monotonic() + TIDY_DELAY
            _renewer().schedule(self)

    # -- used by the renewer ------------------------------------------------

    def renew(self) -> None:
        self._tidy_queues()
        with self._mutex:
            claims = list(self._claims.values())
            lease = self._lease
            if not claims or lease is None:
                self.next_renewal = float("inf")
                return
            if time.monotonic() < self.next_renewal:
                return  # woken to tidy only
            deadline = self.deadline
            expired = (
                self._expire(f"no renewal succeeded within its {self.ttl}s TTL")
                if time.monotonic() >= deadline
                else None
            )
        if expired is not None:
            _notify(expired)
            return
        sent = time.monotonic()
        try:
            gone = retry.run(
                retry.renewal_policy(deadline, f"renewal of {len(claims)} entries (lease {lease.id})"),
                lambda: self.backend.keep_alive(
                    lease,
                    [c.entry for c in claims],
                    timeout=max(0.05, min(deadline - time.monotonic(), self.server_ttl / 3)),
                ),
                self.backend.endpoints,
            )
        except BackendError as exc:
            lost = []
            with self._mutex:
                if time.monotonic() >= self.deadline:
                    lost = self._expire(f"renewal failed until its deadline: {exc}")
                else:
                    logger.warning("renewal of lease %s failed (%s); trying again", lease.id, exc)
                    self.next_renewal = time.monotonic() + min(0.5, self.server_ttl / 10)
            _notify(lost)
            return
        with self._mutex:
            if self._lease is not lease:
                return
            if lease.expired:
                lost = self._expire("its lease expired on the server")
            elif time.monotonic() >= deadline:
                # held already read False meanwhile: a late success must not bring the locks back
                lost = self._expire("its renewal came back after the deadline")
            else:
                self._restart_clock(sent)
                lost = [c for c in (self._claims.pop(key, None) for key in gone) if c is not None]
                self._lose(lost, "its key was deleted or expired")
        _notify(lost)

    def _tidy_queues(self) -> None:
        now = time.monotonic()
        with self._mutex:
            due = [queue for queue, when in self._tidy.items() if when <= now]
            for queue in due:
                del self._tidy[queue]
            unused = [queue for queue in due if not self._in_use(queue)]
        for queue in unused:
            self.backend.forget_queue(queue)

    def _in_use(self, queue: str) -> bool:
        return any(claim.queue == queue for claim in self._claims.values())

    def mark_lost(self, claim: Claim, reason: str) -> None:
        """Stop renewing ``claim`` and mark it lost now (its key was seen deleted)."""
        with self._mutex:
            self._claims.pop(claim.entry.key, None)
            lost = self._lose([claim], reason)
        _notify(lost)

    def drop_all(self) -> None:
        """Forget every claim without marking it lost (after fork: they are the parent's)."""
        self._mutex = threading.Lock()  # another thread may have held it at the fork
        with self._mutex:
            self._claims.clear()
            self._tidy.clear()
            self._lease = None
            self.next_renewal = float("inf")

    def close(self) -> None:
        with self._mutex:
            lease = self._lease
            lost = self._expire("its session was closed")
        _notify(lost)
        if lease is not None:
            try:
                self.backend.revoke(lease)
            except BackendError as exc:
                logger.warning("could not revoke lease %s: %s", lease.id, exc)

    # -- internals (called with self._mutex held) -----------------------------

    def _current_lease(self) -> Lease:
        with self._mutex:
            if self._lease is not None and (
                self._claims or time.monotonic() < self.deadline or self.backend.creating_renews
            ):
                return self._lease
        sent = time.monotonic()
        lease = self.backend.grant(self.ttl)
        with self._mutex:
            if self._lease is None or not self._claims:
                self._lease = lease
                self._restart_clock(sent)
            return self._lease

    def _restart_clock(self, sent: float) -> None:
        self.deadline = sent + self.server_ttl - self.margin
        self.next_renewal = sent + self.server_ttl / 3

    def _expire(self, reason: str) -> list[Claim]:
        """Every claim is lost; the next join starts a new lease. Returns the claims to notify."""
        claims = list(self._claims.values())
        self._claims.clear()
        self._lease = None
        self.next_renewal = float("inf")
        return self._lose(claims, reason)

    @staticmethod
    def _lose(claims: list[Claim], reason: str) -> list[Claim]:
        newly_lost = [claim for claim in claims if not claim.lost.is_set()]
        for claim in newly_lost:
            claim.lost_reason = reason
            claim.lost.set()
        return newly_lost


def _notify(claims: list[Claim]) -> None:
    """Run the on_lost callbacks, outside every session lock (a callback may release its lock)."""
    for claim in claims:
        if claim.on_lost is not None:
            try:
                claim.on_lost(claim.lost_reason or "lost")
            except Exception:
                logger.exception("on_lost callback for %s raised", claim.entry.key)


class Renewer:
    """The one thread per process that renews every session when it is due."""

    def __init__(self) -> None:
        self._wakeup = threading.Condition()
        self._sessions: weakref.WeakSet[Session] = weakref.WeakSet()
        self._wake_at = float("inf")  # when the thread plans to wake next
        self._thread = threading.Thread(target=self._run, name="etcdlock-renewer", daemon=True)
        self._thread.start()

    def schedule(self, session: Session) -> None:
        """Make sure ``session`` is renewed when due; wakes the thread only if that is sooner than planned."""
        with self._wakeup:
            self._sessions.add(session)
            if session.next_due < self._wake_at:
                self._wake_at = session.next_due
                self._wakeup.notify()

    def _run(self) -> None:
        tiebreak = itertools.count()
        while True:
            with self._wakeup:
                due = sorted((s.next_due, next(tiebreak), s) for s in self._sessions)
                now = time.monotonic()
                if not due or due[0][0] > now:
                    self._wake_at = due[0][0] if due else float("inf")
                    self._wakeup.wait(timeout=None if self._wake_at == float("inf") else self._wake_at - now)
                    continue
                self._wake_at = now
            for when, _, session in due:
                if when > time.monotonic():
                    break
                try:
                    session.renew()
                except Exception:  # the renewer must never die: every lock depends on it
                    logger.exception("renewal of a session failed unexpectedly")
                    session.next_renewal = time.monotonic() + 0.5


_renewer_instance: Renewer | None = None
_renewer_lock = threading.Lock()


def _renewer() -> Renewer:
    global _renewer_instance
    with _renewer_lock:
        if _renewer_instance is None:
            _renewer_instance = Renewer()
        return _renewer_instance


def _forget_renewer_after_fork() -> None:
    global _renewer_instance, _renewer_lock
    _renewer_instance = None  # the thread did not survive the fork
    _renewer_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_renewer_after_fork)
