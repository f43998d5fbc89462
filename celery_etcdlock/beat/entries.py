"""``LeaderSchedulerEntry``: periodic tasks added, changed and removed while beat runs (RedBeat's entry API).

    from celery.schedules import crontab
    from celery_etcdlock.beat import LeaderSchedulerEntry

    entry = LeaderSchedulerEntry("report-42", "reports.send", crontab(hour=7, minute=0), args=(42,), app=app)
    entry.save()                                    # the beat leader sends it from within a second
    entry = LeaderSchedulerEntry.load("report-42", app=app)     # KeyError if there is none
    entry.enabled = False; entry.save()             # kept, not sent
    entry.delete()
    [e.name for e in LeaderSchedulerEntry.all(app=app)]

Each entry is one JSON document (never pickle) at
``records/beat-entries/<beat>/<entry>`` under the app's prefix, ``<beat>`` being the
``etcdlock_beat_name`` of the app's beat. The leader watches them (``runtime.py``) and
records each run at ``records/beat-runs/<beat>/<entry>``, fenced by its election, before it
sends it, exactly as it does for static entries.

Decisions (docs/beat.md says the same):

- **A name of a static** ``beat_schedule`` **entry is refused** by ``save()``: the static
  schedule, in code, stays what it says.
- **Saving again updates** the entry and **keeps its last run**, whatever changed: the next
  run is the new schedule's next after the last one (so changing only the arguments never
  sends an extra run). ``delete()`` forgets the last run too.
- **Concurrent saves: last write wins.** A save is a compare-and-swap on the version it
  read, tried again on a conflict, so no save is half-applied and the entry always is
  exactly one client's whole document (it keeps its ``created_at``).
- **Size:** an entry's JSON is at most ``MAX_ENTRY_BYTES`` (16 KiB); keep big payloads in
  your database and pass their id.
- A new entry's first run is one interval (or the schedule's next time) after it was first
  saved, as a static entry's is after beat starts; an imported one continues from its
  recorded last run.
"""

from __future__ import annotations

import json
import logging
import math
from datetime import datetime, timedelta, timezone
from typing import Any

import tenacity
from celery.schedules import crontab, schedule, solar

from ..etcd.base import Record
from ..keys import decode_name, encode_name, record_prefix
from ..locks.client import Client
from ..settings import Settings, client_for

logger = logging.getLogger(__name__)

ENTRIES_KIND = "beat-entries"
RUNS_KIND = "beat-runs"
ENTRY_FORMAT = 1
#: the largest JSON document one entry may be, in bytes (etcd takes 1.5 MiB, but the leader reads them all)
MAX_ENTRY_BYTES = 16 * 1024
#: compare-and-swap attempts of one save before it gives up (each conflict is another client's save)
SAVE_ATTEMPTS = 10

_CRON_FIELDS = ("minute", "hour", "day_of_week", "day_of_month", "month_of_year")

save_policy = tenacity.Retrying(
    retry=tenacity.retry_if_result(lambda written: written is None),
    stop=tenacity.stop_after_attempt(SAVE_ATTEMPTS),
    wait=tenacity.wait_random(0, 0.05),
    retry_error_callback=lambda state: None,
    reraise=True,
)


def beat_of(app: Any) -> str:
    """The beat name whose runtime entries ``app`` reads and writes (``etcdlock_beat_name``)."""
    if app is None:
        raise TypeError("app is required: it says which beat the entry belongs to (etcdlock_beat_name)")
    return Settings.from_app(app).beat_name


def entries_prefix(beat: str) -> str:
    return record_prefix(ENTRIES_KIND, beat)


def runs_prefix(beat: str) -> str:
    return record_prefix(RUNS_KIND, beat)


def entry_key(beat: str, name: str) -> str:
    return f"{entries_prefix(beat)}/{encode_name(name)}"


def run_key(beat: str, name: str) -> str:
    return f"{runs_prefix(beat)}/{encode_name(name)}"


def name_of(key: str) -> str:
    """The entry name of an entry's or run record's key."""
    return decode_name(key.rsplit("/", 1)[-1])


def encode_time(value: datetime) -> str:
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return value.astimezone(timezone.utc).isoformat()


def decode_time(value: object, field: str) -> datetime:
    if not isinstance(value, str):
        raise ValueError(f"{field} must be an ISO 8601 time, not {value!r}")
    moment = datetime.fromisoformat(value)
    if moment.tzinfo is None:
        raise ValueError(f"{field} has no time zone: {value!r}")
    return moment


# -- schedules as JSON ----------------------------------------------------------------------------


def _cron_field(value: object, field: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, (set, frozenset, list, tuple, range)) and all(isinstance(v, int) for v in value):
        return ",".join(str(v) for v in sorted(value))
    raise TypeError(f"schedule: crontab {field} must be a str, an int or a set of ints, not {value!r}")


def encode_schedule(value: object) -> dict[str, Any]:
    """``value`` (seconds, a ``timedelta``, or celery's ``schedule`` / ``crontab`` / ``solar``) as JSON."""
    if isinstance(value, crontab):
        return {"type": "crontab", **{f: _cron_field(getattr(value, f"_orig_{f}"), f) for f in _CRON_FIELDS}}
    if isinstance(value, solar):
        return {"type": "solar", "event": value.event, "lat": float(value.lat), "lon": float(value.lon)}
    if isinstance(value, schedule) and type(value) is schedule:  # a subclass may behave otherwise: refused below
        value = value.run_every
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            "schedule must be a number of seconds, a timedelta, or celery's schedule, crontab or solar, "
            f"not {type(value).__name__}"
        )
    seconds = float(value)
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"schedule: an interval must be a positive, finite number of seconds, not {value!r}")
    return {"type": "interval", "seconds": seconds}


def decode_schedule(value: object, app: Any = None) -> schedule:
    """The celery schedule of a stored JSON schedule; ``ValueError`` naming what is wrong."""
    if not isinstance(value, dict):
        raise ValueError(f"schedule must be an object, not {value!r}")
    kind = value.get("type")
    try:
        if kind == "interval":
            seconds = value["seconds"]
            encode_schedule(seconds)  # the same checks as at save()
            return schedule(timedelta(seconds=seconds), app=app)
        if kind == "crontab":
            fields = {f: value.get(f, "*") for f in _CRON_FIELDS}
            if not all(isinstance(v, str) for v in fields.values()):
                raise ValueError(f"crontab fields must be strings: {fields!r}")
            return crontab(**fields, app=app)
        if kind == "solar":
            return solar(value["event"], value["lat"], value["lon"], app=app)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"schedule {value!r}: {exc}") from None
    raise ValueError(f"schedule: unknown type {kind!r} (interval, crontab or solar)")


def describe_schedule(value: dict[str, Any]) -> str:
    """A short human form of a stored schedule, for tables: ``every 30s``, ``cron 0 7 * * *``, ``solar sunset``."""
    kind = value.get("type")
    if kind == "interval":
        seconds = float(value.get("seconds", 0))
        return f"every {seconds:g}s"
    if kind == "crontab":
        order = ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")
        return "cron " + " ".join(str(value.get(f, "*")) for f in order)
    if kind == "solar":
        return f"solar {value.get('event')} ({value.get('lat')}, {value.get('lon')})"
    return str(kind)


def _json_field(value: object, field: str) -> Any:
    """``value`` as JSON holds it (tuples become lists), or ``TypeError`` / ``ValueError`` naming ``field``."""
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except TypeError as exc:
        raise TypeError(f"{field}: JSON cannot hold it ({exc})") from None
    except ValueError as exc:
        raise ValueError(f"{field}: JSON cannot hold it ({exc})") from None


def _text(value: object, field: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{field} must be a str, not {type(value).__name__}")
    if not value.strip():
        raise ValueError(f"{field} must be a non-empty string")
    return value


# -- the entry ---------------------------------------------------------------------------------------


class LeaderSchedulerEntry:
    """A runtime schedule entry of a ``LeaderScheduler`` beat, kept in etcd (see the module's docstring).

    ``app`` says which etcd (``etcdlock_url``, ``etcdlock_prefix``) and which beat
    (``etcdlock_beat_name``); ``client`` (optional) replaces the app's client.
    ``last_run_at`` and ``total_run_count`` are what the leader recorded (read by
    ``load()`` and ``all()``; ``last_run_at`` given to a new entry is where its schedule
    starts from, as the RedBeat importer does).
    """

    def __init__(
        self,
        name: str,
        task: str,
        schedule: Any,
        args: Any = (),
        kwargs: Any = None,
        options: Any = None,
        enabled: bool = True,
        app: Any = None,
        *,
        client: Client | None = None,
        last_run_at: datetime | None = None,
        total_run_count: int = 0,
    ) -> None:
        self.name = name
        self.task = task
        self.schedule = schedule
        self.args = args
        self.kwargs = {} if kwargs is None else kwargs
        self.options = {} if options is None else options
        self.enabled = enabled
        self.app = app
        self.last_run_at = last_run_at
        self.total_run_count = total_run_count
        self._client = client
        self._record: Record | None = None  # the document as last read or written

    def __repr__(self) -> str:
        return (
            f"<LeaderSchedulerEntry {self.name!r} {self.task} {self.schedule!r}{'' if self.enabled else ' disabled'}>"
        )

    # -- JSON -------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The stored document (without ``created_at`` / ``saved_at``), checked: errors name the field."""
        name = _text(self.name, "name")
        document: dict[str, Any] = {
            "format": ENTRY_FORMAT,
            "name": name,
            "task": _text(self.task, "task"),
            "schedule": encode_schedule(self.schedule),
        }
        if isinstance(self.args, (str, bytes, dict)) or not isinstance(self.args, (list, tuple)):
            raise TypeError(f"args must be a list or tuple, not {type(self.args).__name__}")
        document["args"] = _json_field(list(self.args), "args")
        for field in ("kwargs", "options"):
            value = getattr(self, field)
            if not isinstance(value, dict):
                raise TypeError(f"{field} must be a dict, not {type(value).__name__}")
            if not all(isinstance(k, str) for k in value):
                raise TypeError(f"{field}: every key must be a str")
            document[field] = _json_field(value, field)
        if not isinstance(self.enabled, bool):
            raise TypeError(f"enabled must be a bool, not {type(self.enabled).__name__}")
        document["enabled"] = self.enabled
        if self.last_run_at is not None:
            if not isinstance(self.last_run_at, datetime):
                raise TypeError(f"last_run_at must be a datetime, not {type(self.last_run_at).__name__}")
            document["last_run_at"] = encode_time(self.last_run_at)
        return document

    @classmethod
    def from_json(cls, document: dict[str, Any], app: Any = None, client: Client | None = None) -> LeaderSchedulerEntry:
        """An entry from its stored document; ``ValueError`` naming what is unusable."""
        try:
            last = document.get("last_run_at")
            return cls(
                name=_text(document.get("name"), "name"),
                task=_text(document.get("task"), "task"),
                schedule=decode_schedule(document.get("schedule"), app),
                args=list(document.get("args") or ()),
                kwargs=dict(document.get("kwargs") or {}),
                options=dict(document.get("options") or {}),
                enabled=bool(document.get("enabled", True)),
                app=app,
                client=client,
                last_run_at=None if last is None else decode_time(last, "last_run_at"),
            )
        except TypeError as exc:
            raise ValueError(str(exc)) from None

    # -- etcd ---------------------------------------------------------------

    @staticmethod
    def _client_of(app: Any, client: Client | None) -> Client:
        if client is not None:
            return client
        return client_for(app)

    def _checked_document(self) -> dict[str, Any]:
        document = self.to_json()
        if self.app is not None:
            static = self.app.conf.beat_schedule or {}
            if self.name in static:
                raise ValueError(
                    f"name: {self.name!r} is an entry of the app's beat_schedule; a runtime entry may not replace it"
                )
        size = len(json.dumps({**document, "created_at": "x" * 32, "saved_at": "x" * 32}).encode("utf-8"))
        if size > MAX_ENTRY_BYTES:
            raise ValueError(
                f"entry {self.name!r} is {size} bytes of JSON, over the {MAX_ENTRY_BYTES} allowed: "
                "keep large data elsewhere and pass its id in args"
            )
        return document

    def save(self) -> LeaderSchedulerEntry:
        """Create or replace the entry (last write wins); the leader applies it within a second."""
        document = self._checked_document()
        key = entry_key(beat_of(self.app), self.name)
        client = self._client_of(self.app, self._client)
        backend = client.backend

        def attempt() -> Record | None:
            current = backend.get_record(key)
            now = encode_time(datetime.now(timezone.utc))
            created = current.value.get("created_at") if current is not None else None
            return backend.put_record(key, {**document, "created_at": created or now, "saved_at": now}, expect=current)

        written = save_policy.copy()(attempt)
        if written is None:
            raise RuntimeError(
                f"could not save entry {self.name!r}: it changed {SAVE_ATTEMPTS} times while saving; try again"
            )
        self._record = written
        return self

    def delete(self) -> bool:
        """Remove the entry and its last run; False if there was none. The leader stops sending it within a second."""
        beat = beat_of(self.app)
        client = self._client_of(self.app, self._client)
        deleted = client.backend.delete_record(entry_key(beat, self.name))
        client.backend.delete_record(run_key(beat, self.name))
        self._record = None
        return deleted

    @property
    def created_at(self) -> str | None:
        return None if self._record is None else self._record.value.get("created_at")

    @property
    def saved_at(self) -> str | None:
        return None if self._record is None else self._record.value.get("saved_at")

    def _adopt_run(self, run: Record | None) -> None:
        if run is None:
            return
        try:
            self.last_run_at = decode_time(run.value.get("last_run_at"), "last_run_at")
        except ValueError:
            return
        count = run.value.get("total_run_count", 0)
        self.total_run_count = count if isinstance(count, int) and not isinstance(count, bool) else 0

    @classmethod
    def load(cls, name: str, app: Any = None, *, client: Client | None = None) -> LeaderSchedulerEntry:
        """The entry ``name`` with its last run; ``KeyError`` if there is none."""
        beat = beat_of(app)
        client = cls._client_of(app, client)
        record = client.backend.get_record(entry_key(beat, _text(name, "name")))
        if record is None:
            raise KeyError(name)
        entry = cls.from_json(record.value, app=app, client=client)
        entry._record = record
        entry._adopt_run(client.backend.get_record(run_key(beat, name)))
        return entry

    @classmethod
    def all(cls, app: Any = None, *, client: Client | None = None) -> list[LeaderSchedulerEntry]:
        """Every runtime entry of the app's beat, by name, with its last run (two requests)."""
        beat = beat_of(app)
        client = cls._client_of(app, client)
        runs = {name_of(key): run for key, run in client.backend.read_records(runs_prefix(beat)).records.items()}
        entries = []
        for key, record in client.backend.read_records(entries_prefix(beat)).records.items():
            try:
                entry = cls.from_json(record.value, app=app, client=client)
            except ValueError as exc:
                logger.warning("beat %s: ignoring unusable runtime entry %s: %s", beat, key, exc)
                continue
            entry._record = record
            entry._adopt_run(runs.get(entry.name))
            entries.append(entry)
        return sorted(entries, key=lambda e: e.name)
