"""Runtime schedule entries (``LeaderSchedulerEntry``): the model, and a leader that applies them, in-process.

Validation, save / load / all / delete on memory://; concurrent and
interrupted saves on a real etcd. A leader that applies them: test_beat_runtime.py.
"""

from __future__ import annotations

import math
import signal
import subprocess
import sys
import threading
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.schedules import crontab, schedule, solar

from celery_etcdlock import _children, connect
from celery_etcdlock.beat import LeaderSchedulerEntry
from celery_etcdlock.beat.entries import MAX_ENTRY_BYTES, entry_key

ROOT = Path(__file__).resolve().parent.parent


def unique() -> str:
    return uuid.uuid4().hex[:10]


def memory_app(**conf: Any) -> Celery:
    app = Celery(f"entries-{unique()}", set_as_current=False)
    app.conf.update(etcdlock_url=f"memory://entries-{unique()}", **conf)
    return app


# -- the model ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "field"),
    [
        ({"name": ""}, ValueError, "name"),
        ({"name": 3}, TypeError, "name"),
        ({"task": ""}, ValueError, "task"),
        ({"schedule": 0}, ValueError, "schedule"),
        ({"schedule": -5}, ValueError, "schedule"),
        ({"schedule": math.nan}, ValueError, "schedule"),
        ({"schedule": math.inf}, ValueError, "schedule"),
        ({"schedule": timedelta(0)}, ValueError, "schedule"),
        ({"schedule": "every minute"}, TypeError, "schedule"),
        ({"schedule": object()}, TypeError, "schedule"),
        ({"args": (object(),)}, TypeError, "args"),
        ({"args": "abc"}, TypeError, "args"),
        ({"kwargs": {"x": {1, 2}}}, TypeError, "kwargs"),
        ({"kwargs": {"x": math.nan}}, ValueError, "kwargs"),
        ({"kwargs": {1: "x"}}, TypeError, "kwargs"),
        ({"options": []}, TypeError, "options"),
        ({"enabled": "yes"}, TypeError, "enabled"),
        ({"args": ("x" * MAX_ENTRY_BYTES,)}, ValueError, "bytes of JSON"),
        ({"name": "static"}, ValueError, "beat_schedule"),
    ],
)
def test_nonsense_is_refused_at_save_naming_the_field(kwargs: dict[str, Any], error: type, field: str) -> None:
    app = memory_app(beat_schedule={"static": {"task": "t", "schedule": 5}})
    entry = LeaderSchedulerEntry(**{"name": "e", "task": "t", "schedule": 5.0, "app": app, **kwargs})
    with pytest.raises(error, match=field):
        entry.save()
    assert LeaderSchedulerEntry.all(app=app) == []


def test_save_load_all_delete() -> None:
    app = memory_app()
    with pytest.raises(KeyError):
        LeaderSchedulerEntry.load("missing", app=app)
    kinds = {
        "seconds": 30,
        "timedelta": timedelta(minutes=2),
        "schedule": schedule(timedelta(seconds=45)),
        "crontab": crontab(minute="*/15", hour="7-9", day_of_week="mon-fri"),
        "solar": solar("sunset", 48.85, 2.35),
    }
    for name, value in kinds.items():
        LeaderSchedulerEntry(name, "proj.task", value, args=(1, "a"), kwargs={"k": [1]}, app=app).save()
    loaded = {e.name: e for e in LeaderSchedulerEntry.all(app=app)}
    assert sorted(loaded) == sorted(kinds)
    assert loaded["seconds"].schedule.run_every == timedelta(seconds=30)
    assert loaded["timedelta"].schedule.run_every == timedelta(minutes=2)
    assert loaded["schedule"].schedule.run_every == timedelta(seconds=45)
    assert loaded["crontab"].schedule == crontab(minute="*/15", hour="7-9", day_of_week="mon-fri")
    assert (loaded["solar"].schedule.event, loaded["solar"].schedule.lat) == ("sunset", 48.85)
    one = LeaderSchedulerEntry.load("crontab", app=app)
    assert (one.task, one.args, one.kwargs, one.enabled) == ("proj.task", [1, "a"], {"k": [1]}, True)
    created = one.created_at
    one.enabled = False
    one.save()
    again = LeaderSchedulerEntry.load("crontab", app=app)
    assert again.enabled is False and again.created_at == created  # an update keeps its creation time
    assert again.delete() is True
    assert again.delete() is False
    with pytest.raises(KeyError):
        LeaderSchedulerEntry.load("crontab", app=app)
    # JSON in etcd, never pickle
    client = connect(app.conf.etcdlock_url)
    record = client.backend.get_record(entry_key(app.main, "seconds"))
    assert record is not None and record.value["schedule"] == {"type": "interval", "seconds": 30.0}


def test_concurrent_saves_never_leave_a_torn_entry(etcd_url: str) -> None:
    """Two clients save one name over and over: last write wins, and each read is one client's whole entry."""
    app = Celery(f"torn-{unique()}", set_as_current=False)
    app.conf.update(etcdlock_url=etcd_url, etcdlock_retry_max_delay=10)
    versions = {
        who: {"task": f"task.{who}", "args": [who] * 20, "kwargs": {"who": who}, "schedule": 10 + i}
        for i, who in enumerate("ab")
    }
    errors: list[BaseException] = []

    def saves(who: str) -> None:
        client = connect(etcd_url)
        spec = versions[who]
        try:
            for _ in range(15):
                entry = LeaderSchedulerEntry(
                    "shared", spec["task"], spec["schedule"], args=spec["args"], kwargs=spec["kwargs"], app=app,
                    client=client,
                )  # fmt: skip
                entry.save()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=saves, args=(who,)) for who in versions]
    for thread in threads:
        thread.start()
    reader = connect(etcd_url)
    seen = 0
    while any(t.is_alive() for t in threads):
        try:
            entry = LeaderSchedulerEntry.load("shared", app=app, client=reader)
        except KeyError:
            continue
        who = entry.kwargs["who"]
        spec = versions[who]
        assert (entry.task, entry.args, entry.schedule.run_every.total_seconds()) == (
            spec["task"], spec["args"], spec["schedule"],
        )  # fmt: skip
        seen += 1
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert seen > 0


def test_an_interrupted_save_leaves_no_half_written_entry(etcd_url: str) -> None:
    """A process killed in the middle of its saves leaves each entry whole (one document, one write)."""
    code = f"""
import sys
from celery import Celery
from celery_etcdlock.beat import LeaderSchedulerEntry
app = Celery("interrupted", set_as_current=False)
app.conf.etcdlock_url = {etcd_url!r}
i = 0
while True:
    LeaderSchedulerEntry("killed", "t", 1 + i % 7, args=[i] * 200, kwargs={{"i": i}}, app=app).save()
    i += 1
    if i == 5:
        print("saving", flush=True)
"""
    proc = _children.popen([sys.executable, "-c", code], stdout=subprocess.PIPE, cwd=ROOT)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"saving"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(30)
    app = Celery("interrupted", set_as_current=False)
    app.conf.etcdlock_url = etcd_url
    entry = LeaderSchedulerEntry.load("killed", app=app)
    i = entry.kwargs["i"]
    assert entry.args == [i] * 200 and entry.schedule.run_every.total_seconds() == 1 + i % 7
