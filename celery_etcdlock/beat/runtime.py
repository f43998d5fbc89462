"""The beat leader's runtime entries: watched in etcd, applied within a second, each run fenced before it is sent.

    runtime = RuntimeEntries(client, app, beat="proj", identity="host:42", make_entry=scheduler.Entry)
    runtime.take_over(scheduler.schedule)        # leading: read the entries and their runs, add them, watch
    if runtime.apply(scheduler.schedule): ...    # each tick: what the watch saw (no etcd request)
    runtime.owns("report-42")                    # a runtime entry (not a static one)?
    runtime.record_run(reserved, election, token)   # before sending: True to send
    runtime.stop(scheduler.schedule)             # stepping down: take them out, stop watching

What it costs: two reads at take-over (the entries, their runs), one watch
of the entries' prefix for as long as it leads (one request per
``WATCH_TIMEOUT`` while nothing changes, whatever the number of entries),
one read of a run record when an entry is added, and one fenced write per
run sent (two on a conflict).

A run is recorded at ``records/beat-runs/<beat>/<entry>`` by a
compare-and-swap on the version this leader last saw, fenced by its
election entry (v3; in v2 the compare on the version is what stops a
second writer). A failed write whose record did not change was refused by
the fence: ``FenceLost``, the scheduler steps down. One whose record
changed (another writer got there first) is not sent; the record's run is
adopted at the next ``apply()``, so the entry is not sent twice.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import datetime
from typing import Any

from ..errors import EtcdLockError
from ..etcd.base import Record, WaitResult
from ..locks.client import Client
from ..locks.store import FenceLost
from .entries import (
    LeaderSchedulerEntry,
    decode_time,
    encode_time,
    entries_prefix,
    name_of,
    run_key,
    runs_prefix,
)

logger = logging.getLogger(__name__)

#: the longest one watch request waits while nothing changes (then another starts, from the same revision)
WATCH_TIMEOUT = 10.0
#: the longest a leading beat's tick sleeps, so that a change is applied within it (no etcd request involved)
APPLY_WITHIN = 1.0
#: how long the watcher waits before reading again after etcd failed it
RETRY_AFTER = 1.0


class RuntimeEntries:
    """The runtime entries of beat ``beat`` while this process leads it (see the module's docstring)."""

    def __init__(self, client: Client, app: Any, beat: str, identity: str, make_entry: Callable[..., Any]) -> None:
        self.client = client
        self.app = app
        self.beat = beat
        self.identity = identity
        self._make_entry = make_entry
        self._prefix = entries_prefix(beat)
        self._lock = threading.Lock()
        self._generation = 0  # a watcher of an earlier leadership ends when it sees this change
        self._stopped = threading.Event()
        self._pending: dict[str, Record | None] = {}  # entry key -> its latest document (None: deleted)
        self._complete = False  # _pending is every entry: names not in it were deleted
        self._names: set[str] = set()  # the runtime entries now in the schedule
        self._static: set[str] = set()  # the static entries' names: a runtime namesake is ignored
        self._refused: dict[str, int] = {}  # name -> the version refused (logged once per version)
        self._runs: dict[str, Record | None] = {}  # name -> its run record as this leader last saw it
        self._adopt: set[str] = set()  # names whose run another writer recorded: adopt it at the next apply

    # -- leadership ---------------------------------------------------------------------------------

    def take_over(self, schedule: dict[str, Any]) -> None:
        """Add every enabled runtime entry to ``schedule`` with its recorded run; watch for changes."""
        self.stop(schedule)
        backend = self.client.backend
        self._static = set(schedule)
        runs = backend.read_records(runs_prefix(self.beat))
        entries = backend.read_records(self._prefix)
        self._runs = {name_of(key): record for key, record in runs.records.items()}
        for key in entries.records:  # an entry without a run record has none: not worth a read each
            self._runs.setdefault(name_of(key), None)
        with self._lock:
            self._generation += 1
            generation = self._generation
            self._pending, self._complete = dict(entries.records), True
        self._stopped.clear()
        self.apply(schedule)
        threading.Thread(
            target=self._watch,
            args=(generation, entries.revision),
            name="etcdlock-beat-entries",
            daemon=True,
        ).start()
        if self._names:
            logger.info("beat %s: sending %d runtime entries of beat/%s", self.identity, len(self._names), self.beat)

    def stop(self, schedule: dict[str, Any]) -> None:
        """Take the runtime entries out of ``schedule`` and stop watching (no etcd request)."""
        with self._lock:
            self._generation += 1
            self._pending, self._complete = {}, False
        self._stopped.set()
        for name in self._names:
            schedule.pop(name, None)
        self._names = set()
        self._runs = {}
        self._adopt = set()

    def close(self) -> None:
        """Stop watching (safe in a signal handler: no lock, no request)."""
        self._stopped.set()

    def owns(self, name: str) -> bool:
        return name in self._names

    # -- the watch (its own thread) -------------------------------------------------------------------

    def _watch(self, generation: int, revision: int | None) -> None:
        """Follow the entries from ``revision`` (None: read them all first) until the leadership ends."""
        backend = self.client.backend
        while not self._stopped.is_set() and self._generation == generation:
            try:
                if revision is None:
                    snapshot = backend.read_records(self._prefix)
                    with self._lock:
                        if self._generation == generation:
                            self._pending, self._complete = dict(snapshot.records), True
                    revision = snapshot.revision
                    continue
                result = backend.watch_records(self._prefix, revision, WATCH_TIMEOUT)
                if result is WaitResult.STALE:
                    revision = None
                elif isinstance(result, list):
                    with self._lock:
                        if self._generation == generation:
                            for change in result:
                                self._pending[change.key] = change.record
                    revision = max(revision, *(change.revision for change in result))
            except EtcdLockError as exc:
                logger.warning(
                    "beat %s: watching the runtime entries of beat/%s failed (%s); reading them again",
                    self.identity,
                    self.beat,
                    exc,
                )
                if self._stopped.wait(RETRY_AFTER):
                    return
                revision = None

    # -- applying changes (the beat's thread) ---------------------------------------------------------

    def apply(self, schedule: dict[str, Any]) -> bool:
        """Bring ``schedule`` up to date with what the watch saw; True if it changed."""
        with self._lock:
            pending, self._pending = self._pending, {}
            complete, self._complete = self._complete, False
        changed = False
        if complete:
            present = {name_of(key) for key in pending}
            for name in self._names - present:
                changed |= self._remove(schedule, name, deleted=True)
        for key, record in pending.items():
            name = name_of(key)
            if record is None:
                changed |= self._remove(schedule, name, deleted=True)
                continue
            try:
                changed |= self._put(schedule, name, record)
            except EtcdLockError as exc:  # reading its run failed: try it again at the next tick
                logger.warning("beat %s: runtime entry %s not applied yet (%s)", self.identity, name, exc)
                with self._lock:
                    self._pending.setdefault(key, record)
        for name in self._adopt:
            if name in self._names and self._adopt_run(schedule[name], self._runs.get(name)):
                changed = True
        self._adopt = set()
        return changed

    def _remove(self, schedule: dict[str, Any], name: str, deleted: bool) -> bool:
        if deleted:
            self._runs.pop(name, None)  # delete() removed the run too; a new namesake starts afresh
        if name not in self._names:
            return False
        self._names.discard(name)
        schedule.pop(name, None)
        logger.info("beat %s: runtime entry %s %s", self.identity, name, "deleted" if deleted else "disabled")
        return True

    def _refuse(self, name: str, record: Record, why: str) -> None:
        if self._refused.get(name) != record.version:
            self._refused[name] = record.version
            logger.warning("beat %s: not sending runtime entry %s: %s", self.identity, name, why)

    def _put(self, schedule: dict[str, Any], name: str, record: Record) -> bool:
        if name in self._static:
            self._refuse(name, record, "a static entry of beat_schedule has that name")
            return False
        try:
            entry = LeaderSchedulerEntry.from_json(record.value, app=self.app)
        except ValueError as exc:
            self._refuse(name, record, f"unusable ({exc})")
            return self._remove(schedule, name, deleted=False)
        if not entry.enabled:
            return self._remove(schedule, name, deleted=False)
        previous = schedule.get(name) if name in self._names else None
        if previous is not None:  # an update keeps the last run, whatever changed
            last_run_at, count = previous.last_run_at, previous.total_run_count
        else:
            last_run_at, count = self._start_of(name, record, entry)
        schedule[name] = self._make_entry(
            name=name,
            task=entry.task,
            schedule=entry.schedule,
            args=tuple(entry.args),
            kwargs=entry.kwargs,
            options=entry.options,
            last_run_at=last_run_at,
            total_run_count=count,
            app=self.app,
        )
        self._names.add(name)
        self._refused.pop(name, None)
        logger.info("beat %s: runtime entry %s %s", self.identity, name, "updated" if previous else "added")
        return True

    def _start_of(self, name: str, record: Record, entry: LeaderSchedulerEntry) -> tuple[datetime, int]:
        """Where a newly seen entry's schedule continues from: its recorded run, else its start, else its creation."""
        if name not in self._runs:
            self._runs[name] = self.client.backend.get_record(run_key(self.beat, name))
        run = _decode_run(self._runs[name])
        if run is not None:
            return run[0].astimezone(self.app.timezone), run[1]
        start = entry.last_run_at
        if start is None:
            try:
                start = decode_time(record.value.get("created_at"), "created_at")
            except ValueError:
                start = self.app.now()
        return start.astimezone(self.app.timezone), 0

    def _adopt_run(self, scheduled: Any, run: Record | None) -> bool:
        decoded = _decode_run(run)
        if decoded is None:
            return False
        scheduled.last_run_at, scheduled.total_run_count = decoded[0].astimezone(self.app.timezone), decoded[1]
        return True

    # -- recording a run ------------------------------------------------------------------------------

    def record_run(self, entry: Any, fence: Any, token: int | None) -> bool:
        """Record ``entry``'s run (``entry`` as reserved: its new last run), fenced. True if it may be sent.

        Raises ``FenceLost`` when the fence refused the write, ``BackendError`` when etcd failed.
        """
        fence_entry = fence.fence_entry
        if fence_entry is None:
            raise FenceLost(f"cannot record the run of {entry.name}: the fence is not held")
        name, backend = entry.name, self.client.backend
        key = run_key(self.beat, name)
        if name not in self._runs:
            self._runs[name] = backend.get_record(key)
        expect = self._runs[name]
        document = {
            "last_run_at": encode_time(entry.last_run_at),
            "total_run_count": entry.total_run_count,
            "leader": self.identity,
            "token": token,
        }
        written = backend.put_record(key, document, expect=expect, fence=fence_entry)
        if written is not None:
            self._runs[name] = written
            return True
        current = backend.get_record(key)
        if (current.version if current else None) == (expect.version if expect else None):
            raise FenceLost(f"the run of {name} was refused by the fence (token {token})")
        logger.info(
            "beat %s: not sending %s: its run was recorded by %s meanwhile",
            self.identity,
            name,
            current.value.get("leader") if current is not None else "a delete",
        )
        self._runs[name] = current
        self._adopt.add(name)
        return False


def _decode_run(run: Record | None) -> tuple[datetime, int] | None:
    if run is None:
        return None
    try:
        last_run_at = decode_time(run.value.get("last_run_at"), "last_run_at")
    except ValueError:
        return None
    count = run.value.get("total_run_count", 0)
    return last_run_at, count if isinstance(count, int) and not isinstance(count, bool) and count >= 0 else 0
