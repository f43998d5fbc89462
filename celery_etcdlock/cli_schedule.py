"""``celery etcdlock schedule ...``: the beat's runtime entries (``LeaderSchedulerEntry``) from the shell.

    celery -A proj etcdlock schedule list [--json]
    celery -A proj etcdlock schedule show NAME
    celery -A proj etcdlock schedule add NAME TASK --every 15m [--args '[1]'] [--kwargs '{"a": 1}']
    celery -A proj etcdlock schedule add NAME TASK --cron '0 7 * * mon-fri' [--replace]
    celery -A proj etcdlock schedule disable NAME | enable NAME | remove NAME [--yes]
    celery -A proj etcdlock schedule import-redbeat --redis-url redis://host:6379/0 [--key-prefix redbeat:] [--yes]

Every command prints a table, or JSON with ``--json``, and keeps trying etcd
for ``--timeout`` seconds as the other commands do. The running beat leader
applies each change within a second. ``import-redbeat`` only says what it
would do unless given ``--yes``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import click
from celery.bin.base import CeleryCommand
from celery.schedules import crontab

from .beat.entries import LeaderSchedulerEntry, describe_schedule, encode_schedule
from .cli import _client, _etcd_errors, _json, format_table, json_option, timeout_option

_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)?", re.IGNORECASE)
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, None: 1}


def parse_interval(text: str) -> timedelta:
    """``90``, ``30s``, ``15m``, ``1h30m``, ``1.5h``, ``2d`` as a timedelta; ``ValueError`` otherwise."""
    compact = text.strip().replace(" ", "")
    total, at = 0.0, 0
    while at < len(compact):
        match = _DURATION.match(compact, at)
        if match is None:
            raise ValueError(f"{text!r} is not an interval such as 90, 30s, 15m, 1h30m or 2d")
        total += float(match.group(1)) * _UNITS[match.group(2).lower() if match.group(2) else None]
        at = match.end()
    if not compact or total <= 0:
        raise ValueError(f"{text!r} is not a positive interval such as 30s, 15m or 1h30m")
    return timedelta(seconds=total)


def parse_cron(text: str) -> crontab:
    """Five crontab fields, ``minute hour day-of-month month day-of-week``, as celery's crontab."""
    fields = text.split()
    if len(fields) != 5:
        raise ValueError(f"{text!r}: a crontab has 5 fields (minute hour day-of-month month day-of-week)")
    minute, hour, day_of_month, month_of_year, day_of_week = fields
    return crontab(
        minute=minute, hour=hour, day_of_month=day_of_month, month_of_year=month_of_year, day_of_week=day_of_week
    )


def _json_arg(text: str | None, name: str, kind: type) -> Any:
    if text is None:
        return kind()
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint=name) from None
    if not isinstance(value, kind):
        raise click.BadParameter(f"must be a JSON {'array' if kind is list else 'object'}", param_hint=name)
    return value


def entry_row(entry: LeaderSchedulerEntry) -> dict[str, Any]:
    return {
        "name": entry.name,
        "task": entry.task,
        "schedule": encode_schedule(entry.schedule),
        "args": list(entry.args),
        "kwargs": entry.kwargs,
        "options": entry.options,
        "enabled": entry.enabled,
        "last_run_at": entry.last_run_at.isoformat() if entry.last_run_at else None,
        "total_run_count": entry.total_run_count,
        "created_at": entry.created_at,
        "saved_at": entry.saved_at,
    }


def entries_table(entries: Sequence[LeaderSchedulerEntry]) -> str:
    rows = [
        [
            e.name,
            e.task,
            describe_schedule(encode_schedule(e.schedule)),
            "yes" if e.enabled else "no",
            e.last_run_at.isoformat(timespec="seconds") if e.last_run_at else None,
            e.total_run_count,
        ]
        for e in entries
    ]
    return format_table(["NAME", "TASK", "SCHEDULE", "ENABLED", "LAST RUN", "RUNS"], rows)


def _print(entries: Sequence[LeaderSchedulerEntry], as_json: bool, empty: str) -> None:
    if as_json:
        click.echo(_json([entry_row(e) for e in entries]))
    elif entries:
        click.echo(entries_table(entries))
    else:
        click.echo(empty)


@click.group(name="schedule")
def schedule_group() -> None:
    """Runtime beat entries kept in etcd (LeaderSchedulerEntry): list, show, add, remove, enable, disable."""


def _load(ctx: click.Context, name: str, timeout: float) -> LeaderSchedulerEntry:
    client = _client(ctx, timeout)
    with _etcd_errors():
        try:
            return LeaderSchedulerEntry.load(name, app=ctx.obj.app, client=client)
        except KeyError:
            raise click.ClickException(f"no runtime entry named {name!r}") from None


@schedule_group.command(name="list", cls=CeleryCommand)
@json_option
@timeout_option
@click.pass_context
def list_entries(ctx: click.Context, as_json: bool, timeout: float) -> None:
    """List the runtime entries: name, task, schedule, enabled, last run, run count."""
    client = _client(ctx, timeout)
    with _etcd_errors():
        entries = LeaderSchedulerEntry.all(app=ctx.obj.app, client=client)
    _print(entries, as_json, "No runtime entry.")


@schedule_group.command(cls=CeleryCommand)
@click.argument("name")
@json_option
@timeout_option
@click.pass_context
def show(ctx: click.Context, name: str, as_json: bool, timeout: float) -> None:
    """Show the runtime entry NAME with its arguments and last run."""
    entry = _load(ctx, name, timeout)
    if as_json:
        click.echo(_json(entry_row(entry)))
        return
    click.echo(entries_table([entry]))
    click.echo(f"args: {json.dumps(list(entry.args))}  kwargs: {json.dumps(entry.kwargs)}")
    if entry.options:
        click.echo(f"options: {json.dumps(entry.options)}")


@schedule_group.command(cls=CeleryCommand)
@click.argument("name")
@click.argument("task")
@click.option("--every", metavar="INTERVAL", help="An interval: 90, 30s, 15m, 1h30m, 2d.")
@click.option("--cron", metavar="'M H DOM MON DOW'", help="A crontab, in the app's time zone: '0 7 * * mon-fri'.")
@click.option("--args", "args_json", metavar="JSON", help="Positional arguments, a JSON array.")
@click.option("--kwargs", "kwargs_json", metavar="JSON", help="Keyword arguments, a JSON object.")
@click.option("--options", "options_json", metavar="JSON", help="apply_async options, a JSON object.")
@click.option("--disabled", is_flag=True, help="Save it disabled (kept, not sent).")
@click.option("--replace", is_flag=True, help="Replace an entry of that name (its last run is kept).")
@json_option
@timeout_option
@click.pass_context
def add(
    ctx: click.Context,
    name: str,
    task: str,
    every: str | None,
    cron: str | None,
    args_json: str | None,
    kwargs_json: str | None,
    options_json: str | None,
    disabled: bool,
    replace: bool,
    as_json: bool,
    timeout: float,
) -> None:
    """Add the runtime entry NAME that sends TASK --every INTERVAL or on --cron; the leader applies it at once."""
    if (every is None) == (cron is None):
        raise click.UsageError("give exactly one of --every INTERVAL and --cron 'M H DOM MON DOW'")
    try:
        when: Any = parse_interval(every) if every is not None else parse_cron(cron or "")
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--every" if every is not None else "--cron") from None
    entry = LeaderSchedulerEntry(
        name,
        task,
        when,
        args=_json_arg(args_json, "--args", list),
        kwargs=_json_arg(kwargs_json, "--kwargs", dict),
        options=_json_arg(options_json, "--options", dict),
        enabled=not disabled,
        app=ctx.obj.app,
        client=_client(ctx, timeout),
    )
    with _etcd_errors():
        if not replace:
            try:
                LeaderSchedulerEntry.load(name, app=ctx.obj.app, client=entry._client)
            except KeyError:
                pass
            else:
                raise click.ClickException(f"a runtime entry named {name!r} exists: give --replace to replace it")
        entry.save()
        saved = LeaderSchedulerEntry.load(name, app=ctx.obj.app, client=entry._client)
    _print([saved], as_json, "")


@schedule_group.command(cls=CeleryCommand)
@click.argument("name")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@json_option
@timeout_option
@click.pass_context
def remove(ctx: click.Context, name: str, yes: bool, as_json: bool, timeout: float) -> None:
    """Remove the runtime entry NAME (and its last run); the leader stops sending it at once."""
    entry = _load(ctx, name, timeout)
    if not yes:
        if as_json:
            raise click.UsageError("--json needs --yes: there is no one to confirm")
        click.echo(entries_table([entry]))
        click.confirm(f"Remove runtime entry {name!r}?", abort=True)
    with _etcd_errors():
        removed = entry.delete()
    if as_json:
        click.echo(_json({"name": name, "removed": removed}))
    else:
        click.echo(f"Removed runtime entry {name!r}." if removed else f"{name!r} was removed meanwhile.")


def _set_enabled(ctx: click.Context, name: str, enabled: bool, as_json: bool, timeout: float) -> None:
    entry = _load(ctx, name, timeout)
    entry.enabled = enabled
    with _etcd_errors():
        entry.save()
    _print([entry], as_json, "")


@schedule_group.command(cls=CeleryCommand)
@click.argument("name")
@json_option
@timeout_option
@click.pass_context
def enable(ctx: click.Context, name: str, as_json: bool, timeout: float) -> None:
    """Enable the runtime entry NAME: it is sent again, continuing from its last run."""
    _set_enabled(ctx, name, True, as_json, timeout)


@schedule_group.command(cls=CeleryCommand)
@click.argument("name")
@json_option
@timeout_option
@click.pass_context
def disable(ctx: click.Context, name: str, as_json: bool, timeout: float) -> None:
    """Disable the runtime entry NAME: kept, with its last run, but not sent."""
    _set_enabled(ctx, name, False, as_json, timeout)


@schedule_group.command(name="import-redbeat", cls=CeleryCommand)
@click.option("--redis-url", required=True, metavar="URL", help="The Redis RedBeat keeps its entries in.")
@click.option("--key-prefix", default="redbeat:", show_default=True, help="RedBeat's redbeat_key_prefix.")
@click.option("--yes", "-y", is_flag=True, help="Import; without it, only say what would be imported.")
@json_option
@timeout_option
@click.pass_context
def import_redbeat(
    ctx: click.Context, redis_url: str, key_prefix: str, yes: bool, as_json: bool, timeout: float
) -> None:
    """Import RedBeat's entries (definition and last run) as runtime entries; a dry run unless --yes."""
    from .beat.redbeat import apply_plan, read_redbeat

    try:
        import redis
    except ImportError:
        raise click.ClickException(
            "import-redbeat needs the redis package: pip install 'celery-etcdlock[redis]'"
        ) from None
    client = _client(ctx, timeout)
    try:
        redis_client = redis.Redis.from_url(redis_url, socket_timeout=max(1.0, timeout))
        plan = read_redbeat(redis_client, ctx.obj.app, key_prefix=key_prefix, client=client)
    except redis.RedisError as exc:
        raise click.ClickException(
            f"could not read RedBeat's entries from Redis: {type(exc).__name__}: {exc}"
        ) from None
    if yes:
        with _etcd_errors():
            apply_plan(plan)
    if as_json:
        click.echo(_json({"dry_run": not yes, "entries": [item.as_dict() for item in plan]}))
        return
    if not plan:
        click.echo(f"No RedBeat entry under {key_prefix!r}.")
        return
    rows = [[item.name, item.action if yes or item.action == "skip" else "would import", item.reason] for item in plan]
    click.echo(format_table(["NAME", "ACTION", "REASON"], rows))
    imported = sum(item.action == "import" for item in plan)
    if yes:
        click.echo(f"Imported {imported} entries.")
    else:
        click.echo(f"Dry run: {imported} entries would be imported. Give --yes to import them.")
