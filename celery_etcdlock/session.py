"""Sessions: what keeps a process's queue entries alive, and says when they are not.

As in etcd's ``concurrency`` package, a process has one session per client
and TTL, and each session one background thread (its renewer) that renews
every entry of the session, whatever the number of locks held or waited
for; so a slow etcd behind one session never delays another's renewals. In
v3 the entries of a session ride on one shared lease, kept alive every
ttl/3; in v2 each entry is a key with a TTL of its own, refreshed every
ttl/3 (``refresh=true``, which wakes no watcher). The renewer ends when the
session has nothing left to keep alive, and the next join starts it again.

Each lease keeps a local deadline: the *send* time (monotonic clock) of the
last renewal that succeeded, plus the TTL etcd was given, minus a safety
margin. The server cannot expire the lease's entries before that moment, so
a holder that checks the deadline steps down before anyone else can step
in. When the deadline passes, or a renewal finds an entry gone, every claim
concerned is marked lost at once and its ``on_lost`` callback runs on the
renewer thread, outside every lock (also for a loss another thread saw). A
claim knows its own lease, so a claim is never judged by a clock that does
not renew it.

    session = client.session(ttl=10)
    claim, snapshot = session.join("locks/x", {"mode": "write"}, on_lost=lambda claim, why: print(why))
    claim.alive        # False once lost, or in a forked child
    session.leave(claim)

Sessions do not survive ``fork()``: the child starts with none and builds
its own on first use (see ``Client``).
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
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

    def __init__(
        self, tenancy: Tenancy, queue: str, entry: Entry, on_lost: Callable[[Claim, str], None] | None
    ) -> None:
        self.tenancy = tenancy
        self.queue = queue
        self.entry = entry
        self.on_lost = on_lost
        self.pid = os.getpid()
        self.lost_reason: str | None = None
        self.lost = threading.Event()

    @property
    def alive(self) -> bool:
        return (
            not self.lost.is_set()
            and self.pid == os.getpid()
            and not self.tenancy.lease.expired
            and time.monotonic() < self.tenancy.deadline
        )

    def __repr__(self) -> str:
        return f"<Claim {self.entry.key} token={self.entry.token} alive={self.alive}>"


class Tenancy:
    """A lease, the claims riding on it, and its clock (guarded by the session's mutex)."""

    def __init__(self, lease: Lease) -> None:
        self.lease = lease
        self.claims: dict[str, Claim] = {}
        self.deadline = 0.0  # monotonic: the server cannot expire the lease's entries before it
        self.next_renewal = float("inf")
        self.strays: dict[str, int] = {}  # keys on the lease that no claim owns -> renewals that saw them
        self.joining = 0  # joins in flight: their keys may be on the lease before their claims exist
        self.dropped = False  # expired or idle: no claim may join it any more

    def restart_clock(self, sent: float, server_ttl: int, margin: float) -> None:
        self.deadline = sent + server_ttl - margin
        self.next_renewal = sent + server_ttl / 3


class Session:
    """The entries one process holds or queues with one TTL, on one client."""

    def __init__(self, backend: Backend, ttl: float, retry_max_delay: float) -> None:
        self.backend = backend
        self.ttl = ttl
        self.server_ttl = server_ttl(ttl)  # what etcd is asked for: the clocks run on it
        self.margin = safety_margin(self.server_ttl)
        self.retry_max_delay = retry_max_delay
        self._mutex = threading.Lock()  # guards the tenancies, their claims and clocks, and _tidy
        self._granting = threading.Lock()  # one grant at a time: concurrent joins share one lease
        self._tenancies: list[Tenancy] = []
        self._shared: Tenancy | None = None  # the lease new entries go on (v3)
        self._tidy: dict[str, float] = {}  # queue -> when to remove its container if still unused
        self._not_before = 0.0  # set by the renewer after an unexpected failure, to pace retries
        self._unnotified: list[Claim] = []  # lost by another thread: the renewer runs their on_lost
        self._closed = False
        self._wakeup = threading.Condition()  # guards the renewer thread and _wake_at; taken before _mutex
        self._renewer: threading.Thread | None = None
        self._wake_at = float("inf")  # when the renewer plans to wake next

    @property
    def next_due(self) -> float:
        """When the renewer should next call ``renew()``: a renewal, an expiry or a tidy-up (inf: never)."""
        with self._mutex:
            busy = [t for t in self._tenancies if t.claims]
            times = [min(t.next_renewal, t.deadline) for t in busy] + list(self._tidy.values())
            if not busy and self._tenancies:
                times.append(min(t.deadline for t in self._tenancies))  # to drop idle leases
            if self._unnotified:
                times.append(0.0)
        return max(min(times, default=float("inf")), self._not_before)

    # -- used by the primitives ---------------------------------------------

    def join(
        self, queue: str, value: dict[str, Any], on_lost: Callable[[Claim, str], None] | None = None
    ) -> tuple[Claim, Snapshot]:
        """Create a new entry in ``queue``, kept alive until ``leave``; and the queue as it then was."""
        for _attempt in range(3):
            tenancy = self._tenancy_for_new_entry()
            sent = time.monotonic()
            try:
                entry, snapshot = self.backend.join_queue(queue, value, tenancy.lease)
            except LeaseExpired:
                with self._mutex:
                    tenancy.joining -= 1
                    self._unnotified += self._expire(tenancy, "its lease expired on the server")
                self._schedule()
                continue
            except BaseException:
                with self._mutex:
                    tenancy.joining -= 1  # its key, if created, is a stray now: a renewal deletes it
                raise
            with self._mutex:
                tenancy.joining -= 1
                if tenancy.dropped or tenancy.lease.expired:
                    stale = True  # the lease was revoked or expired while the join was in flight
                else:
                    stale = False
                    self._tidy.pop(queue, None)
                    if self.backend.creating_renews:  # v2: the entry's own TTL starts now
                        tenancy.restart_clock(sent, self.server_ttl, self.margin)
                        self._tenancies.append(tenancy)
                    claim = Claim(tenancy, queue, entry, on_lost)
                    tenancy.claims[entry.key] = claim
            if stale:
                with contextlib.suppress(BackendError):
                    self.backend.delete_entry(entry)
                continue
            try:
                self._schedule()
            except BaseException:  # no renewer (say, no thread could start): the entry must not stay
                with self._mutex:
                    self._forget(claim)
                with contextlib.suppress(BackendError):
                    self.backend.delete_entry(entry)
                raise
            return claim, snapshot
        raise BackendError(f"could not create an entry in {queue}: its lease kept expiring")

    def leave(self, claim: Claim) -> bool:
        """Stop renewing ``claim`` and delete its entry (guarded). False if it was already gone."""
        with self._mutex:
            self._forget(claim)
        if claim.pid != os.getpid():
            return False  # a parent's entry, inherited through fork: not ours to delete
        try:
            return self.backend.delete_entry(claim.entry)
        except BackendError as exc:
            # v2: nobody refreshes it any more; v3: it rides on a live lease, so a renewal deletes it as a stray
            logger.warning("could not delete %s (%s); it goes within %ss", claim.entry.key, exc, self.ttl)
            return False
        finally:
            # v2 queues are directories, which outlive their last entry: remove one that stays unused
            with self._mutex:
                tidy = self.backend.leaves_empty_queues and not self._closed
                if tidy:
                    self._tidy[claim.queue] = time.monotonic() + TIDY_DELAY
            if tidy:
                self._schedule()

    def mark_lost(self, claim: Claim, reason: str) -> None:
        """Stop renewing ``claim`` and mark it lost now (its key was seen deleted)."""
        with self._mutex:
            self._forget(claim)
            self._unnotified += _lose([claim], reason)
        self._schedule()

    # -- used by the renewer ------------------------------------------------

    def renew(self) -> None:
        """Renew every lease that is due, expire every lease past its deadline, then tidy."""
        now = time.monotonic()
        with self._mutex:
            lost, self._unnotified = self._unnotified, []
            for tenancy in list(self._tenancies):
                if not tenancy.claims:
                    if tenancy is not self._shared or now >= tenancy.deadline:
                        self._drop(tenancy)  # idle: its keys are gone; an idle shared lease just lapses
                elif now >= tenancy.deadline:
                    lost += self._expire(tenancy, f"no renewal succeeded within its {self.server_ttl}s TTL")
            due = [t for t in self._tenancies if t.claims and t.next_renewal <= now]
        _notify(lost)
        for tenancy in due:
            self._renew(tenancy)
        self._tidy_queues()  # last: housekeeping must never delay a renewal

    def _renew(self, tenancy: Tenancy) -> None:
        with self._mutex:
            claims = list(tenancy.claims.values())
            deadline = tenancy.deadline
        # one renewal period at most: a failing lease comes back soon, after the session's other leases
        stop_at = min(deadline, time.monotonic() + self.server_ttl / 3)
        lease = tenancy.lease
        sent = time.monotonic()
        try:
            gone = retry.run(
                retry.renewal_policy(stop_at, f"renewal of {len(claims)} entries (lease {lease.id})"),
                lambda: self.backend.keep_alive(
                    lease,
                    [c.entry for c in claims],
                    timeout=max(0.05, min(stop_at - time.monotonic(), self.server_ttl / 3)),
                ),
                self.backend.endpoints,
            )
        except BackendError as exc:
            with self._mutex:
                if time.monotonic() >= tenancy.deadline:
                    lost = self._expire(tenancy, f"renewal failed until its deadline: {exc}")
                else:
                    lost = []
                    logger.warning("renewal of lease %s failed (%s); trying again", lease.id, exc)
                    tenancy.next_renewal = time.monotonic() + min(0.5, self.server_ttl / 10)
            _notify(lost)
            return
        with self._mutex:
            if lease.expired:
                lost = self._expire(tenancy, "its lease expired on the server")
            elif time.monotonic() >= deadline:
                # held already read False meanwhile: a late success must not bring the locks back
                lost = self._expire(tenancy, "its renewal came back after the deadline")
            else:
                tenancy.restart_clock(sent, self.server_ttl, self.margin)
                lost = _lose(
                    [c for c in (tenancy.claims.pop(k, None) for k in gone) if c is not None],
                    "its key was deleted or expired",
                )
            strays = self._strays(tenancy)
        _notify(lost)
        for key in strays:
            try:
                self.backend.delete_stray(lease, key)
                logger.info("deleted %s: left on lease %s by a failed delete or an interrupted join", key, lease.id)
            except BackendError as exc:
                logger.warning("could not delete stray %s on lease %s: %s", key, lease.id, exc)

    # -- process life -------------------------------------------------------

    def drop_all(self) -> None:
        """Forget every claim without marking it lost (after fork: they are the parent's)."""
        self._mutex = threading.Lock()  # another thread may have held these at the fork
        self._granting = threading.Lock()
        self._wakeup = threading.Condition()
        self._renewer = None  # it did not survive the fork
        self._wake_at = float("inf")
        self._tenancies = []
        self._shared = None
        self._tidy = {}
        self._unnotified = []

    def close(self) -> None:
        """Mark every claim lost and revoke the leases (v3): their entries go at once."""
        with self._mutex:
            tenancies = list(self._tenancies)
            lost = [c for t in tenancies for c in self._expire(t, "its session was closed")]
            lost += self._unnotified
            self._unnotified, self._tidy = [], {}  # nothing left for the renewer: it ends when it next wakes
            self._closed = True  # and a lock released later leaves nothing for it either
        _notify(lost)
        for tenancy in tenancies:
            try:
                self.backend.revoke(tenancy.lease)
            except BackendError as exc:
                logger.warning("could not revoke lease %s: %s", tenancy.lease.id, exc)

    # -- the renewer thread -----------------------------------------------------

    def _schedule(self) -> None:
        """Make sure the renewer runs when the session is next due: start it, or wake it if sooner."""
        with self._wakeup:
            due = self.next_due
            if self._renewer is None or not self._renewer.is_alive():
                renewer = threading.Thread(
                    target=self._renew_when_due, name=f"etcdlock-renewer-{self.ttl:g}s", daemon=True
                )
                renewer.start()  # first: a thread that failed to start must not pass for a running one
                self._renewer, self._wake_at = renewer, due
            elif due < self._wake_at:
                self._wake_at = due
                self._wakeup.notify()

    def _renew_when_due(self) -> None:
        while True:
            with self._wakeup:
                due = self.next_due
                if due == float("inf"):
                    self._renewer = None  # nothing to keep alive: the next join starts a new renewer
                    return
                now = time.monotonic()
                if due > now:
                    self._wake_at = due
                    self._wakeup.wait(due - now)
                    continue
                self._wake_at = now
            try:
                self.renew()
            except Exception:  # the renewer must outlive any failure: every lock of the session depends on it
                logger.exception("renewal of the %gs session failed unexpectedly", self.ttl)
                self._not_before = time.monotonic() + 0.5

    # -- internals --------------------------------------------------------------

    def _tenancy_for_new_entry(self) -> Tenancy:
        """The tenancy a new entry goes on, with the join counted in (``joining``)."""
        if self.backend.creating_renews:
            tenancy = Tenancy(self.backend.grant(self.ttl))  # v2: every key is its own lease; no request
            tenancy.joining = 1
            return tenancy
        with self._granting:
            with self._mutex:
                shared = self._shared
                # an idle lease is not renewed: reuse it only while a renewal can still land in time
                if (
                    shared is not None
                    and not shared.dropped
                    and not shared.lease.expired
                    and time.monotonic() < shared.deadline - self.server_ttl / 3
                ):
                    shared.joining += 1
                    return shared
            sent = time.monotonic()
            tenancy = Tenancy(self.backend.grant(self.ttl))
            tenancy.restart_clock(sent, self.server_ttl, self.margin)
            tenancy.joining = 1
            with self._mutex:
                self._shared = tenancy
                self._tenancies.append(tenancy)
            return tenancy

    def _tidy_queues(self) -> None:
        now = time.monotonic()
        with self._mutex:
            due = [queue for queue, when in self._tidy.items() if when <= now]
            for queue in due:
                del self._tidy[queue]
            in_use = {claim.queue for t in self._tenancies for claim in t.claims.values()}
        for queue in due:
            if queue not in in_use:
                self.backend.forget_queue(queue)

    def _strays(self, tenancy: Tenancy) -> list[str]:
        """Keys the lease carries that no claim owns, seen by two renewals in a row (mutex held).

        A join in flight owns its key a moment after creating it; a key still unowned a renewal
        later was left by a delete that failed or a join that was interrupted.
        """
        carried = tenancy.lease.keys
        if carried is None:
            return []
        if tenancy.joining:  # a join in flight may own an unclaimed key: judge nothing this time
            tenancy.strays.clear()
            return []
        unowned = carried - tenancy.claims.keys()
        tenancy.strays = {key: tenancy.strays.get(key, 0) + 1 for key in unowned}
        return [key for key, seen in tenancy.strays.items() if seen >= 2]

    def _forget(self, claim: Claim) -> None:
        """Stop renewing ``claim`` (mutex held); a lease that carries nothing else goes with it (v2)."""
        tenancy = claim.tenancy
        tenancy.claims.pop(claim.entry.key, None)
        if not tenancy.claims and tenancy is not self._shared and tenancy in self._tenancies:
            self._drop(tenancy)

    def _drop(self, tenancy: Tenancy) -> None:
        tenancy.dropped = True
        self._tenancies.remove(tenancy)
        if tenancy is self._shared:
            self._shared = None

    def _expire(self, tenancy: Tenancy, reason: str) -> list[Claim]:
        """Every claim on ``tenancy`` is lost (mutex held). Returns the claims to notify."""
        claims = list(tenancy.claims.values())
        tenancy.claims.clear()
        tenancy.deadline = float("-inf")  # any claim still pointing here reads not alive
        tenancy.dropped = True
        if tenancy in self._tenancies:
            self._drop(tenancy)
        return _lose(claims, reason)


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
                claim.on_lost(claim, claim.lost_reason or "lost")
            except Exception:
                logger.exception("on_lost callback for %s raised", claim.entry.key)
