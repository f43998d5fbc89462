"""Leader-only beat for any scheduler: ``LeaderMixin`` and ``leader_only()``.

    from django_celery_beat.schedulers import DatabaseScheduler
    from celery_etcdlock.beat import leader_only

    LeaderDatabase = leader_only(DatabaseScheduler)   # what beat.LeaderDatabaseScheduler is
    # celery -A proj beat -S celery_etcdlock.beat:LeaderDatabaseScheduler

Every beat process campaigns in the election ``beat/<name>`` (``name`` is the
``etcdlock_beat_name`` setting, else the app's main module name) with the
identity ``host:pid`` and the TTL ``etcdlock_beat_ttl``; ``LeaderScheduler``
is this mixin over celery's plain ``Scheduler``, so both kinds share one
election. Only the leader ticks and sends. A follower makes no etcd request of
its own (the election's watch wakes it) and leaves the wrapped scheduler's
store alone: its ``setup_schedule()`` waits for the first take-over, and
``sync()`` writes only while leading.

A process that takes over reads the schedule from the wrapped scheduler's
store (at its first take-over: the scheduler's own ``setup_schedule()``; later:
``reload_schedule()``), then the run records in etcd (beat/runs.py), and keeps
per entry the later of the two last runs: a store written late (the old
leader sent a run, then died before its ``sync()``) cannot make a run due
again. Every run is recorded in etcd, fenced by the election, before it is
sent, and a run whose entry's last run is older than the recorded one is not
sent (its entry adopts the record): what holds, exactly, is in docs/beat.md.

Losing leadership is not fatal: the scheduler stops sending at once, logs it
and campaigns again. ``close()`` (celery beat calls it on SIGTERM and Ctrl-C)
syncs while still leading, then resigns, so a follower takes over at once.

Each message a leader sends carries the header ``etcdlock_beat``: the beat
name, the sender, its election token, the entry, its run count and the last
run before it (``after``): two messages with one entry and one ``after`` would
be one run sent twice.
"""

from __future__ import annotations

import os
import socket
import threading
from datetime import datetime, timedelta
from typing import Any

from celery.beat import ScheduleEntry, Scheduler
from celery.utils.log import get_logger
from celery.utils.time import maybe_make_aware

from .. import observe
from ..errors import BackendError
from ..locks.client import Client
from ..locks.election import Election
from ..locks.store import DocumentStore, FenceLost
from ..settings import Settings, check_at_start, client_for, enable_metrics
from .runs import STATE_KIND, RunRecords, RunState, encode_time
from .runtime import APPLY_WITHIN, RuntimeEntries
from .stores import hooks_for

logger = get_logger(__name__)

#: the longest a follower's tick waits for an "elected" event before it looks
#: at its (local) ``is_leader`` flag again; no etcd request is involved
FOLLOWER_WAKEUP = 1.0
#: how long to wait before trying again after etcd failed us
RETRY_AFTER = 1.0
#: compare-and-swap attempts of a take-over before it waits for the next tick
TAKE_OVER_ATTEMPTS = 5
#: a stored last run later than an entry's by more than this makes the entry stale (stores round times)
STALE_BY = timedelta(milliseconds=1)
#: the message header that says which leader sent which run
HEADER = "etcdlock_beat"


def beat_name(app: Any) -> str:
    """The name of the election and of the state document of ``app``'s beat."""
    name = Settings.from_app(app).beat_name
    if not name:
        raise ValueError(f"etcdlock_beat_name must be a non-empty string, not {name!r}")
    return name


class LeaderMixin:
    """Makes a ``celery.beat.Scheduler`` subclass leader-only (put it first in the bases; or use ``leader_only``).

        class LeaderPersistent(LeaderMixin, PersistentScheduler):
            pass

    ``etcd_client`` (optional) replaces the client the app's settings name;
    ``identity`` (optional) replaces ``host:pid`` in the election. Hooks for a
    scheduler with a store: ``reload_schedule()`` (re-read it at a later
    take-over), ``adopt_run(entry, last_run_at, count)`` (an entry takes a
    recorded run), ``forget_unsynced()`` (drop what a deposed leader had not
    written yet).
    """

    #: only the elected leader sends (settings.py warns at a beat's start when its scheduler does not)
    elects_a_leader = True
    #: True: the wrapped setup_schedule() reads or writes a store, so only a leader runs it;
    #: False: it only reads the configuration, so every process runs it at its start
    sets_up_when_elected = True
    #: True: the wrapped scheduler keeps runs in a store, which an entry new to etcd starts from;
    #: False: etcd alone keeps them (a new entry starts as if beat had just started)
    store_keeps_runs = True
    #: True: the entries saved at run time (``LeaderSchedulerEntry``, beat/runtime.py) are sent beside the schedule
    runtime_entries = False

    # what Scheduler provides (the mixin is always combined with it)
    app: Any
    max_interval: float
    _heap: Any
    schedule: Any
    Entry: Any

    def __init__(
        self,
        app: Any,
        *args: Any,
        etcd_client: Client | None = None,
        identity: str | None = None,
        **kwargs: Any,
    ) -> None:
        check_at_start(app, "beat")  # bad settings: one line and exit status 78, not a traceback from beat
        settings = Settings.from_app(app)
        enable_metrics(app)
        self.beat_ttl = settings.beat_ttl
        self.name = beat_name(app)
        self.identity = identity or f"{socket.gethostname()}:{os.getpid()}"
        self._etcd_client = etcd_client
        self._election: Election | None = None
        self._runs: RunRecords | None = None
        self._events_thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._closed = False
        self._in_etcd = False  # a signal handler calling close() must not reenter the client
        self._leading_token: int | None = None  # the election token this process took over with
        self._runtime: RuntimeEntries | None = None  # the entries saved at run time, if runtime_entries
        self._set_up = False  # whether the wrapped setup_schedule() ran
        self._reserved: dict[str, ScheduleEntry] = {}  # entry name -> its next entry, from reserve()
        self._sending: tuple[ScheduleEntry, ScheduleEntry] | None = None  # (entry, reserved) being sent
        super().__init__(app, *args, **kwargs)  # type: ignore[call-arg]

    # -- what celery beat calls -----------------------------------------------

    @property
    def info(self) -> str:
        mine = f"    . etcd election -> beat/{self.name} as {self.identity}, ttl {self.beat_ttl:g}s"
        theirs = str(super().info or "")  # type: ignore[misc]
        return f"{theirs}\n{mine}" if theirs.strip() else mine

    def setup_schedule(self) -> None:
        # Campaigning starts on the first tick (celery builds a second, lazy scheduler for its banner);
        # a scheduler with a store reads it only once elected.
        if not self.sets_up_when_elected:
            self._set_up_schedule()

    def tick(self, *args: Any, **kwargs: Any) -> float:
        if self._closed:
            return self.max_interval
        election = self._campaign()
        if not election.is_leader:
            self._step_down("it is no longer the leader")
            return self._stand_by(election)
        if self._leading_token is None or self._leading_token != election.token:
            self._step_down("its election token changed")
            if not self._take_over(election):
                return RETRY_AFTER
        if self._runtime is None:
            return float(super().tick(*args, **kwargs))  # type: ignore[misc]
        if self._runtime.apply(self.schedule):
            self._heap = None
        # a runtime entry saved now is applied within APPLY_WITHIN (a local look: no etcd request)
        return min(float(super().tick(*args, **kwargs)), APPLY_WITHIN)  # type: ignore[misc]

    def reserve(self, entry: ScheduleEntry) -> ScheduleEntry:
        # DatabaseScheduler's reserve() does not put the next entry in the schedule: remember it here
        reserved = self._reserved[entry.name] = super().reserve(entry)  # type: ignore[misc]
        return reserved

    def apply_entry(self, entry: ScheduleEntry, producer: Any = None) -> None:
        reserved = self._reserved.pop(entry.name, None)
        if reserved is None:  # not reserved by tick(): do it here
            reserved = self.reserve(entry)
            self._reserved.pop(entry.name, None)
        if not self._record_run(entry, reserved):
            self._unreserve(entry)
            return
        self._sending = (entry, reserved)
        try:
            super().apply_entry(entry, producer=producer)  # type: ignore[misc]
        finally:
            self._sending = None

    def apply_async(self, entry: ScheduleEntry, producer: Any = None, advance: bool = True, **kwargs: Any) -> Any:
        if advance:
            reserved = self.reserve(entry)
            self._reserved.pop(entry.name, None)
            if not self._record_run(entry, reserved):
                self._unreserve(entry)
                return None
            self._sending = (entry, reserved)
        if not self.is_leader:
            logger.warning("beat %s: not sending %s: no longer the leader", self.identity, entry.name)
            return None
        original = entry.options
        options = original or {}
        headers = {**(options.get("headers") or {}), HEADER: self._header(entry)}
        entry.options = {**options, "headers": headers}
        try:
            result = super().apply_async(entry, producer=producer, advance=False, **kwargs)  # type: ignore[misc]
        finally:
            entry.options = original
            if advance:
                self._sending = None
        if observe.listening():
            observe.report(observe.Event(observe.BEAT_SENT, name=self.name, data={"entry": entry.name}))
        return result

    def sync(self) -> None:
        # Only the leader writes the store; a deposed one would write runs another leader now owns.
        if self._leads():
            super().sync()  # type: ignore[misc]

    def close(self) -> None:
        """Stop sending, sync while still leading, and resign so that a follower takes over at once."""
        self._closed = True
        self._wake.set()
        if self._runtime is not None:
            self._runtime.close()  # only sets a flag: this may be a signal handler
        try:
            super().close()  # type: ignore[misc]
        finally:
            # From a signal handler in the middle of an etcd call, leave the
            # client alone: celery calls close() again once the stack unwound.
            if not self._in_etcd:
                self._resign()

    # -- hooks for schedulers with a store ------------------------------------

    def reload_schedule(self) -> None:
        """Re-read the schedule from the store, at a take-over after the first (default: nothing to re-read)."""

    def adopt_run(self, entry: ScheduleEntry, last_run_at: datetime, count: int) -> None:
        """``entry`` takes the run recorded in etcd (later than its own)."""
        entry.last_run_at, entry.total_run_count = last_run_at, count

    def forget_unsynced(self) -> None:
        """Drop the runs not yet written to the store: another leader owns it now (default: none kept)."""

    # -- leadership -------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        """True while this process leads and has taken over the schedule's state."""
        return not self._closed and self._leads()

    def _leads(self) -> bool:
        election = self._election
        return (
            election is not None
            and election.is_leader
            and self._leading_token is not None
            and self._leading_token == election.token
        )

    def _client(self) -> Client:
        if self._etcd_client is None:
            self._etcd_client = client_for(self.app)
        return self._etcd_client

    def _campaign(self) -> Election:
        if self._election is None:
            client = self._client()
            self._runs = RunRecords(DocumentStore(client, STATE_KIND), self.name, self.identity)
            self._election = Election(client, f"beat/{self.name}", identity=self.identity, ttl=self.beat_ttl)
            if self.runtime_entries:
                self._runtime = RuntimeEntries(client, self.app, self.name, self.identity, self.Entry)
            self._election.start()
            self._events_thread = threading.Thread(
                target=self._follow_events, args=(self._election,), name="etcdlock-beat-events", daemon=True
            )
            self._events_thread.start()
            logger.info("beat %s: campaigning for beat/%s (ttl %gs)", self.identity, self.name, self.beat_ttl)
        return self._election

    def _follow_events(self, election: Election) -> None:
        failing = False
        for event in election.events():
            if event.kind == "elected":
                logger.info("beat %s: elected leader of beat/%s (token %s)", self.identity, self.name, election.token)
            elif event.kind == "deposed":
                logger.warning(
                    "beat %s: lost leadership of beat/%s (token %s); stopped sending, campaigning again",
                    self.identity,
                    self.name,
                    self._leading_token,
                )
            elif event.kind == "changed":
                logger.info("beat %s: the leader of beat/%s is now %s", self.identity, self.name, event.leader)
            elif event.kind == "error":
                # one WARNING per outage (the election retries every second or so), the rest at DEBUG
                log = logger.debug if failing else logger.warning
                log(
                    "beat %s: could not campaign for beat/%s (%s); not sending, trying again",
                    self.identity,
                    self.name,
                    event.error or "unknown error",
                )
            failing = event.kind == "error"
            self._wake.set()

    def _stand_by(self, election: Election) -> float:
        # Sleep here rather than in celery's loop, so that an "elected" event
        # wakes us at once. Nothing here talks to etcd or to the store.
        self._wake.clear()
        if not election.is_leader and not self._closed:
            self._wake.wait(min(FOLLOWER_WAKEUP, self.max_interval))
        return 0.0

    def _step_down(self, why: str) -> None:
        if self._leading_token is not None:
            logger.warning("beat %s: stopped sending (token %s): %s", self.identity, self._leading_token, why)
            self.forget_unsynced()
        self._leading_token = None
        self._reserved.clear()
        if self._runs is not None:
            self._runs.forget()
        if self._runtime is not None:
            self._runtime.stop(self.schedule)
        self._heap = None

    def _set_up_schedule(self) -> None:
        super().setup_schedule()  # type: ignore[misc]
        self._set_up = True

    def _load_schedule(self) -> None:
        if not self._set_up:
            self._set_up_schedule()
        else:
            self.reload_schedule()

    def _resign(self) -> None:
        election, self._election = self._election, None
        if election is None:
            return
        was_leader = election.is_leader
        try:
            election.stop()
        except BackendError as exc:
            logger.warning(
                "beat %s: could not resign (%s); leadership lapses within %gs", self.identity, exc, self.beat_ttl
            )
        else:
            if was_leader:
                logger.info(
                    "beat %s: resigned leadership of beat/%s (token %s)", self.identity, self.name, self._leading_token
                )
        self._leading_token = None

    def _take_over(self, election: Election) -> bool:
        """Load the schedule, record our token in the run records, and adopt them. False if we did not."""
        runs = self._runs
        assert runs is not None
        token = election.token
        if token is None or not election.is_leader:
            return False
        try:
            self._load_schedule()
            schedule = self.schedule
        except Exception as exc:  # the store's own errors (a database that went away): try again, do not exit
            logger.warning(
                "beat %s: leading beat/%s but could not read the schedule from its store (%s: %s); not sending, "
                "trying again",
                self.identity,
                self.name,
                type(exc).__name__,
                exc,
            )
            return False
        now = self.app.now()  # what an entry new to etcd starts from, here and in the document
        for _attempt in range(TAKE_OVER_ATTEMPTS):
            if not election.is_leader or token != election.token:
                return False
            try:
                self._in_etcd = True
                try:
                    found = runs.take_over(election, token, self._initial(schedule, now), now, self.app.timezone)
                finally:
                    self._in_etcd = False
            except FenceLost:
                return False
            except BackendError as exc:
                logger.warning("beat %s: could not take over beat/%s (%s); not sending", self.identity, self.name, exc)
                return False
            if found is None:
                continue  # the document changed since we read it: read it again
            for name, state in found.items():
                self._adopt(schedule[name], state, now)
            if self._runtime is not None and not self._take_over_runtime():
                return False
            self._leading_token = token
            self._heap = None  # recompute every entry's next run from the adopted state
            logger.info(
                "beat %s: leading beat/%s with token %s (previous leader %s, token %s); sending %d entries",
                self.identity,
                self.name,
                token,
                runs.previous.get("leader"),
                runs.previous.get("token"),
                len(schedule),
            )
            return True
        logger.warning(
            "beat %s: the state of beat/%s kept changing during take-over; trying again", self.identity, self.name
        )
        return False

    def _initial(self, schedule: Any, now: datetime) -> dict[str, RunState]:
        # what an entry new to etcd starts from: as if beat had just started, or as its store says
        if not self.store_keeps_runs:
            return {name: (now, 0) for name in schedule}
        return {name: (entry.last_run_at or now, entry.total_run_count or 0) for name, entry in schedule.items()}

    def _adopt(self, entry: ScheduleEntry, state: RunState | None, now: datetime) -> None:
        # Every run is recorded in etcd before it is sent, and a store is written after: where etcd has
        # an entry's runs, they are the truth (a store may be behind, or new on this host).
        if state is None:
            if not self.store_keeps_runs:  # new to etcd, and no store: as if beat had just started
                self.adopt_run(entry, now, 0)
            return
        if self.store_keeps_runs and _later(state[0], entry.last_run_at):
            logger.info(
                "beat %s: %s last ran at %s by etcd's record, later than its store says (%s): not due again",
                self.identity,
                entry.name,
                encode_time(state[0]),
                encode_time(entry.last_run_at) if entry.last_run_at else None,
            )
        count = max(state[1], entry.total_run_count or 0) if self.store_keeps_runs else state[1]
        self.adopt_run(entry, state[0], count)

    def _take_over_runtime(self) -> bool:
        assert self._runtime is not None
        try:
            self._in_etcd = True
            try:
                self._runtime.take_over(self.schedule)
            finally:
                self._in_etcd = False
        except BackendError as exc:
            logger.warning(
                "beat %s: could not read the runtime entries of beat/%s (%s); not sending",
                self.identity,
                self.name,
                exc,
            )
            return False
        return True

    def _record_runtime_run(self, reserved: ScheduleEntry) -> bool:
        """Record a runtime entry's run in its own record, fenced. True if it may be sent now."""
        assert self._runtime is not None and self._election is not None
        try:
            self._in_etcd = True
            try:
                recorded = self._runtime.record_run(reserved, self._election, self._leading_token)
            finally:
                self._in_etcd = False
        except FenceLost:
            self._step_down("its write was fenced off")
            return False
        except BackendError as exc:
            logger.warning(
                "beat %s: could not record the run of %s (%s); not sending it", self.identity, reserved.name, exc
            )
            self._step_down("etcd failed")
            return False
        return recorded and self.is_leader

    def _unreserve(self, entry: ScheduleEntry) -> None:
        self.schedule[entry.name] = entry  # not sent: do not pretend it ran

    def _record_run(self, entry: ScheduleEntry, reserved: ScheduleEntry) -> bool:
        """Record ``reserved``'s run in etcd, fenced by the election. True if it may be sent now."""
        election, runs = self._election, self._runs
        if not self.is_leader or election is None or runs is None or runs.state is None:
            return False
        if self._runtime is not None and self._runtime.owns(entry.name):
            return self._record_runtime_run(reserved)
        recorded = runs.stored(entry.name, self.app.timezone)
        if recorded is not None and _later(recorded[0], entry.last_run_at):
            # the store this entry came from is behind the records (a re-read of a store that a deposed
            # leader had not synced): this run was sent already
            logger.warning(
                "beat %s: not sending %s: it ran at %s by etcd's record, after the %s its store says",
                self.identity,
                entry.name,
                encode_time(recorded[0]),
                encode_time(entry.last_run_at),
            )
            self.adopt_run(entry, recorded[0], max(recorded[1], entry.total_run_count or 0))
            self._heap = None
            return False
        try:
            self._in_etcd = True
            try:
                written = runs.record(election, entry.name, reserved.last_run_at, reserved.total_run_count)
            finally:
                self._in_etcd = False
        except FenceLost:
            written = False
        except BackendError as exc:
            logger.warning(
                "beat %s: could not record the run of %s (%s); not sending it", self.identity, entry.name, exc
            )
            self._step_down("etcd failed")
            return False
        if not written:
            logger.warning(
                "beat %s: not sending %s: the state of beat/%s was written by another leader or the "
                "fence (token %s) is gone",
                self.identity,
                entry.name,
                self.name,
                self._leading_token,
            )
            self._step_down("its write was fenced off")
            return False
        if not self.is_leader:
            logger.warning(
                "beat %s: not sending %s: lost leadership while recording it (run %d skipped)",
                self.identity,
                entry.name,
                reserved.total_run_count,
            )
            return False
        return True

    def _header(self, entry: ScheduleEntry) -> dict[str, Any]:
        sending = self._sending
        before, reserved = sending if sending is not None and sending[0] is entry else (entry, entry)
        return {
            "beat": self.name,
            "sender": self.identity,
            "token": self._leading_token,
            "entry": entry.name,
            "run": reserved.total_run_count,
            "after": encode_time(before.last_run_at) if before.last_run_at else None,
        }


def _later(recorded: datetime, own: datetime | None) -> bool:
    if own is None:
        return True
    try:
        return bool(recorded - own > STALE_BY)
    except TypeError:  # a naive time from a store: compare as UTC
        return bool(maybe_make_aware(recorded) - maybe_make_aware(own) > STALE_BY)


#: schedulers that keep a lock of their own: wrapping them would run two elections
_REFUSED = {
    "redbeat.schedulers.RedBeatScheduler": (
        "RedBeat takes a lock of its own in Redis, and exits when it loses it: wrapping it would run two "
        "elections that can disagree. Use celery_etcdlock.beat:LeaderScheduler (its schedule in etcd), or "
        "RedBeat alone"
    ),
}


def leader_only(scheduler_class: type[Any]) -> type[Any]:
    """A leader-only subclass of ``scheduler_class`` (a ``celery.beat.Scheduler`` subclass).

        LeaderPersistentScheduler = leader_only(celery.beat.PersistentScheduler)

    Raises ``TypeError`` at once for what cannot be wrapped: a non-Scheduler,
    ``LeaderScheduler`` or anything already leader-only, and RedBeat.
    """
    if not isinstance(scheduler_class, type) or not issubclass(scheduler_class, Scheduler):
        raise TypeError(f"leader_only() takes a celery.beat.Scheduler subclass, not {scheduler_class!r}")
    if issubclass(scheduler_class, LeaderMixin):
        raise TypeError(
            f"{scheduler_class.__module__}.{scheduler_class.__qualname__} is leader-only already: use it as it is"
        )
    for klass in scheduler_class.__mro__:
        why = _REFUSED.get(f"{klass.__module__}.{klass.__qualname__}")
        if why:
            raise TypeError(f"leader_only() does not wrap {scheduler_class.__qualname__}: {why}")
    hooks = hooks_for(scheduler_class)
    bases: tuple[type[Any], ...] = (*hooks, LeaderMixin, scheduler_class)
    name = f"Leader{scheduler_class.__name__}"
    return type(name, bases, {"__module__": scheduler_class.__module__, "__qualname__": name})


__all__ = ["HEADER", "LeaderMixin", "beat_name", "leader_only"]
