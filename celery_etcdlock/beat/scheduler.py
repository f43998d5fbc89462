"""``LeaderScheduler``: celery beat on every host, only the elected leader sends.

    celery -A proj beat -S celery_etcdlock.beat:LeaderScheduler
    # or: app.conf.beat_scheduler = "celery_etcdlock.beat:LeaderScheduler"

Every beat process campaigns in the election ``beat/<name>`` (``name`` is the
``etcdlock_beat_name`` setting, else the app's main module name) with the
identity ``host:pid`` and the TTL ``etcdlock_beat_ttl``. The leader sends the
app's ``beat_schedule`` (interval, crontab and solar entries, with their args,
kwargs and options); the others stand by: they neither read nor write the
schedule, and make no etcd request of their own (the election watches the
leader's entry and wakes them when they are elected).

The schedule's state, each entry's last run time and run count, is one JSON
document in etcd (``DocumentStore(client, "beat-state")``, named like the
election), so a new leader continues where the old one stopped.

What it guarantees (no run sent twice, a missed run sent once, at most
once, fail closed), and why, is in docs/beat.md.

Losing leadership is not fatal: the scheduler stops sending at once, logs it
and campaigns again. ``close()`` (celery beat calls it on SIGTERM and Ctrl-C)
resigns, so a follower takes over at once.

Static schedule changes take effect when a leader takes over with the new
configuration: it keeps the state of entries it knows by name, starts new ones
as if beat had just started, and drops the state of removed entries. Only the
leader ever writes the document.
"""

from __future__ import annotations

import os
import socket
import threading
from datetime import datetime, timezone
from typing import Any

from celery.beat import ScheduleEntry, Scheduler
from celery.utils.log import get_logger
from celery.utils.time import maybe_make_aware

from .. import observe
from ..errors import BackendError
from ..etcd.base import Record
from ..locks.client import Client
from ..locks.election import Election
from ..locks.store import DocumentStore, FenceLost
from ..settings import Settings, client_for, enable_metrics

logger = get_logger(__name__)

STATE_KIND = "beat-state"
STATE_FORMAT = 1

#: the longest a follower's tick waits for an "elected" event before it looks
#: at its (local) ``is_leader`` flag again; no etcd request is involved
FOLLOWER_WAKEUP = 1.0
#: how long to wait before trying again after etcd failed us
RETRY_AFTER = 1.0
#: compare-and-swap attempts of a take-over before it waits for the next tick
TAKE_OVER_ATTEMPTS = 5


def beat_name(app: Any) -> str:
    """The name of the election and of the state document of ``app``'s beat."""
    name = Settings.from_app(app).beat_name
    if not name:
        raise ValueError(f"etcdlock_beat_name must be a non-empty string, not {name!r}")
    return name


def encode_time(value: datetime) -> str:
    return maybe_make_aware(value).astimezone(timezone.utc).isoformat()


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def decode_state(name: str, state: object, tz: Any) -> tuple[datetime, int] | None:
    """One entry's (last_run_at, total_run_count) as stored, or None if unusable."""
    try:
        if not isinstance(state, dict):
            raise TypeError("not an object")
        last_run_at = datetime.fromisoformat(state["last_run_at"])
        if last_run_at.tzinfo is None:
            raise ValueError("last_run_at has no time zone")
        count = state.get("total_run_count", 0)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"bad total_run_count {count!r}")
        return last_run_at.astimezone(tz), count
    except (KeyError, TypeError, ValueError) as exc:
        logger.warning("beat: ignoring unusable stored state of entry %r (%s): %r", name, exc, state)
        return None


class LeaderScheduler(Scheduler):
    """A celery beat scheduler that sends only while elected leader.

    ``etcd_client`` (optional) replaces the client the app's settings name;
    ``identity`` (optional) replaces ``host:pid`` in the election.
    """

    #: the schedule state is written with every run, so there is nothing to sync
    sync_every = float("inf")
    #: only the elected leader sends (settings.py warns at a beat's start when its scheduler does not)
    elects_a_leader = True

    def __init__(
        self,
        app: Any,
        *args: Any,
        etcd_client: Client | None = None,
        identity: str | None = None,
        **kwargs: Any,
    ) -> None:
        settings = Settings.from_app(app)
        enable_metrics(app)
        self.beat_ttl = settings.beat_ttl
        self.name = beat_name(app)
        self.identity = identity or f"{socket.gethostname()}:{os.getpid()}"
        self._etcd_client = etcd_client
        self._election: Election | None = None
        self._store: DocumentStore | None = None
        self._events_thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._closed = False
        self._in_etcd = False  # a signal handler calling close() must not reenter the client
        self._state: Record | None = None  # the state document as this leader last read or wrote it
        self._leading_token: int | None = None  # the election token this process took over with
        super().__init__(app, *args, **kwargs)

    # -- what celery beat calls -----------------------------------------------

    @property
    def info(self) -> str:
        return f"    . etcd election -> beat/{self.name} as {self.identity}, ttl {self.beat_ttl:g}s"

    def setup_schedule(self) -> None:
        # Only the local copy of the static schedule: the stored state is
        # merged in when this process takes over, and campaigning starts on
        # the first tick (celery builds a second, lazy scheduler for its banner).
        self.install_default_entries(self.data)
        self.merge_inplace(self.app.conf.beat_schedule)

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
        return float(super().tick(*args, **kwargs))

    def apply_entry(self, entry: ScheduleEntry, producer: Any = None) -> None:
        reserved = self.schedule.get(entry.name)
        if reserved is None or reserved is entry:  # not reserved by tick(): do it here
            reserved = self.reserve(entry)
        if self._record_run(reserved):
            super().apply_entry(entry, producer=producer)
        else:
            self.schedule[entry.name] = entry  # not sent: do not pretend it ran

    def apply_async(self, entry: ScheduleEntry, producer: Any = None, advance: bool = True, **kwargs: Any) -> Any:
        if advance and not self._record_run(self.reserve(entry)):
            self.schedule[entry.name] = entry  # not recorded: not run
            return None
        if not self.is_leader:
            logger.warning("beat %s: not sending %s: no longer the leader", self.identity, entry.name)
            return None
        result = super().apply_async(entry, producer=producer, advance=False, **kwargs)
        if observe.listening():
            observe.report(observe.Event(observe.BEAT_SENT, name=self.name, data={"entry": entry.name}))
        return result

    def sync(self) -> None:
        pass  # every run is already in etcd

    def close(self) -> None:
        """Stop sending, and resign if leading so that a follower takes over at once."""
        self._closed = True
        self._wake.set()
        try:
            super().close()
        finally:
            # From a signal handler in the middle of an etcd call, leave the
            # client alone: celery calls close() again once the stack unwound.
            if not self._in_etcd:
                self._resign()

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

    # -- leadership -------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        """True while this process leads and has taken over the schedule's state."""
        election = self._election
        return (
            not self._closed
            and election is not None
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
            self._store = DocumentStore(client, STATE_KIND)
            self._election = Election(client, f"beat/{self.name}", identity=self.identity, ttl=self.beat_ttl)
            self._election.start()
            self._events_thread = threading.Thread(
                target=self._follow_events, args=(self._election,), name="etcdlock-beat-events", daemon=True
            )
            self._events_thread.start()
            logger.info("beat %s: campaigning for beat/%s (ttl %gs)", self.identity, self.name, self.beat_ttl)
        return self._election

    def _follow_events(self, election: Election) -> None:
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
                logger.warning(
                    "beat %s: election beat/%s: %s", self.identity, self.name, getattr(event, "error", event)
                )
            self._wake.set()

    def _stand_by(self, election: Election) -> float:
        # Sleep here rather than in celery's loop, so that an "elected" event
        # wakes us at once. Nothing here talks to etcd.
        self._wake.clear()
        if not election.is_leader and not self._closed:
            self._wake.wait(min(FOLLOWER_WAKEUP, self.max_interval))
        return 0.0

    def _step_down(self, why: str) -> None:
        if self._leading_token is not None:
            logger.warning("beat %s: stopped sending (token %s): %s", self.identity, self._leading_token, why)
        self._leading_token = None
        self._state = None
        self._heap = None

    def _take_over(self, election: Election) -> bool:
        """Read the stored state, record our token in it, and adopt it. False if we did not."""
        assert self._store is not None
        token = election.token
        for _attempt in range(TAKE_OVER_ATTEMPTS):
            if token is None or not election.is_leader or token != election.token:
                return False
            try:
                self._in_etcd = True
                try:
                    stored = self._store.get(self.name)
                    previous = stored.value if stored is not None else {}
                    stored_token = previous.get("token")
                    if isinstance(stored_token, int) and stored_token > token:
                        # A later leader's token, or a state copied from another cluster (tokens are revisions
                        # of the cluster that wrote them). Not a reason to stand down: the compare-and-swap on
                        # the version below is what keeps two leaders from both recording a run.
                        logger.warning(
                            "beat %s: beat/%s was last written by %s with token %s > ours %s",
                            self.identity,
                            self.name,
                            previous.get("leader"),
                            stored_token,
                            token,
                        )
                    document, adopted = self._merged_state(previous, token)
                    written = self._store.put(self.name, document, expect=stored, fence=election)
                finally:
                    self._in_etcd = False
            except FenceLost:
                return False
            except BackendError as exc:
                logger.warning("beat %s: could not take over beat/%s (%s); not sending", self.identity, self.name, exc)
                return False
            if written is None:
                continue  # the document changed since we read it: read it again
            for name, (last_run_at, count) in adopted.items():
                entry = self.schedule[name]
                entry.last_run_at, entry.total_run_count = last_run_at, count
            self._state = written
            self._leading_token = token
            self._heap = None  # recompute every entry's next run from the adopted state
            logger.info(
                "beat %s: leading beat/%s with token %s (previous leader %s, token %s); sending %d entries",
                self.identity,
                self.name,
                token,
                previous.get("leader"),
                previous.get("token"),
                len(self.schedule),
            )
            return True
        logger.warning(
            "beat %s: the state of beat/%s kept changing during take-over; trying again", self.identity, self.name
        )
        return False

    def _merged_state(
        self, previous: dict[str, Any], token: int
    ) -> tuple[dict[str, Any], dict[str, tuple[datetime, int]]]:
        stored_entries = previous.get("entries")
        if not isinstance(stored_entries, dict):
            stored_entries = {}
        tz = self.app.timezone
        now = self.app.now()
        adopted: dict[str, tuple[datetime, int]] = {}
        for name in self.schedule:
            state = decode_state(name, stored_entries[name], tz) if name in stored_entries else None
            adopted[name] = state if state is not None else (now, 0)  # new: as if beat just started
        removed = sorted(set(stored_entries) - set(self.schedule))
        if removed:
            logger.info(
                "beat %s: dropping the state of entries no longer scheduled: %s", self.identity, ", ".join(removed)
            )
        document = {
            "format": STATE_FORMAT,
            "leader": self.identity,
            "token": token,
            "since": encode_time(now),
            "changes": _count(previous.get("changes")) + (previous.get("leader") != self.identity),
            "entries": {
                name: {"last_run_at": encode_time(last), "total_run_count": count}
                for name, (last, count) in adopted.items()
            },
        }
        return document, adopted

    def _record_run(self, entry: ScheduleEntry) -> bool:
        """Record ``entry``'s run in etcd, fenced by the election. True if it may be sent now."""
        election = self._election
        if not self.is_leader or election is None or self._store is None or self._state is None:
            return False
        document = dict(self._state.value)
        document["entries"] = dict(document.get("entries") or {})
        document["entries"][entry.name] = {
            "last_run_at": encode_time(entry.last_run_at),
            "total_run_count": entry.total_run_count,
        }
        try:
            self._in_etcd = True
            try:
                written = self._store.put(self.name, document, expect=self._state, fence=election)
            finally:
                self._in_etcd = False
        except FenceLost:
            written = None
        except BackendError as exc:
            logger.warning(
                "beat %s: could not record the run of %s (%s); not sending it", self.identity, entry.name, exc
            )
            self._step_down("etcd failed")
            return False
        if written is None:
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
        self._state = written
        if not self.is_leader:
            logger.warning(
                "beat %s: not sending %s: lost leadership while recording it (run %d skipped)",
                self.identity,
                entry.name,
                entry.total_run_count,
            )
            return False
        return True
