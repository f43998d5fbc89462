"""``Election``: leader election on the lock queue, with events.

    from celery_etcdlock import connect, Election

    e = Election(connect(), "beat", identity="host-1:4242", ttl=10)
    e.campaign()             # blocks until this node leads
    e.is_leader, e.leader(), e.token
    e.resign()               # the next candidate leads at once

    e.start()                # or campaign in the background, and follow events:
    for event in e.events(): # LeaderEvent(kind, leader)
        ...                  # kinds: "elected", "deposed", "changed", "error"
    e.stop()                 # resigns if leading; events() ends after the last event

Campaigning is acquiring a Mutex whose holder is the leader, as kazoo's
Election is its Lock; the leader's identity is the data of the queue's first
entry. So a dead leader is followed within ``ttl`` seconds plus a round
trip, a resigning one at once, and a leader that cannot renew in time sees
``is_leader`` turn False before anyone else can be elected. The token (the
leader entry's creation number) fences the leader's writes.

Event kinds:

- ``elected``: this node became leader (``leader`` is its identity).
- ``deposed``: this node stopped leading without resigning (``leader`` None);
  it campaigns again at once, without a restart.
- ``changed``: another node (or nobody: ``leader`` None) leads now. Followers
  learn it from a watch on the leader's entry, not by polling; the same watch
  wakes their campaign, so a follower holds one watch (see ``_Sightings``).
- ``error``: etcd failed; the background campaign retries after a pause.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .. import observe
from ..errors import InvalidUse, NotHeld
from ..etcd.base import Entry, Snapshot, WaitResult
from ..keys import ELECTIONS, queue_key
from .client import Client
from .queue import WRITE, QueueLock, read_state
from .session import SessionKey

logger = logging.getLogger(__name__)

ELECTED, DEPOSED, CHANGED, ERROR = "elected", "deposed", "changed", "error"


@dataclass(frozen=True)
class LeaderEvent:
    kind: str
    leader: str | None
    error: str | None = None  # "error" events: what failed, as a sentence


_END = object()


class _Sightings:
    """The queue as the observer last read it: what a background campaign waits on instead of a watch.

    A follower needs to learn two things: who leads (for ``changed`` events) and when it
    leads itself. The observer's watch of the queue's head tells both: a candidate can only
    come to lead when the entry at the head goes, which is exactly what wakes the observer.
    So while the observer runs, the campaign waits here for the observer's next read, and a
    follower holds one etcd watch, not two (one on the head, one on its predecessor).
    """

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._latest: Snapshot | None = None
        self._open = False
        self._generation = 0  # which start() the running observer belongs to

    @property
    def open(self) -> bool:
        return self._open

    def start(self) -> int:
        """Open for a new observer; what it passes to ``close``."""
        with self._changed:
            self._latest, self._open = None, True
            self._generation += 1
            return self._generation

    def close(self, generation: int) -> None:
        """The observer of ``generation`` ended: campaigns watch for themselves again."""
        with self._changed:
            if generation == self._generation:  # not an observer of an earlier start() that ended late
                self._open = False
            self._changed.notify_all()

    def publish(self, snapshot: Snapshot) -> None:
        with self._changed:
            if self._latest is None or snapshot.revision > self._latest.revision:
                self._latest = snapshot
            self._changed.notify_all()

    def wake(self) -> None:
        """Let a waiting campaign look again (it was cancelled)."""
        with self._changed:
            self._changed.notify_all()

    def after(self, revision: int, timeout: float, given_up: Callable[[], bool]) -> Snapshot | None:
        """A read newer than ``revision`` (the campaign's own), once there is one; None after ``timeout``
        seconds, once ``given_up()``, or when closed (the caller looks at why)."""

        def newer() -> Snapshot | None:
            latest = self._latest
            return latest if latest is not None and latest.revision > revision else None

        with self._changed:  # given_up() is asked under the condition: a cancel's wake() cannot slip in before the wait
            if self._open and not given_up() and newer() is None:
                self._changed.wait(timeout)
            return newer()


class _LeaderLock(QueueLock):
    """The lock whose holder leads: it reports leadership, not locking."""

    kind = "election"
    _AS_LEADERSHIP = {
        observe.ACQUIRED: observe.ELECTED,
        observe.LOST: observe.DEPOSED,
        observe.RELEASED: observe.RESIGNED,
        observe.CONFLICT: observe.STANDBY,  # a candidate that waits behind the leader: the metrics export 0
    }

    def __init__(self, *args: Any, sightings: _Sightings, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sightings = sightings

    def _report(self, kind: str, **details: Any) -> None:
        if kind in self._AS_LEADERSHIP:
            super()._report(self._AS_LEADERSHIP[kind], **details)

    def cancel(self) -> None:
        super().cancel()
        self._sightings.wake()  # a campaign waiting on the observer gives up now, not at the next head change

    def _wait_and_read(
        self, blockers: list[Entry], snapshot: Snapshot, deadline: float, skey: SessionKey
    ) -> Snapshot | None:
        # Only a change of the head can let this candidate lead (an election is a writer: it leads once
        # every earlier entry is gone, the head last of all), and the observer watches the head and reads
        # the queue whenever it goes. So the background campaign waits for the observer's next read rather
        # than watching its predecessor too: one watch per follower. Without the observer (campaign()
        # alone, or after stop()) it watches its predecessor, as every lock does.
        sightings = self._sightings
        while sightings.open:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._given_up():
                return None
            seen = sightings.after(snapshot.revision, min(remaining, max(5.0, 2 * self.ttl)), self._given_up)
            if self._given_up():
                return None
            if seen is not None:
                return seen
            if not skey.alive:  # our entry was deleted or its lease lost: the acquire loop queues again
                return self._backend.read_queue(self.queue)
        return super()._wait_and_read(blockers, snapshot, deadline, skey)


class Election:
    """Leader election: one leader among the candidates of a name, the others ready to take over.

        e = Election(client, "beat", identity="host-1:4242", ttl=10)
        if e.campaign(timeout=None):         # blocks until this node leads
            e.is_leader, e.leader(), e.token # True, "host-1:4242", the leadership's fencing token
            e.resign()                       # the next candidate leads at once

        e.start()                            # or campaign in the background, and follow it:
        for event in e.events():             # LeaderEvent(kind, leader): "elected", "deposed",
            ...                              #   "changed" or "error"
        e.stop()                             # resigns if leading; events() then ends

    A dead leader is followed within ``ttl`` seconds plus a round trip; a leader
    that cannot renew in time learns it is deposed before another can be elected.
    """

    def __init__(self, client: Client, name: str, identity: str, ttl: float = 10) -> None:
        if not isinstance(identity, str) or not identity:
            raise ValueError("identity must be a non-empty string (for example 'host:pid')")
        self.client = client
        self.name = name
        self.identity = identity
        self._sightings = _Sightings()
        self._lock = _LeaderLock(
            client,
            queue_key(ELECTIONS, name),
            name,
            ttl,
            WRITE,
            on_lost=self._deposed,
            data={"identity": identity},
            sightings=self._sightings,
        )
        self.ttl = self._lock.ttl
        self._events: queue.Queue[object] = queue.Queue()
        self._stopping = threading.Event()
        self._wake = threading.Event()  # set when this leader is deposed, resigns or is asked to stop
        self._resignations = 0  # counts resign() calls: a campaign that raced one does not lead
        self._emitting = threading.Lock()
        self._leading = False  # "elected" was emitted and no "deposed" since
        self._threads: list[threading.Thread] = []

    # -- synchronous interface ------------------------------------------------

    def campaign(self, timeout: float | None = None) -> bool:
        """Block until this node leads (True), or ``timeout`` seconds pass (False)."""
        return self._campaign(timeout)

    def _campaign(self, timeout: float | None = None, abort: threading.Event | None = None) -> bool:
        if self._lock.held:
            return True
        if self._lock.token is not None:
            self._lock.release()  # a lost leadership: queue again at the back
        return self._lock.acquire(timeout=timeout, abort=abort)

    @property
    def is_leader(self) -> bool:
        return self._lock.held

    @property
    def token(self) -> int | None:
        """The fencing token of this node's leadership, while it leads."""
        return self._lock.token if self._lock.held else None

    @property
    def fence_entry(self) -> Entry | None:
        return self._lock.fence_entry

    def leader(self) -> str | None:
        """The identity of the current leader, or None; a foreign leader's proposal value (docs/interop.md)."""
        holders = read_state(self.client, self._lock.queue).holders
        return _identity(holders[0]) if holders else None

    def resign(self) -> None:
        """Stop leading (or campaigning); the next candidate leads at once.

        After ``start()``, the node then campaigns again, at the back of the queue.
        """
        self._resignations += 1
        with self._emitting:
            self._leading = False  # resigning is not being deposed: no event
        self._lock.cancel()
        with contextlib.suppress(NotHeld):
            self._lock.release()
        self._wake.set()  # only now: the campaign loop must find the lock released when it wakes

    # -- background campaign and events ----------------------------------------

    def start(self) -> None:
        """Campaign in the background; follow the outcome through ``events()``."""
        if self._threads:
            raise InvalidUse(f"election {self.name!r} already started")
        self._stopping.clear()
        generation = self._sightings.start()  # before the campaign's first wait: it must not watch for itself
        observe_loop = functools.partial(self._observe_loop, generation)
        for target, role in ((self._campaign_loop, "campaign"), (observe_loop, "observe")):
            thread = threading.Thread(target=target, name=f"etcdlock-election-{role}", daemon=True)
            self._threads.append(thread)
            thread.start()

    def events(self) -> Iterator[LeaderEvent]:
        """The events of the background campaign, until ``stop()``."""
        while True:
            event = self._events.get()
            if event is _END:
                return
            assert isinstance(event, LeaderEvent)
            yield event

    def stop(self) -> None:
        """End the background campaign; resign if leading. ``events()`` then ends."""
        self._stopping.set()
        self._wake.set()
        self.resign()
        for thread in self._threads:
            thread.join(timeout=1.0)  # the observer may sit in a watch; it is a daemon and emits nothing more
        self._threads = []
        self._events.put(_END)

    def _emit(self, kind: str, leader: str | None, error: str | None = None) -> None:
        with self._emitting:
            if kind == ELECTED:
                self._leading = True
            elif kind == DEPOSED:
                if not self._leading:
                    return  # already said, by whichever thread noticed first
                self._leading = False
            if not self._stopping.is_set():
                self._events.put(LeaderEvent(kind, leader, error))

    def _campaign_loop(self) -> None:
        while not self._stopping.is_set():
            resignations = self._resignations
            try:
                # stop() may come before the acquire starts, too early for its cancel(): abort covers that
                if not self._campaign(abort=self._stopping):
                    continue  # cancelled by resign() or stop()
            except Exception as exc:  # the campaign must outlive any failure, or the node never leads again
                # DEBUG: the ERROR event carries it to whoever runs the election (a beat logs it as a WARNING)
                logger.debug("election %s: campaign of %s failed: %s", self.name, self.identity, exc)
                self._emit(ERROR, None, error=str(exc) or type(exc).__name__)
                self._stopping.wait(min(1.0, self.ttl / 3))
                continue
            if self._stopping.is_set() or self._resignations != resignations:
                # stop() or resign() came during the campaign's last step: hand over at once
                with contextlib.suppress(NotHeld):
                    self._lock.release()
                continue
            # DEBUG: the ELECTED event and report tell the election's user, who logs it (a beat did twice)
            logger.debug("election %s: %s elected (token %s)", self.name, self.identity, self._lock.token)
            self._emit(ELECTED, self.identity)
            while self._lock.held and not self._stopping.is_set() and self._resignations == resignations:
                self._wake.wait(timeout=self.ttl / 3)  # woken on loss; the timeout is a safety net
                self._wake.clear()
            if self._stopping.is_set() or self._resignations != resignations:
                continue
            logger.warning("election %s: %s deposed; campaigning again", self.name, self.identity)
            self._emit(DEPOSED, None)  # unless _deposed or the observer said it first

    def _observe_loop(self, generation: int) -> None:
        try:
            self._observe()
        finally:
            self._sightings.close(generation)

    def _observe(self) -> None:
        """Follow the queue's first entry with a watch: to report who leads, and to wake the campaign.

        This is a follower's only watch: its campaign waits on the reads made here (``_Sightings``).
        A leader's head is its own entry, so the same watch deposes it at once when its key is deleted.
        """
        known: str | None = None  # nobody leads until the queue says otherwise
        backend = self.client.backend
        while not self._stopping.is_set():
            try:
                mine = self._lock.fence_entry  # before the read: leadership won after it is not judged by it
                snapshot = backend.read_queue(self._lock.queue)
                if mine is not None and snapshot.find(mine.token) is None:
                    snapshot = backend.read_queue(self._lock.queue, fresh=True)  # not a lagging member's view
                if mine is not None and snapshot.find(mine.token) is None:
                    # our key was deleted (an operator's force-release): stop leading now, not at the next renewal
                    self._lock.forfeit("its key was deleted", mine)
                head = snapshot.entries[0] if snapshot.entries else None
                leader = _identity(head) if head is not None else None
                if leader != known and leader != self.identity:
                    if not self._lock.held:
                        self._emit(DEPOSED, None)  # a deposed leader hears of it before hearing who follows
                    self._emit(CHANGED, leader)
                known = leader
                self._sightings.publish(snapshot)  # after the events: "changed" comes before our "elected"
                if head is None:
                    # nobody campaigns: wait for the first entry with a short watch-free pause
                    self._stopping.wait(min(1.0, self.ttl / 3))
                    continue
                while not self._stopping.is_set():
                    result = backend.wait_gone(head, snapshot.revision, timeout=max(5.0, 2 * self.ttl))
                    if result is not WaitResult.TIMEOUT:
                        break
            except Exception as exc:  # the observer must outlive any failure
                logger.debug("election %s: observing the leader failed: %s", self.name, exc)
                self._emit(ERROR, None, error=f"observing the leader failed: {exc}")
                self._stopping.wait(min(1.0, self.ttl / 3))

    def _deposed(self, _lock: QueueLock) -> None:
        self._emit(DEPOSED, None)  # a no-op after resign(), which is not being deposed
        self._wake.set()

    def __repr__(self) -> str:
        return f"<Election {self.name!r} identity={self.identity!r} leader={self.is_leader}>"


def _identity(entry: Entry) -> str | None:
    """Our candidate's identity, or a foreign one's (``etcdctl elect``, Go's concurrency.Election) proposal."""
    data = entry.value.get("data")
    if isinstance(data, dict) and data.get("identity") is not None:
        return str(data["identity"])
    return entry.raw  # not one of ours: its value is the proposal, as etcdctl elect --listen shows it
