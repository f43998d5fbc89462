"""Moving from RedBeat: its entries, read from Redis, become runtime entries (``LeaderSchedulerEntry``).

    celery -A proj etcdlock schedule import-redbeat --redis-url redis://host:6379/0          # what it would do
    celery -A proj etcdlock schedule import-redbeat --redis-url redis://host:6379/0 --yes    # do it

    plan = read_redbeat(redis.Redis.from_url(url), app, key_prefix="redbeat:")
    for item in plan: print(item.name, item.action, item.reason)
    imported = apply_plan(plan)

RedBeat keeps each entry in the hash ``<prefix><name>``: its ``definition``
(name, task, schedule, args, kwargs, options, enabled) and its ``meta`` (the
last run), JSON with ``__type__`` objects for schedules and times; the sorted
set ``<prefix>:schedule`` lists every entry's key. This module reads that JSON
itself (RedBeat need not be installed) and never writes to Redis.

What is kept: the task, schedule (interval or crontab), arguments, options,
enabled, and the last run time, from which the schedule continues (an entry
RedBeat never ran starts one interval after the import). What is skipped, and
said why: RedBeat's static entries (those of the app's ``beat_schedule``, which
``LeaderScheduler`` sends as static entries), ``rrule`` schedules, and entries
whose definition cannot be read or saved.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo

from celery.schedules import crontab, schedule

from ..locks.client import Client
from .entries import LeaderSchedulerEntry

DEFAULT_KEY_PREFIX = "redbeat:"


@dataclass
class PlannedEntry:
    """One RedBeat entry and what the import does with it: ``"import"`` or ``"skip"`` (``reason`` says why)."""

    name: str
    action: str
    reason: str = ""
    entry: LeaderSchedulerEntry | None = None

    def as_dict(self) -> dict[str, Any]:
        entry = self.entry
        return {
            "name": self.name,
            "action": self.action,
            "reason": self.reason,
            "task": entry.task if entry else None,
            "last_run_at": entry.last_run_at.isoformat() if entry and entry.last_run_at else None,
        }


class _Unsupported(ValueError):
    pass


def _object(d: dict[str, Any]) -> Any:
    """RedBeat's ``__type__`` objects (its ``RedBeatJSONDecoder``), as far as runtime entries can hold them."""
    kind = d.get("__type__")
    if kind is None:
        return d
    if kind == "datetime":
        zone = d.get("timezone", "UTC")
        fields = {k: d[k] for k in ("year", "month", "day", "hour", "minute", "second", "microsecond")}
        if isinstance(zone, (int, float)):  # seconds east of UTC
            tz: Any = timezone(timedelta(seconds=zone))
        else:
            tz = timezone.utc if zone == "UTC" else ZoneInfo(str(zone))
        return datetime(tzinfo=tz, **fields)
    if kind == "interval":
        return schedule(run_every=timedelta(seconds=d["every"]), relative=bool(d.get("relative", False)))
    if kind == "crontab":
        cron = ("minute", "hour", "day_of_week", "day_of_month", "month_of_year")
        return crontab(**{f: d.get(f, "*") for f in cron})
    raise _Unsupported(f"{kind} schedules are not supported (interval and crontab are)")


def _decode(raw: bytes | str | None) -> Any:
    return None if not raw else json.loads(raw, object_hook=_object)


def read_redbeat(
    redis_client: Any, app: Any, key_prefix: str = DEFAULT_KEY_PREFIX, client: Client | None = None
) -> list[PlannedEntry]:
    """What importing RedBeat's entries under ``key_prefix`` into ``app``'s beat would do (reads Redis only)."""
    static = set(app.conf.beat_schedule or {})
    statics_key = f"{key_prefix}:statics"
    redbeat_statics = (
        {_text(k) for k in redis_client.smembers(statics_key)} if redis_client.exists(statics_key) else set()
    )
    keys = [_text(k) for k in redis_client.zrange(f"{key_prefix}:schedule", 0, -1)]
    with redis_client.pipeline() as pipe:
        for key in keys:
            pipe.hmget(key, "definition", "meta")
        found = pipe.execute()
    plan = []
    for key, (definition_raw, meta_raw) in zip(keys, found, strict=True):
        name = key[len(key_prefix) :] if key.startswith(key_prefix) else key
        plan.append(_plan(name, key, definition_raw, meta_raw, app, client, static, redbeat_statics))
    return sorted(plan, key=lambda p: p.name)


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else value


def _plan(
    name: str,
    key: str,
    definition_raw: Any,
    meta_raw: Any,
    app: Any,
    client: Client | None,
    static: set[str],
    redbeat_statics: set[str],
) -> PlannedEntry:
    try:
        definition = _decode(definition_raw)
        meta = _decode(meta_raw) or {}
    except _Unsupported as exc:
        return PlannedEntry(name, "skip", str(exc))
    except (ValueError, TypeError, KeyError) as exc:
        return PlannedEntry(name, "skip", f"unreadable definition ({exc})")
    if not isinstance(definition, dict):
        return PlannedEntry(name, "skip", "no definition")
    name = str(definition.get("name") or name)
    if name in static or key in redbeat_statics:
        return PlannedEntry(name, "skip", "static: an entry of the app's beat_schedule")
    last_run_at = meta.get("last_run_at") if isinstance(meta, dict) else None
    entry = LeaderSchedulerEntry(
        name,
        definition.get("task"),  # type: ignore[arg-type]
        definition.get("schedule"),
        args=list(definition.get("args") or ()),
        kwargs=definition.get("kwargs") or {},
        options=definition.get("options") or {},
        enabled=bool(definition.get("enabled", True)),
        app=app,
        client=client,
        last_run_at=last_run_at if isinstance(last_run_at, datetime) else None,
    )
    try:
        entry.to_json()  # the checks of save(), before anything is written
    except (TypeError, ValueError) as exc:
        return PlannedEntry(name, "skip", f"cannot be a runtime entry: {exc}")
    return PlannedEntry(name, "import", "", entry)


def apply_plan(plan: list[PlannedEntry]) -> list[PlannedEntry]:
    """Save every entry the plan imports (replacing a runtime entry of the same name); what was saved."""
    saved = []
    for item in plan:
        if item.action == "import" and item.entry is not None:
            item.entry.save()
            saved.append(item)
    return saved
