"""Sessions: what keeps a process's queue entries alive, and says when they are not.

As in etcd's ``concurrency`` package, a process has one session per client
and TTL, and each session one background thread (its renewer) that renews
every entry of the session, whatever the number of locks held or waited
for; so a slow etcd behind one session never delays another's renewals. In
v3 the entries of a session ride on one shared lease (a new one for every
``ENTRIES_PER_LEASE`` more), kept alive every ttl/3; in v2 each entry is a
key with a TTL of its own, refreshed every ttl/3 (``refresh=true``, which
wakes no watcher). The renewer ends when the
session has nothing left to keep alive, and the next join starts it again.

Each lease keeps a local deadline: the *send* time (monotonic clock) of the
last renewal that succeeded, plus the TTL etcd was given, minus a safety
margin. The server cannot expire the lease's entries before that moment, so
a holder that checks the deadline steps down before anyone else can step
in. When the deadline passes, or a renewal finds an entry gone, every skey
concerned is marked lost at once and its ``on_lost`` callback runs on the
renewer thread, outside every lock (also for a loss another thread saw). A
skey knows its own lease, so a skey is never judged by a clock that does
not renew it.

    session = client.session(ttl=10)
    skey, snapshot = session.join("locks/x", {"mode": "write"}, on_lost=lambda skey: print(skey.lost_reason))
    skey.alive        # False once lost (skey.lost_cause says why: observe.DELETED, LATE, REVOKED, CLOSED)
    session.leave(skey)

Sessions do not survive ``fork()``: the child starts with none and builds
its own on first use (see ``Client``).

Under gevent (``celery worker -P gevent``) the renewer is a native OS thread
with connections of its own (``green.py``), so that a task that does not
yield cannot stop its lock's renewal; ``on_lost`` callbacks then run in a
greenlet of the thread that joined. eventlet is refused (``UnsupportedPool``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from .. import clock, green
from ..errors import BackendError
from ..etcd import retry
from ..etcd.base import Backend, Entry, Lease, LeaseExpired, Snapshot
from ..observe import CLOSED, DELETED, LATE, REVOKED

logger = logging.getLogger(__name__)


TIDY_DELAY = 5.0  # seconds a released queue stays unused before its (v2) directory is removed
#: the most entries one v3 lease carries; more go on a new lease. A renewal lists the keys of its lease (etcd's
#: LeaseTimeToLive with keys, which has no paging): about 100 bytes a key, so 10,000 keys answer in about 1 MB,
#: far below the transport's cap on a response, where 100,000 on one lease would not fit at all
ENTRIES_PER_LEASE = 10_000


def safety_margin(ttl: float) -> float:
    """How long before the server could expire an entry its holder gives up on it.

    Covers clock-rate differences and the time a renewal takes to be applied.
    """
    return min(max(0.1, 0.05 * ttl), ttl / 4)


class Flag:
    """Set once, read from any thread: the ``set``/``is_set`` of ``threading.Event``, which under gevent is a
    greenlet event that a native thread (the renewer) must not set."""

    __slots__ = ("_set",)

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


class SessionKey:
    """One queue entry this process created and keeps alive until it leaves (etcd: a Mutex's myKey and myRev)."""

    def __init__(
        self,
        lease: SessionLease,
        queue: str,
        entry: Entry,
        on_lost: Callable[[SessionKey], None] | None,
        hub: Callable[..., Any] | None = None,
    ) -> None:
        self.lease = lease
        self.queue = queue
        self.entry = entry
        self.on_lost = on_lost
        self.hub = hub  # under gevent: runs on_lost in a greenlet of the thread that joined (green.hub_runner)
        self.pid = os.getpid()
        self.lost_cause: str | None = None  # observe.DELETED, LATE, REVOKED or CLOSED, once lost
        self.lost_reason: str | None = None  # the same, in words, for logs and LockLost
        self.lost = Flag()

    @property
    def alive(self) -> bool:
        return (
            not self.lost.is_set()
            and self.pid == os.getpid()
            and not self.lease.handle.expired
            and clock.now() < self.lease.deadline
        )

    def __repr__(self) -> str:
        return f"<SessionKey {self.entry.key} token={self.entry.token} alive={self.alive}>"


class SessionLease:
    """One lease of a session (etcd: the session's lease), the keys riding on it, and its clock.

    Guarded by the session's mutex. A session has one lease that new keys go on
    (v3), and keeps older ones alive as long as keys still ride on them.
    """

    def __init__(self, handle: Lease) -> None:
        self.handle = handle  # the backend's lease: etcd's in v3; in v2, the one key it carries
        self.skeys: dict[str, SessionKey] = {}
        self.deadline = 0.0  # on clock.now(): the server cannot expire the lease's entries before it
        self.next_renewal = float("inf")
        self.strays: dict[str, int] = {}  # keys on the lease that no skey owns -> renewals that saw them
        self.joining = 0  # joins in flight: their keys may be on the lease before their skeys exist
        self.dropped = False  # expired or idle: no skey may join it any more

    @property
    def server_ttl(self) -> int:
        """What etcd keeps the entries for, in whole seconds: the clocks run on it."""
        return self.handle.server_ttl

    def restart_clock(self, sent: float) -> None:
        self.deadline = sent + self.server_ttl - safety_margin(self.server_ttl)
        self.next_renewal = sent + self.server_ttl / 3


class Session:
    """The entries one process holds or queues with one TTL, on one client."""

    def __init__(self, backend: Backend, ttl: float, retry_max_delay: float) -> None:
        self.backend = backend
        self.ttl = ttl
        self.retry_max_delay = retry_max_delay
        # Under gevent the renewer is a native thread that renews through a twin of the backend (see green.py)
        self.green = green.check_pool() == green.GEVENT  # UnsupportedPool under eventlet
        self.renewing_backend = backend.native_twin() if self.green else backend
        self._sleep = green.native_sleep() if self.green else None  # between renewal attempts (None: tenacity's)
        # guards the leases, their skeys and clocks, and _tidy; the renewer shares it, so an OS lock, held only
        # for bookkeeping (never across I/O, a log call or a callback)
        self._mutex = green.native_lock()
        self._granting = threading.Lock()  # one grant at a time: concurrent joins share one lease (held across I/O)
        self._leases: list[SessionLease] = []
        self._shared: SessionLease | None = None  # the lease new entries go on (v3)
        self._tidy: dict[str, float] = {}  # queue -> when to remove its container if still unused
        self._not_before = 0.0  # set by the renewer after an unexpected failure, to pace retries
        self._unnotified: list[SessionKey] = []  # lost by another thread: the renewer runs their on_lost
        self._closed = False
        # guards the renewer thread and _wake_at; taken before _mutex
        self._wakeup: threading.Condition | green.NativeCondition = self._new_wakeup()
        self._renewer: threading.Thread | green.NativeThread | None = None
        self._wake_at = float("inf")  # when the renewer plans to wake next

    @property
    def next_due(self) -> float:
        """When the renewer should next call ``renew()``: a renewal, an expiry or a tidy-up (inf: never)."""
        with self._mutex:
            busy = [t for t in self._leases if t.skeys]
            times = [min(t.next_renewal, t.deadline) for t in busy] + list(self._tidy.values())
            if not busy and self._leases:
                times.append(min(t.deadline for t in self._leases))  # to drop idle leases
            if self._unnotified:
                times.append(0.0)
        return max(min(times, default=float("inf")), self._not_before)

    # -- used by the primitives ---------------------------------------------

    def join(
        self, queue: str, value: dict[str, Any], on_lost: Callable[[SessionKey], None] | None = None
    ) -> tuple[SessionKey, Snapshot]:
        """Create a new entry in ``queue``, kept alive until ``leave``; and the queue as it then was."""
        skey, snapshot = self._join(queue, value, on_lost, only_if_empty=False)
        assert skey is not None
        return skey, snapshot

    def join_if_empty(
        self, queue: str, value: dict[str, Any], on_lost: Callable[[SessionKey], None] | None = None
    ) -> tuple[SessionKey | None, Snapshot]:
        """``join``, but only if ``queue`` is empty; else no entry (None) and the queue as it is.

        One request on v3 (a transaction); v2 reads first, then joins.
        """
        return self._join(queue, value, on_lost, only_if_empty=True)

    def _join(
        self, queue: str, value: dict[str, Any], on_lost: Callable[[SessionKey], None] | None, only_if_empty: bool
    ) -> tuple[SessionKey | None, Snapshot]:
        for _attempt in range(3):
            lease = self._lease_for_new_entry()
            sent = clock.now()
            try:
                if only_if_empty:
                    created, snapshot = self.backend.join_queue_if_empty(queue, value, lease.handle)
                    if created is None:
                        with self._mutex:
                            lease.joining -= 1
                        return None, snapshot
                    entry = created
                else:
                    entry, snapshot = self.backend.join_queue(queue, value, lease.handle)
            except LeaseExpired:
                with self._mutex:
                    lease.joining -= 1
                    self._unnotified += self._expire(lease, REVOKED, "its lease expired on the server")
                self._schedule()
                continue
            except BaseException:
                with self._mutex:
                    lease.joining -= 1  # its key, if created, is a stray now: a renewal deletes it
                raise
            with self._mutex:
                lease.joining -= 1
                if lease.dropped or lease.handle.expired:
                    stale = True  # the lease was revoked or expired while the join was in flight
                else:
                    stale = False
                    self._tidy.pop(queue, None)
                    if self.backend.entries_have_own_ttl:  # v2: the entry's own TTL starts now
                        lease.restart_clock(sent)
                        self._leases.append(lease)
                    skey = SessionKey(lease, queue, entry, on_lost, self._hub(on_lost))
                    lease.skeys[entry.key] = skey
            if stale:
                with contextlib.suppress(BackendError):
                    self.backend.delete_entry(entry)
                continue
            try:
                self._schedule(lease)
            except BaseException:  # no renewer (say, no thread could start): the entry must not stay
                with self._mutex:
                    self._forget(skey)
                with contextlib.suppress(BackendError):
                    self.backend.delete_entry(entry)
                raise
            return skey, snapshot
        raise BackendError(f"could not create an entry in {queue}: its lease kept expiring")

    def leave(self, skey: SessionKey) -> bool:
        """Stop renewing ``skey`` and delete its entry (guarded). False if it was already gone."""
        with self._mutex:
            self._forget(skey)
        if skey.pid != os.getpid():
            return False  # a parent's entry, inherited through fork: not ours to delete
        try:
            return self.backend.delete_entry(skey.entry)
        except BackendError as exc:
            # v2: nobody refreshes it any more; v3: it rides on a live lease, so a renewal deletes it as a stray
            logger.warning("could not delete %s (%s); it goes within %ss", skey.entry.key, exc, self.ttl)
            return False
        finally:
            # v2 queues are directories, which outlive their last entry: remove one that stays unused
            with self._mutex:
                tidy = self.backend.queues_outlive_entries and not self._closed
                if tidy:
                    self._tidy[skey.queue] = clock.now() + TIDY_DELAY
            if tidy:
                self._schedule()

    def mark_lost(self, skey: SessionKey, reason: str) -> None:
        """Stop renewing ``skey`` and mark it lost now (its key was seen deleted)."""
        with self._mutex:
            self._forget(skey)
            self._unnotified += _lose([skey], DELETED, reason)
        self._schedule()

    # -- used by the renewer ------------------------------------------------

    def renew(self) -> None:
        """Renew every lease that is due, expire every lease past its deadline, then tidy."""
        now = clock.now()
        with self._mutex:
            lost, self._unnotified = self._unnotified, []
            for lease in list(self._leases):
                if not lease.skeys:
                    if lease is not self._shared or now >= lease.deadline:
                        self._drop(lease)  # idle: its keys are gone; an idle shared lease just lapses
                elif now >= lease.deadline:
                    lost += self._expire(lease, LATE, f"no renewal succeeded within its {lease.server_ttl}s TTL")
            due = [t for t in self._leases if t.skeys and t.next_renewal <= now]
        _notify(lost)
        for lease in due:
            self._renew(lease)
        self._tidy_queues()  # last: housekeeping must never delay a renewal

    def _renew(self, lease: SessionLease) -> None:
        with self._mutex:
            skeys = list(lease.skeys.values())
            deadline = lease.deadline
        # one renewal period at most: a failing lease comes back soon, after the session's other leases
        stop_at = min(deadline, clock.now() + lease.server_ttl / 3)
        handle = lease.handle
        sent = clock.now()
        backend = self.renewing_backend
        try:
            operation = f"renewal of {len(skeys)} entries (lease {handle.id})"
            gone = retry.run(
                retry.renewal_policy(stop_at, operation, self._sleep, report=not self.green),
                lambda: backend.keep_alive(
                    handle,
                    [skey.entry for skey in skeys],
                    timeout=max(0.05, min(stop_at - clock.now(), lease.server_ttl / 3)),
                ),
                backend.endpoints,
                operation,
                report=not self.green,
            )
        except BackendError as exc:
            with self._mutex:
                late = clock.now() >= lease.deadline
                if late:
                    lost = self._expire(lease, LATE, f"no renewal succeeded within its {lease.server_ttl}s TTL: {exc}")
                else:
                    lost = []
                    lease.next_renewal = clock.now() + min(0.5, lease.server_ttl / 10)
            if not late:  # logged outside the mutex: a log handler may wait (under gevent, on the hub)
                logger.warning("renewal of lease %s failed (%s); trying again", handle.id, exc)
            _notify(lost)
            return
        with self._mutex:
            if handle.expired:
                lost = self._expire(lease, REVOKED, "its lease was revoked or expired on the server")
            elif clock.now() >= deadline:
                # held already read False meanwhile: a late success must not bring the locks back
                lost = self._expire(lease, LATE, "its renewal came back after the deadline")
            else:
                lease.restart_clock(sent)
                lost = _lose(
                    [skey for skey in (lease.skeys.pop(key, None) for key in gone) if skey is not None],
                    DELETED,
                    "its key was deleted on the server (force-released, or by another client)",
                )
            strays = self._strays(lease)
        _notify(lost)
        for key in strays:
            try:
                backend.delete_stray(handle, key)
                logger.info("deleted %s: left on lease %s by a failed delete or an interrupted join", key, handle.id)
            except BackendError as exc:
                logger.warning("could not delete stray %s on lease %s: %s", key, handle.id, exc)

    # -- process life -------------------------------------------------------

    def drop_all(self) -> None:
        """Forget every skey without marking it lost (after fork: they are the parent's)."""
        self._mutex = green.native_lock()  # another thread may have held these at the fork
        self._granting = threading.Lock()
        self._wakeup = self._new_wakeup()
        self._renewer = None  # it did not survive the fork
        if self.renewing_backend is not self.backend:
            self.renewing_backend.after_fork()
        self._wake_at = float("inf")
        self._leases = []
        self._shared = None
        self._tidy = {}
        self._unnotified = []

    def close(self) -> None:
        """Mark every key lost and free it on the server at once (v3 revokes the leases, v2 deletes the keys)."""
        with self._mutex:
            leases = [(lease, [skey.entry for skey in lease.skeys.values()]) for lease in self._leases]
            lost = [skey for lease, _ in leases for skey in self._expire(lease, CLOSED, "its client was closed")]
            lost += self._unnotified
            self._unnotified, self._tidy = [], {}  # nothing left for the renewer: it ends when it next wakes
            self._closed = True  # and a lock released later leaves nothing for it either
        _notify(lost)
        for lease, entries in leases:
            try:
                self.backend.revoke(lease.handle, entries)
            except BackendError as exc:
                logger.warning("could not free lease %s (%s); its keys expire in %ss", lease.handle.id, exc, self.ttl)
        if self.renewing_backend is not self.backend:
            self.renewing_backend.close()

    # -- the renewer thread -----------------------------------------------------

    def _schedule(self, joined: SessionLease | None = None) -> None:
        """Make sure the renewer runs when the session is next due: start it, or wake it if sooner.

        ``joined``: the lease a key was just added to; when the running renewer is due to wake
        before that lease needs it anyway (the common case), nothing else can have changed.
        """
        with self._wakeup:
            renewer = self._renewer
            if (
                joined is not None
                and renewer is not None
                and renewer.is_alive()
                and min(joined.next_renewal, joined.deadline) >= self._wake_at
            ):
                return
            due = self.next_due
            if self._renewer is None or not self._renewer.is_alive():
                thread = green.NativeThread if self.green else threading.Thread
                renewer = thread(target=self._renew_when_due, name=f"etcdlock-renewer-{self.ttl:g}s", daemon=True)
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
                now = clock.now()
                if due > now:
                    self._wake_at = due
                    self._wakeup.wait(due - now)
                    continue
                self._wake_at = now
            try:
                self.renew()
            except Exception:  # the renewer must outlive any failure: every lock of the session depends on it
                logger.exception("renewal of the %gs session failed unexpectedly", self.ttl)
                self._not_before = clock.now() + 0.5

    # -- internals --------------------------------------------------------------

    def _new_wakeup(self) -> threading.Condition | green.NativeCondition:
        return green.NativeCondition() if self.green else threading.Condition()

    def _hub(self, on_lost: Callable[[SessionKey], None] | None) -> Callable[..., Any] | None:
        """Under gevent, where ``on_lost`` must run: in a greenlet of the calling thread (None: on the renewer)."""
        return green.hub_runner() if self.green and on_lost is not None else None

    def _lease_for_new_entry(self) -> SessionLease:
        """The lease a new entry goes on, with the join counted in (``joining``)."""
        if self.backend.entries_have_own_ttl:
            lease = SessionLease(self.backend.grant(self.ttl))  # v2: every key is its own lease; no request
            lease.joining = 1
            return lease
        with self._granting:
            with self._mutex:
                shared = self._shared
                # an idle lease is not renewed: reuse it only while a renewal can still land in time
                if (
                    shared is not None
                    and not shared.dropped
                    and not shared.handle.expired
                    and clock.now() < shared.deadline - shared.server_ttl / 3
                    and len(shared.skeys) + shared.joining < ENTRIES_PER_LEASE
                ):
                    shared.joining += 1
                    return shared
            sent = clock.now()
            lease = SessionLease(self.backend.grant(self.ttl))
            lease.restart_clock(sent)
            lease.joining = 1
            with self._mutex:
                self._shared = lease
                self._leases.append(lease)
            return lease

    def _tidy_queues(self) -> None:
        now = clock.now()
        with self._mutex:
            due = [queue for queue, when in self._tidy.items() if when <= now]
            for queue in due:
                del self._tidy[queue]
            in_use = {skey.queue for t in self._leases for skey in t.skeys.values()}
        for queue in due:
            if queue not in in_use:
                self.renewing_backend.forget_queue(queue)

    def _strays(self, lease: SessionLease) -> list[str]:
        """Keys the lease carries that no skey owns, seen by two renewals in a row (mutex held).

        A join in flight owns its key a moment after creating it; a key still unowned a renewal
        later was left by a delete that failed or a join that was interrupted.
        """
        carried = lease.handle.keys
        if carried is None:
            return []
        if lease.joining:  # a join in flight may own an unskeyed key: judge nothing this time
            lease.strays.clear()
            return []
        unowned = carried - lease.skeys.keys()
        lease.strays = {key: lease.strays.get(key, 0) + 1 for key in unowned}
        return [key for key, seen in lease.strays.items() if seen >= 2]

    def _forget(self, skey: SessionKey) -> None:
        """Stop renewing ``skey`` (mutex held); a lease that carries nothing else goes with it (v2)."""
        lease = skey.lease
        lease.skeys.pop(skey.entry.key, None)
        if not lease.skeys and lease is not self._shared and lease in self._leases:
            self._drop(lease)

    def _drop(self, lease: SessionLease) -> None:
        lease.dropped = True
        self._leases.remove(lease)
        if lease is self._shared:
            self._shared = None

    def _expire(self, lease: SessionLease, cause: str, reason: str) -> list[SessionKey]:
        """Every skey on ``lease`` is lost (mutex held). Returns the skeys to notify."""
        skeys = list(lease.skeys.values())
        lease.skeys.clear()
        lease.deadline = float("-inf")  # any skey still pointing here reads not alive
        lease.dropped = True
        if lease in self._leases:
            self._drop(lease)
        return _lose(skeys, cause, reason)


def _lose(skeys: list[SessionKey], cause: str, reason: str) -> list[SessionKey]:
    newly_lost = [skey for skey in skeys if not skey.lost.is_set()]
    for skey in newly_lost:
        skey.lost_cause, skey.lost_reason = cause, reason
        skey.lost.set()
    return newly_lost


def _notify(skeys: list[SessionKey]) -> None:
    """Run the on_lost callbacks, outside every session lock (a callback may release its lock).

    Under gevent each runs in a greenlet of the thread that joined, when that thread's hub next runs.
    """
    for skey in skeys:
        if skey.on_lost is None:
            continue
        if skey.hub is None:
            _run_on_lost(skey)
            continue
        try:
            skey.hub(_run_on_lost, skey)
        except Exception:  # the hub is gone (its thread ended, the process is exiting): nobody to tell
            logger.exception("could not hand the loss of %s to its hub", skey.entry.key)


def _run_on_lost(skey: SessionKey) -> None:
    assert skey.on_lost is not None
    try:
        skey.on_lost(skey)
    except Exception:
        logger.exception("on_lost callback for %s raised", skey.entry.key)
