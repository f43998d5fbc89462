"""The fair queue every primitive stands on: join, find my blocker, wait, leave.

A request joins the queue as a new entry (its token is its creation number,
so the queue is FIFO), reads the queue, and either holds the lock or waits
for the one entry that blocks it to go:

- a writer is blocked by the entry just before it, whatever its mode;
- a reader is blocked by the last *writer* before it, so readers share, all
  readers behind a writer proceed together when it leaves, and no reader
  overtakes an earlier writer.

Each waiter watches its blocker only (no herd), from the revision of the
read that decided to wait (no lost wake-ups), and re-reads the queue after
every wake-up, which also re-checks that its own entry still exists. Every
exit path deletes its own entry, guarded by its value. A ``Mutex`` is a
writer; ``RWLock`` offers both; an ``Election`` is a writer whose holder
leads.

    lock = QueueLock(client, "locks/x", "x", ttl=10, mode="write")
    if lock.acquire(timeout=5):
        try:
            use(lock.token)
        finally:
            lock.release()
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

from .backends.base import Entry, WaitResult
from .client import Client, check_client
from .errors import InvalidUse, LockLost, NotHeld
from .options import check_timeout, check_ttl
from .session import SessionKey

logger = logging.getLogger(__name__)

READ, WRITE = "read", "write"


def blocker_of(entries: list[Entry], mine: Entry, mode: str) -> Entry | None:
    """The entry ``mine`` must wait for, or None if it holds the lock."""
    earlier = [e for e in entries if e.token < mine.token]
    if mode == WRITE:
        return earlier[-1] if earlier else None
    writers = [e for e in earlier if e.mode == WRITE]
    return writers[-1] if writers else None


def holders_of(entries: list[Entry]) -> list[Entry]:
    """The entries that hold the lock now: the first writer, or the leading readers."""
    if not entries:
        return []
    if entries[0].mode == WRITE:
        return entries[:1]
    holders = []
    for entry in entries:
        if entry.mode == WRITE:
            break
        holders.append(entry)
    return holders


def describe(entry: Entry) -> dict[str, Any]:
    """What the public ``holders()`` methods report about an entry."""
    return {
        "holder": entry.value.get("holder"),
        "token": entry.token,
        "mode": entry.mode,
        "data": entry.value.get("data") or {},
    }


class QueueLock:
    """One request on a fair queue, with the interface of ``Mutex``.

    A lock object is used by one thread at a time and is not reentrant; give
    each thread its own object (they exclude each other like processes do).
    ``held`` may be read from any thread.
    """

    def __init__(
        self,
        client: Client,
        queue: str,
        name: str,
        ttl: float,
        mode: str,
        on_lost: Callable[[Any], None] | None = None,
        data: dict[str, Any] | None = None,
    ) -> None:
        if mode not in (READ, WRITE):
            raise ValueError(f"mode must be 'read' or 'write', not {mode!r}")
        if on_lost is not None and not callable(on_lost):
            raise TypeError("on_lost must be callable")
        if data is not None and not isinstance(data, dict):
            raise TypeError(f"data must be a dict of JSON values, not {type(data).__name__}")
        self.client = check_client(client)
        self.queue = queue
        self.name = name
        self.ttl = check_ttl(ttl)
        self.mode = mode
        self.on_lost = on_lost
        self.data = data
        self._session = client.session(self.ttl)  # looked up again at each acquire: a forked child gets its own
        self._backend = client.backend
        self._held: SessionKey | None = None
        self._waiting: SessionKey | None = None
        self._state = threading.Lock()  # makes cancel() and the end of an acquire exclusive
        self._busy = threading.Lock()
        self._cancelled = threading.Event()
        self._reported: SessionKey | None = None  # the skey whose loss on_lost was told of: once per hold
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
    def holder(self) -> str:
        return f"{socket.gethostname()}:{os.getpid()}"

    def acquire(
        self, blocking: bool = True, timeout: float | None = None, *, abort: threading.Event | None = None
    ) -> bool:
        """Wait for the lock (up to ``timeout`` seconds; not at all if not ``blocking``).

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
            self._cancelled.clear()
            self._abort = abort
            deadline = time.monotonic() + (0.0 if not blocking else timeout if timeout is not None else float("inf"))
            return self._acquire(deadline)
        finally:
            self._busy.release()

    def release(self) -> None:
        """Release the lock. ``NotHeld`` if this object does not hold it; quiet if it was lost."""
        skey, self._held = self._held, None
        if skey is None:
            raise NotHeld(f"lock {self.name!r} is not held by this object")
        was_alive = skey.alive
        self._session.leave(skey)
        if was_alive:
            logger.info("lock %s released by %s (token %d)", self.name, self.holder, skey.entry.token)

    def forfeit(self, reason: str, entry: Entry | None = None) -> None:
        """Give the lock up as lost (its key, ``entry`` if given, was seen deleted) without waiting for a renewal."""
        skey = self._held
        if skey is not None and (entry is None or skey.entry == entry):
            self._session.mark_lost(skey, reason)

    def cancel(self) -> None:
        """Make a blocked ``acquire()`` in another thread give up (it returns False) and leave the queue now."""
        with self._state:
            self._cancelled.set()
            waiting = self._waiting
        if waiting is not None:
            self._session.leave(waiting)

    def holders(self) -> list[dict[str, Any]]:
        """Who holds the lock now (``[]`` when free): holder, token, mode and data."""
        return [describe(e) for e in holders_of(self._backend.read_queue(self.queue).entries)]

    def __enter__(self) -> QueueLock:
        self.acquire()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        skey = self._held
        lost = skey is not None and not skey.alive
        self.release()
        if lost and exc_type is None:
            reason = skey.lost_reason if skey is not None and skey.lost_reason else "its TTL ran out"
            raise LockLost(f"lock {self.name!r} was lost while the block ran: {reason}")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} mode={self.mode} held={self.held} token={self.token}>"

    # -- the algorithm --------------------------------------------------------

    def _value(self) -> dict[str, Any]:
        value: dict[str, Any] = {"holder": self.holder, "mode": self.mode}
        if self.data:
            value["data"] = self.data
        return value

    def _acquire(self, deadline: float) -> bool:
        if self._given_up():
            return False  # aborted before it began: do not even show up in the queue
        self._session = self.client.session(self.ttl)
        skey, snapshot = self._session.join(self.queue, self._value(), on_lost=self._lost)
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
                blocker = blocker_of(snapshot.entries, mine, self.mode)
                if blocker is None:
                    with self._state:
                        cancelled = self._given_up()
                        if not cancelled:
                            self._held, self._waiting = skey, None
                    if cancelled:
                        self._session.leave(skey)
                        return False
                    logger.info("lock %s acquired by %s (token %d, %s)", self.name, self.holder, mine.token, self.mode)
                    if skey.lost.is_set():  # lost in the instant before it became ours: _lost may have skipped it
                        self._lost(skey, skey.lost_reason or "lost")
                    return True
                if not self._wait_for(blocker, snapshot.revision, deadline, skey):
                    self._session.leave(skey)
                    return False
                snapshot = self._backend.read_queue(self.queue)
        except BaseException:
            if self._held is skey:
                self._held = None
            self._session.leave(skey)  # never leave a dead request blocking the queue
            raise
        finally:
            with self._state:
                self._waiting = None

    def _given_up(self) -> bool:
        return self._cancelled.is_set() or (self._abort is not None and self._abort.is_set())

    def _wait_with(self, skey: SessionKey) -> bool:
        """Make ``skey`` the one cancel() deletes; False if cancel() came first."""
        with self._state:
            if self._given_up():
                return False
            self._waiting = skey
            return True

    def _wait_for(self, blocker: Entry, revision: int, deadline: float, skey: SessionKey) -> bool:
        """Wait until ``blocker`` goes (True: read again) or the deadline passes (False)."""
        logger.debug("lock %s: %s waits for token %d", self.name, self.holder, blocker.token)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._given_up():
                return False
            # deletions and expiries arrive as events: the bound is only a safety net against a silent
            # connection, and lets a request that was cancelled or lost go without waiting for its blocker
            result = self._backend.wait_gone(blocker, revision, timeout=min(remaining, max(5.0, 2 * self.ttl)))
            if result is WaitResult.STALE:
                logger.debug(
                    "lock %s: %s cannot watch from index %d any more; reading again", self.name, self.holder, revision
                )
            if result is not WaitResult.TIMEOUT or not skey.alive:
                return not self._given_up()

    def _lost(self, skey: SessionKey, reason: str) -> None:
        with self._state:
            if self._held is not skey or not skey.lost.is_set() or self._reported is skey:
                return  # a request still waiting (the acquire loop queues it again), a past hold, or said already
            self._reported = skey
        logger.warning("lock %s LOST by %s (token %d): %s", self.name, self.holder, skey.entry.token, reason)
        if self.on_lost is not None:
            self.on_lost(self)
