"""The fair queue every primitive stands on: join, find my blockers, wait, leave.

A request joins the queue as a new entry (its token is its creation number,
so the queue is FIFO), reads the queue, and either holds the lock or waits
for an entry that blocks it to go:

- a writer is blocked by the entry just before it, whatever its mode;
- a reader is blocked by the last *writer* before it, so readers share, all
  readers behind a writer proceed together when it leaves, and no reader
  overtakes an earlier writer;
- a slot of a semaphore of ``limit`` holds while fewer than ``limit``
  entries are ahead of it; else it waits for any one of the ``limit``
  entries just ahead of it to go. Watching a single one would not do:
  holders leave in any order, and a waiter that watched a long holder would
  leave the slot of a short one idle. A release therefore wakes at most
  ``limit`` waiters, and exactly one for a writer (``limit`` 1).

Each waiter watches its blockers only (no herd), from the revision of the
read that decided to wait (no lost wake-ups), and re-reads the queue after
every wake-up, which also re-checks that its own entry still exists. Every
exit path deletes its own entry, guarded by its value. A ``Mutex`` is a
writer; ``RWLock`` offers both; a ``Semaphore`` takes slots; an
``Election`` is a writer whose holder leads.

An acquire that may not wait (``blocking=False``, or ``timeout=0``) looks
before it joins: it creates an entry only if the queue is empty (one v3
transaction), so its own entry never makes another request give up, and a
request that gives up always saw someone hold the lock or queue for it. The
queue it saw is kept as ``conflict``, so that nobody reads it again to say
who held the lock.

    lock = QueueLock(client, "locks/x", "x", ttl=10, mode="write")
    if lock.acquire(timeout=5):
        try:
            use(lock.token)
        finally:
            lock.release()
    else:
        print("held by", lock.conflict.described() if lock.conflict else "nobody any more")
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypedDict

from .. import observe
from ..errors import InvalidUse, LimitMismatch, LockLost, NotHeld
from ..etcd.base import Entry, Snapshot, WaitResult, encode_json
from ..options import check_timeout, check_ttl
from .client import Client, check_client
from .session import SessionKey

logger = logging.getLogger(__name__)

READ, WRITE, SLOT = "read", "write", "slot"
MODES = (READ, WRITE, SLOT)
_HOSTNAME = socket.gethostname()
_holder = (0, "")  # (pid, "host:pid") of the last process that asked
MAX_DATA_BYTES = 64 * 1024  # what a holder may record in its entry: every waiter reads every entry


# -- reading a queue ----------------------------------------------------------------------------


def blockers_of(entries: list[Entry], mine: Entry, mode: str, limit: int = 1) -> list[Entry]:
    """The entries ``mine`` waits for (any one of them going may let it in), or ``[]`` if it holds the lock."""
    earlier = [e for e in entries if e.token < mine.token]
    if mode == WRITE:
        return earlier[-1:]
    if mode == SLOT:
        return earlier[-limit:] if len(earlier) >= limit else []
    writers = [e for e in earlier if e.mode == WRITE]
    return writers[-1:]


class Holder(TypedDict):
    """One holder of a lock, as ``holders()`` lists them (a plain dict, so that signals and events carry it as JSON).

    for h in Mutex(client, "reports/daily").holders():
        print(h["holder"], h["token"], h["data"].get("task_id"))
    """

    holder: str | None  #: ``host:pid`` of the holding process (or a candidate's identity, for an election)
    token: int  #: its fencing token
    mode: str  #: "write" (a Mutex, or an RWLock's writer), "read", or "slot" (a Semaphore)
    data: dict[str, Any]  #: what the holder recorded (``data=``): a task's ``task_id``, ``task``, ``hostname``


def describe(entry: Entry) -> Holder:
    """What ``holders()`` reports about an entry: holder, token, mode and data."""
    return {
        "holder": entry.value.get("holder"),
        "token": entry.token,
        "mode": entry.mode,
        "data": entry.value.get("data") or {},
    }


@dataclass(frozen=True)
class QueueState:
    """A queue as one read saw it: who holds the lock, who waits, in order."""

    entries: list[Entry]
    revision: int

    @classmethod
    def of(cls, snapshot: Snapshot) -> QueueState:
        return cls(snapshot.entries, snapshot.revision)

    @property
    def holders(self) -> list[Entry]:
        """The entries that hold the lock: the first writer, the readers at the head, or a semaphore's first slots."""
        entries = self.entries
        if not entries or entries[0].mode == WRITE:
            return entries[:1]
        if entries[0].mode == SLOT:
            return entries[: entries[0].limit]
        count = 0
        while count < len(entries) and entries[count].mode != WRITE:
            count += 1
        return entries[:count]

    @property
    def waiters(self) -> list[Entry]:
        return self.entries[len(self.holders) :]

    def described(self) -> list[Holder]:
        """The holders as ``describe`` reports them."""
        return [describe(e) for e in self.holders]


def read_state(client: Client, queue: str, fresh: bool = False) -> QueueState:
    """The state of ``queue`` now (one read; ``fresh``: linearizable, even on v2)."""
    return QueueState.of(check_client(client).backend.read_queue(queue, fresh=fresh))


# -- one request on a queue ------------------------------------------------------------------------


class QueueLock:
    """One request on a fair queue: what ``Mutex``, ``Semaphore``, ``ReadLock``, ``WriteLock`` and the
    ``Election`` share (``acquire``, ``release``, ``held``, ``token``, ``holders()``, ``on_lost``, ``with``).

    A lock object is used by one thread at a time and is not reentrant; give
    each thread its own object (they exclude each other like processes do).
    ``held`` may be read from any thread.
    """

    #: what kind of lock it is, in reports, signals and metrics: "mutex", "semaphore", "read", "write" or
    #: "election"; a bare QueueLock is of the kind of its mode
    kind = ""

    def __init__(
        self,
        client: Client,
        queue: str,
        name: str,
        ttl: float,
        mode: str,
        on_lost: Callable[[Any], None] | None = None,
        *,
        data: dict[str, Any] | None = None,
        limit: int = 1,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(map(repr, MODES))}, not {mode!r}")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be a positive whole number, not {limit!r}")
        if on_lost is not None and not callable(on_lost):
            raise TypeError("on_lost must be callable")
        if data is not None and not isinstance(data, dict):
            raise TypeError(f"data must be a dict of JSON values, not {type(data).__name__}")
        self.client = check_client(client)
        self.queue = queue
        self.name = name
        self.ttl = check_ttl(ttl)
        self.mode = mode
        self.kind = self.kind or mode
        self.limit = limit if mode == SLOT else 1
        self.on_lost = on_lost
        self.data = data
        size = len(encode_json(data)) if data else 0
        if size > MAX_DATA_BYTES:
            raise ValueError(f"data of lock {name!r} is {size} bytes as JSON; it may be at most {MAX_DATA_BYTES}")
        #: the queue as this object's last acquire saw it when it could not take the lock at once (None if it could)
        self.conflict: QueueState | None = None
        self._session = client.session(self.ttl)  # looked up again at each acquire: a forked child gets its own
        self._backend = client.backend
        self._held: SessionKey | None = None
        self._held_since = 0.0
        self._waiting: SessionKey | None = None
        self._state = threading.Lock()  # makes cancel() and the end of an acquire exclusive
        self._busy = threading.Lock()
        self._cancelled = False  # set by cancel(), under _state
        self._reported: SessionKey | None = None  # the key whose loss on_lost was told of: once per hold
        self._abort: threading.Event | None = None

    # -- public interface -----------------------------------------------------

    @property
    def held(self) -> bool:
        skey = self._held
        return skey is not None and skey.alive

    @property
    def token(self) -> int | None:
        skey = self._held
        return skey.entry.token if skey is not None else None

    @property
    def fence_entry(self) -> Entry | None:
        skey = self._held
        return skey.entry if skey is not None and skey.alive else None

    @property
    def lost_cause(self) -> str | None:
        """Why the lock was lost (``observe.DELETED``, ``LATE``, ``REVOKED``, ``CLOSED``), while it is known."""
        skey = self._held
        return skey.lost_cause if skey is not None else None

    @property
    def lost_reason(self) -> str | None:
        """Why the lock was lost, in words, while it is known."""
        skey = self._held
        return skey.lost_reason if skey is not None else None

    @property
    def holder(self) -> str:
        """``host:pid`` of this process (a forked child has its own)."""
        global _holder
        pid = os.getpid()
        if _holder[0] != pid:
            _holder = (pid, f"{_HOSTNAME}:{pid}")
        return _holder[1]

    def acquire(
        self,
        blocking: bool = True,
        timeout: float | None = None,
        *,
        abort: threading.Event | None = None,
        on_wait: Callable[[QueueState], None] | None = None,
    ) -> bool:
        """Wait for the lock (up to ``timeout`` seconds; not at all if not ``blocking`` or ``timeout`` is 0).

        When it cannot take the lock at once, ``conflict`` keeps the queue it saw, and
        ``on_wait(state)`` (if given) is called once before it starts waiting.
        Once ``abort`` is set, this acquire gives up (returns False) at its next step,
        even if it was set before the acquire started; a wait already under way ends
        at its next wake-up, so pair it with ``cancel()`` to end that wait at once.
        """
        timeout = check_timeout(timeout)
        if not self._busy.acquire(blocking=False):
            raise InvalidUse(f"lock {self.name!r}: acquire() while this object is already in use")
        try:
            if self._held is not None:
                raise InvalidUse(f"lock {self.name!r} is already held by this object (lock objects are not reentrant)")
            self._cancelled = False
            self._abort = abort
            self.conflict = None
            waits = blocking and timeout != 0
            wait = 0.0 if not waits else float("inf") if timeout is None else timeout
            deadline = time.monotonic() + wait
            return self._acquire(deadline, waits, on_wait)
        finally:
            self._busy.release()

    def release(self) -> None:
        """Release the lock. ``NotHeld`` if this object does not hold it; quiet if it was lost."""
        with self._state:
            skey, self._held = self._held, None
            if skey is None:
                raise NotHeld(f"lock {self.name!r} is not held by this object")
            was_alive = skey.alive
            # lost, but not told yet (the renewer had not got to it): from now on nobody else would say so
            untold = not was_alive and self._reported is not skey
            self._reported = skey
        self._session.leave(skey)
        held_for = time.monotonic() - self._held_since
        if was_alive:
            logger.debug("lock %s released by %s (token %d)", self.name, self.holder, skey.entry.token)
            self._report(observe.RELEASED, token=skey.entry.token, seconds=held_for)
        elif untold:
            reason = skey.lost_reason or "no renewal succeeded in time"
            logger.warning("lock %s LOST by %s (token %d): %s", self.name, self.holder, skey.entry.token, reason)
            self._report(observe.LOST, token=skey.entry.token, seconds=held_for, cause=skey.lost_cause or observe.LATE)

    def forfeit(self, reason: str, entry: Entry | None = None) -> None:
        """Give the lock up as lost (its key, ``entry`` if given, was seen deleted) without waiting for a renewal."""
        skey = self._held
        if skey is not None and (entry is None or skey.entry == entry):
            self._session.mark_lost(skey, reason)

    def cancel(self) -> None:
        """Make a blocked ``acquire()`` in another thread give up (it returns False) and leave the queue now."""
        with self._state:
            self._cancelled = True
            waiting = self._waiting
        if waiting is not None:
            self._session.leave(waiting)

    def holders(self) -> list[Holder]:
        """Who holds the lock now (``[]`` when free): holder, token, mode and data."""
        return read_state(self.client, self.queue).described()

    def __enter__(self) -> QueueLock:
        self.acquire()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        skey = self._held
        lost = skey is not None and not skey.alive
        self.release()
        if lost and exc_type is None and skey is not None:
            reason = skey.lost_reason or "its TTL ran out"
            raise LockLost(f"lock {self.name!r} was lost while the block ran: {reason}", self.name, skey.lost_cause)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} mode={self.mode} held={self.held} token={self.token}>"

    # -- the algorithm --------------------------------------------------------

    def _value(self) -> dict[str, Any]:
        value: dict[str, Any] = {"holder": self.holder, "mode": self.mode}
        if self.mode == SLOT:
            value["limit"] = self.limit
        if self.data:
            value["data"] = self.data
        return value

    def _join(self, waits: bool) -> tuple[SessionKey | None, Snapshot]:
        """Join the queue; an acquire that may not wait looks first, and joins only if it could hold."""
        self._session = self.client.session(self.ttl)
        if waits:
            return self._session.join(self.queue, self._value(), on_lost=self._lost)
        skey, snapshot = self._session.join_if_empty(self.queue, self._value(), on_lost=self._lost)
        if skey is None:
            self._check_limit(snapshot, None)
            entries = snapshot.entries
            shares = (self.mode == READ and not any(e.mode == WRITE for e in entries)) or (
                self.mode == SLOT and len(entries) < self.limit
            )
            if shares:  # readers share, and a semaphore with a free slot lets one more in
                return self._session.join(self.queue, self._value(), on_lost=self._lost)
        return skey, snapshot

    def _check_limit(self, snapshot: Snapshot, skey: SessionKey | None) -> None:
        """Everyone on a semaphore must agree on its limit: refuse to take part with another one."""
        if self.mode != SLOT:
            return
        others = [e for e in snapshot.entries if e.mode == SLOT and e.limit != self.limit]
        if others:
            if skey is not None:
                self._session.leave(skey)
            raise LimitMismatch(
                f"semaphore {self.name!r} has limit {others[0].limit} (held or queued for by "
                f"{others[0].value.get('holder')}), not {self.limit}: every participant must ask for the same limit",
                self.name,
                others[0].limit,
                self.limit,
            )

    def _acquire(self, deadline: float, waits: bool, on_wait: Callable[[QueueState], None] | None) -> bool:
        if self._given_up():
            return False  # aborted before it began: do not even show up in the queue
        started = time.monotonic()
        skey, snapshot = self._join(waits)
        if skey is None:
            self._blocked(QueueState.of(snapshot), waits=False)
            return False
        self._check_limit(snapshot, skey)
        try:
            if not self._wait_with(skey):
                self._session.leave(skey)
                return False
            while True:
                mine = snapshot.find(skey.entry.token)
                if mine is None:  # maybe a lagging member: ask the leader before giving up the entry
                    snapshot = self._backend.read_queue(self.queue, fresh=True)
                    mine = snapshot.find(skey.entry.token)
                if mine is None or not skey.alive:
                    self._session.leave(skey)
                    if time.monotonic() >= deadline or self._given_up():
                        return False
                    logger.warning(
                        "lock %s: queue entry of %s vanished while waiting; queueing again", self.name, self.holder
                    )
                    skey, snapshot = self._session.join(self.queue, self._value(), on_lost=self._lost)
                    if not self._wait_with(skey):
                        self._session.leave(skey)
                        return False
                    continue
                blockers = blockers_of(snapshot.entries, mine, self.mode, self.limit)
                if not blockers:
                    return self._took(skey, mine, started)
                first = self.conflict is None
                state = QueueState(
                    [e for e in snapshot.entries if e.token != mine.token], snapshot.revision
                )  # the queue without me: who holds it and who waits ahead
                self.conflict = state
                if first:
                    self._blocked(state, waits=waits and time.monotonic() < deadline)
                    if on_wait is not None and waits:
                        on_wait(state)
                after = self._wait_and_read(blockers, snapshot, deadline, skey)
                if after is None:
                    self._session.leave(skey)
                    if waits and not self._given_up():
                        self._report(observe.TIMED_OUT, seconds=time.monotonic() - started, state=state)
                    return False
                snapshot = after
        except BaseException:
            if self._held is skey:
                self._held = None
            self._session.leave(skey)  # never leave a dead request blocking the queue
            raise
        finally:
            with self._state:
                self._waiting = None

    def _took(self, skey: SessionKey, mine: Entry, started: float) -> bool:
        with self._state:
            cancelled = self._given_up()
            if not cancelled:
                self._held, self._waiting = skey, None
        if cancelled:
            self._session.leave(skey)
            return False
        self._held_since = time.monotonic()
        logger.debug("lock %s acquired by %s (token %d, %s)", self.name, self.holder, mine.token, self.mode)
        self._report(observe.ACQUIRED, token=mine.token, seconds=self._held_since - started)
        if skey.lost.is_set():  # lost in the instant before it became ours: _lost may have skipped it
            self._lost(skey)
        return True

    def _blocked(self, state: QueueState, waits: bool) -> None:
        self.conflict = state
        holders = state.described()
        logger.debug(
            "lock %s: %s found it held by %s%s",
            self.name,
            self.holder,
            ", ".join(str(h["holder"]) for h in holders) or "nobody (queued requests only)",
            "; waiting" if waits else "; not waiting",
        )
        if observe.listening():
            self._report(observe.CONFLICT, state=state, blocking=waits)

    def _given_up(self) -> bool:
        return self._cancelled or (self._abort is not None and self._abort.is_set())

    def _wait_with(self, skey: SessionKey) -> bool:
        """Make ``skey`` the one cancel() deletes; False if cancel() came first."""
        with self._state:
            if self._given_up():
                return False
            self._waiting = skey
            return True

    def _wait_and_read(
        self, blockers: list[Entry], snapshot: Snapshot, deadline: float, skey: SessionKey
    ) -> Snapshot | None:
        """Wait until one of ``blockers`` goes, then read the queue again; None at the deadline or once given up.

        ``snapshot`` is the read that decided to wait. An ``Election`` replaces this: its observer
        already watches the queue's head, and a second watch per follower would only double etcd's.
        """
        if not self._wait_for(blockers, snapshot.revision, deadline, skey):
            return None
        return self._backend.read_queue(self.queue)

    def _wait_for(self, blockers: list[Entry], revision: int, deadline: float, skey: SessionKey) -> bool:
        """Wait until one of ``blockers`` goes (True: read again) or the deadline passes (False)."""
        tokens = ", ".join(str(b.token) for b in blockers)
        logger.debug("lock %s: %s waits for token %s", self.name, self.holder, tokens)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._given_up():
                return False
            # deletions and expiries arrive as events: the bound is only a safety net against a silent
            # connection, and lets a request that was cancelled or lost go without waiting for its blocker
            result = self._backend.wait_any_gone(blockers, revision, timeout=min(remaining, max(5.0, 2 * self.ttl)))
            if result is WaitResult.STALE:
                logger.debug(
                    "lock %s: %s cannot watch from index %d any more; reading again", self.name, self.holder, revision
                )
            if result is not WaitResult.TIMEOUT or not skey.alive:
                return not self._given_up()

    def _lost(self, skey: SessionKey) -> None:
        with self._state:
            if self._held is not skey or not skey.lost.is_set() or self._reported is skey:
                return  # a request still waiting (the acquire loop queues it again), a past hold, or said already
            self._reported = skey
        logger.warning("lock %s LOST by %s (token %d): %s", self.name, self.holder, skey.entry.token, skey.lost_reason)
        self._report(
            observe.LOST,
            token=skey.entry.token,
            seconds=time.monotonic() - self._held_since,
            cause=skey.lost_cause,
        )
        if self.on_lost is not None:
            self.on_lost(self)

    def _report(
        self,
        kind: str,
        *,
        token: int | None = None,
        seconds: float | None = None,
        cause: str | None = None,
        state: QueueState | None = None,
        blocking: bool = False,
    ) -> None:
        if not observe.listening():
            return
        observe.report(
            observe.Event(
                kind,
                name=self.name,
                lock_kind=self.kind,
                token=token,
                holder=self.holder,
                data=dict(self.data or {}),
                seconds=seconds,
                cause=cause,
                holders=tuple(state.described()) if state is not None else (),
                blocking=blocking,
            )
        )
