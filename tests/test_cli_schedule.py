"""``celery etcdlock schedule ...`` against a real etcd, and ``import-redbeat`` of entries the real RedBeat wrote.

The commands run through Celery's own command line in-process (click's runner), as in test_cli.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.bin.celery import celery as celery_cli
from celery.schedules import crontab
from click.testing import CliRunner, Result

from celery_etcdlock import Election, connect
from celery_etcdlock.beat import LeaderSchedulerEntry
from celery_etcdlock.cli_schedule import parse_cron, parse_interval
from tests.test_cli import make_app, split_url

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def app_module(tmp_path: Path, etcd_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    static = {"static-one": {"task": "t", "schedule": 60.0}}
    return make_app(tmp_path, monkeypatch, *split_url(etcd_url), beat_schedule=static)


@pytest.fixture
def run(app_module: str) -> Callable[..., Result]:
    def invoke(*args: str, input: str | None = None) -> Result:
        return CliRunner().invoke(celery_cli, ["-A", app_module, "etcdlock", "schedule", *args], input=input)

    return invoke


@pytest.fixture
def app(app_module: str, etcd_url: str) -> Celery:
    app = Celery(app_module, set_as_current=False)
    url, prefix = split_url(etcd_url)
    app.conf.update(
        etcdlock_url=url, etcdlock_prefix=prefix, beat_schedule={"static-one": {"task": "t", "schedule": 60}}
    )
    return app


def listed(run: Callable[..., Result]) -> dict[str, Any]:
    result = run("list", "--json")
    assert result.exit_code == 0, result.output
    return {e["name"]: e for e in json.loads(result.output)}


def test_readable_intervals_and_crontabs() -> None:
    assert parse_interval("90") == timedelta(seconds=90)
    assert parse_interval("1h30m") == timedelta(minutes=90)
    assert parse_interval("1.5h") == timedelta(minutes=90)
    assert parse_interval("2d") == timedelta(days=2)
    assert parse_interval("250ms") == timedelta(milliseconds=250)
    for bad in ("", "0", "abc", "5 parsecs", "-5m"):
        with pytest.raises(ValueError):
            parse_interval(bad)
    assert parse_cron("0 7 * * mon-fri") == crontab(minute=0, hour=7, day_of_week="mon-fri")
    with pytest.raises(ValueError, match="5 fields"):
        parse_cron("0 7 *")


def test_add_list_show_disable_enable_remove(run: Callable[..., Result]) -> None:
    assert run("list").output.strip() == "No runtime entry."
    added = run("add", "report", "shop.report", "--every", "15m", "--args", "[42]", "--kwargs", '{"full": true}')
    assert added.exit_code == 0, added.output
    assert "every 900s" in added.output
    cron = run("add", "morning", "shop.morning", "--cron", "0 7 * * mon-fri", "--json")
    assert cron.exit_code == 0, cron.output
    assert json.loads(cron.output)[0]["schedule"]["hour"] == "7"
    entries = listed(run)
    assert sorted(entries) == ["morning", "report"]
    assert entries["report"]["args"] == [42] and entries["report"]["kwargs"] == {"full": True}
    table = run("list").output
    assert table.splitlines()[0].split()[:3] == ["NAME", "TASK", "SCHEDULE"] and "cron 0 7 * * mon-fri" in table
    shown = run("show", "report")
    assert shown.exit_code == 0 and "[42]" in shown.output
    assert run("add", "report", "shop.report", "--every", "1m").exit_code != 0  # exists: needs --replace
    assert run("add", "report", "shop.report", "--every", "1m", "--replace").exit_code == 0
    assert listed(run)["report"]["schedule"] == {"type": "interval", "seconds": 60.0}
    assert run("disable", "report").exit_code == 0
    assert listed(run)["report"]["enabled"] is False
    assert run("enable", "report").exit_code == 0
    assert listed(run)["report"]["enabled"] is True
    assert run("remove", "report", input="n\n").exit_code != 0  # asked, and declined
    assert "report" in listed(run)
    removed = run("remove", "report", "--yes", "--json")
    assert removed.exit_code == 0 and json.loads(removed.output) == {"name": "report", "removed": True}
    assert sorted(listed(run)) == ["morning"]


def test_the_commands_refuse_nonsense_with_one_line(run: Callable[..., Result]) -> None:
    cases = [
        (["add", "x", "t"], "exactly one of --every"),
        (["add", "x", "t", "--every", "soon"], "not an interval"),
        (["add", "x", "t", "--cron", "99 * * * *"], "--cron"),
        (["add", "x", "t", "--every", "1m", "--args", "{"], "not JSON"),
        (["add", "x", "t", "--every", "1m", "--args", '{"a": 1}'], "JSON array"),
        (["add", "static-one", "t", "--every", "1m"], "beat_schedule"),
        (["show", "missing"], "no runtime entry named 'missing'"),
        (["enable", "missing"], "no runtime entry named 'missing'"),
    ]
    for args, message in cases:
        result = run(*args)
        assert result.exit_code != 0, args
        assert message in result.output, (args, result.output)
        assert "Traceback" not in result.output


def test_a_command_gives_up_after_its_timeout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = make_app(tmp_path, monkeypatch, "etcd3://127.0.0.1:1", "/nowhere")
    result = CliRunner().invoke(celery_cli, ["-A", module, "etcdlock", "schedule", "list", "--timeout", "0.5"])
    assert result.exit_code != 0 and "BackendUnavailable" in result.output
    assert "Traceback" not in result.output


# -- import-redbeat ------------------------------------------------------------------------------------


def redbeat_app(redis_url: str, prefix: str) -> Celery:
    app = Celery("redbeat-source", broker=redis_url, set_as_current=False)
    app.conf.update(redbeat_redis_url=redis_url, redbeat_key_prefix=prefix, timezone="UTC")
    return app


def test_import_redbeat_keeps_definitions_and_last_runs(
    run: Callable[..., Result], app: Celery, redis_url: str
) -> None:
    from redbeat import RedBeatSchedulerEntry

    prefix = f"rb-{app.main}:"
    source = redbeat_app(redis_url, prefix)
    ran = datetime(2026, 11, 30, 6, 15, tzinfo=timezone.utc)
    every = RedBeatSchedulerEntry("every-5m", "shop.report", timedelta(minutes=5), args=[1, "a"], kwargs={"b": 2},
                                  options={"queue": "reports"}, app=source)  # fmt: skip
    every.save()
    every.last_run_at = ran
    every.reschedule(ran)  # as RedBeat records a run: the meta hash
    RedBeatSchedulerEntry("cron", "shop.morning", crontab(minute=0, hour=7), app=source).save()
    RedBeatSchedulerEntry("off", "shop.off", 60, enabled=False, app=source).save()
    RedBeatSchedulerEntry("static-one", "t", 60, app=source).save()  # a static entry of the app: skipped
    r = redis.Redis.from_url(redis_url)
    r.hset(f"{prefix}broken", "definition", "{not json")
    r.zadd(f"{prefix}:schedule", {f"{prefix}broken": 0})

    dry = run("import-redbeat", "--redis-url", redis_url, "--key-prefix", prefix)
    assert dry.exit_code == 0, dry.output
    assert "Dry run: 3 entries would be imported" in dry.output
    assert LeaderSchedulerEntry.all(app=app) == []  # a dry run writes nothing
    plan = {i["name"]: i for i in json.loads(run("import-redbeat", "--redis-url", redis_url, "--key-prefix", prefix,
                                                 "--json").output)["entries"]}  # fmt: skip
    assert plan["static-one"]["action"] == "skip" and "static" in plan["static-one"]["reason"]
    assert plan["broken"]["action"] == "skip" and "unreadable" in plan["broken"]["reason"]

    done = run("import-redbeat", "--redis-url", redis_url, "--key-prefix", prefix, "--yes")
    assert done.exit_code == 0, done.output
    assert "Imported 3 entries." in done.output
    imported = {e.name: e for e in LeaderSchedulerEntry.all(app=app)}
    assert sorted(imported) == ["cron", "every-5m", "off"]
    five = imported["every-5m"]
    assert (five.task, five.args, five.kwargs, five.options) == (
        "shop.report",
        [1, "a"],
        {"b": 2},
        {"queue": "reports"},
    )
    assert five.schedule.run_every == timedelta(minutes=5)
    assert five.last_run_at == ran  # the schedule continues from RedBeat's last run
    assert imported["cron"].schedule == crontab(minute=0, hour=7)
    assert imported["off"].enabled is False
    assert r.exists(f"{prefix}every-5m")  # RedBeat's own keys are left alone


def test_import_redbeat_names_an_unreachable_redis(run: Callable[..., Result]) -> None:
    result = run("import-redbeat", "--redis-url", "redis://127.0.0.1:1/0", "--timeout", "0.5")
    assert result.exit_code != 0 and "could not read RedBeat's entries" in result.output
    assert "Traceback" not in result.output


def test_leader_shows_how_many_runtime_entries_a_beat_has(
    run: Callable[..., Result], app: Celery, app_module: str, etcd_url: str
) -> None:
    LeaderSchedulerEntry("one", "t", 60, app=app).save()
    LeaderSchedulerEntry("two", "t", 60, app=app).save()
    url, prefix = split_url(etcd_url)
    election = Election(connect(url, prefix=prefix), f"beat/{app_module}", identity="beat-host:1", ttl=5)
    assert election.campaign(timeout=10)
    try:
        result = CliRunner().invoke(celery_cli, ["-A", app_module, "etcdlock", "leader", "--json"])
        assert result.exit_code == 0, result.output
        [state] = [s for s in json.loads(result.output) if s["name"] == f"beat/{app_module}"]
        assert state["runtime_entries"] == 2
        table = CliRunner().invoke(celery_cli, ["-A", app_module, "etcdlock", "leader"]).output
        assert "RUNTIME ENTRIES" in table.splitlines()[0]
    finally:
        election.resign()
