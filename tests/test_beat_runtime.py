"""Runtime entries applied by a leader, in-process: schedulers ticked by the test against a real etcd and Redis.

Real beat processes, fail-over and the mixed-version test are below.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.schedules import crontab

from celery_etcdlock import connect, observe
from celery_etcdlock.beat import LeaderSchedulerEntry
from celery_etcdlock.beat.entries import run_key
from tests import test_beat
from tests.support import wait_until
from tests.test_beat import ROOT, Beats, make_app, scheduler_for, tick_until, url_prefix

make_beats = test_beat.make_beats  # the fixture of real beat processes, stopped after the test
schedulers = test_beat.schedulers  # the fixture of in-process schedulers, closed after the test


# -- a leader, ticked by the test ---------------------------------------------------------------------------


def runtime_app(etcd_url: str, redis_url: str) -> Celery:
    return make_app(etcd_url, redis_url, {"static": {"task": "t", "schedule": 3600.0}}, ttl=30)


def sent_kwargs(app: Celery) -> list[dict[str, Any]]:
    messages = redis.Redis.from_url(app.conf.broker_url).lrange(app.conf.task_default_queue, 0, -1)
    return [json.loads(base64.b64decode(json.loads(m)["body"]))[1] for m in messages]


@pytest.mark.slow
def test_a_leader_applies_saves_updates_and_deletes_without_restart(etcd_url, redis_url, schedulers):
    app = runtime_app(etcd_url, redis_url)
    reported: list[observe.Event] = []
    observe.subscribe(reported.append)  # what the metrics count (beat_runs_sent by entry)
    a = scheduler_for(schedulers, app, etcd_url, "a:1")
    tick_until(a, lambda: a.is_leader, 20, "a to lead")
    assert a.tick() <= 1.0  # it looks at the entries' changes at least once a second
    entry = LeaderSchedulerEntry("rt", "t", 0.3, kwargs={"v": 1}, app=app, client=connect(etcd_url))
    entry.save()
    try:
        tick_until(a, lambda: len(sent_kwargs(app)) >= 2, 20, "the runtime entry to be sent twice")
    finally:
        observe.unsubscribe(reported.append)
    assert [e.data["entry"] for e in reported if e.kind == observe.BEAT_SENT][:2] == ["rt", "rt"]
    run = a._client().backend.get_record(run_key(app.conf.etcdlock_beat_name, "rt"))
    assert run is not None and run.value["leader"] == "a:1" and run.value["token"] == a._election.token
    last = a.schedule["rt"].last_run_at
    count = run.value["total_run_count"]
    # only the arguments change: the last run is kept
    entry.kwargs = {"v": 2}
    entry.save()
    tick_until(a, lambda: a.schedule["rt"].kwargs == {"v": 2}, 20, "the update")
    assert a.schedule["rt"].last_run_at >= last and a.schedule["rt"].total_run_count >= count
    tick_until(a, lambda: {"v": 2} in sent_kwargs(app), 20, "a run with the new arguments")
    entry.enabled = False
    entry.save()
    tick_until(a, lambda: "rt" not in a.schedule, 20, "the disabled entry to go")
    entry.delete()
    a.tick()
    sent = len(sent_kwargs(app))
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        a.tick()
    assert len(sent_kwargs(app)) == sent
    assert "static" in a.schedule and "rt" not in a.schedule


def test_the_new_leader_continues_from_the_recorded_run(etcd_url, redis_url, schedulers):
    app = runtime_app(etcd_url, redis_url)
    a = scheduler_for(schedulers, app, etcd_url, "a:1")
    b = scheduler_for(schedulers, app, etcd_url, "b:2")
    tick_until(a, lambda: a.is_leader, 20, "a to lead")
    b.tick()
    LeaderSchedulerEntry("hourly", "t", 3600, app=app, client=connect(etcd_url)).save()
    tick_until(a, lambda: "hourly" in a.schedule, 20, "a to add it")
    a.apply_async(a.schedule["hourly"])  # as if due: recorded, then sent
    assert len(sent_kwargs(app)) == 1
    recorded = a.schedule["hourly"].last_run_at
    a.close()
    tick_until(b, lambda: b.is_leader and "hourly" in b.schedule, 20, "b to take over with the entry")
    assert abs((b.schedule["hourly"].last_run_at - recorded).total_seconds()) < 0.001
    assert b.schedule["hourly"].total_run_count == 1
    assert not b.schedule["hourly"].is_due()[0]


def test_a_run_due_while_no_leader_was_up_is_sent_once(etcd_url, redis_url, schedulers):
    app = runtime_app(etcd_url, redis_url)
    long_ago = datetime.now(timezone.utc) - timedelta(hours=5)
    LeaderSchedulerEntry("missed", "t", 3600, app=app, client=connect(etcd_url), last_run_at=long_ago).save()
    a = scheduler_for(schedulers, app, etcd_url, "a:1")
    tick_until(a, lambda: len(sent_kwargs(app)) >= 1, 20, "the missed run")
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        a.tick()
    assert len(sent_kwargs(app)) == 1  # once, not once per missed hour


def test_a_runtime_namesake_of_a_static_entry_is_not_sent(etcd_url, redis_url, schedulers):
    app = runtime_app(etcd_url, redis_url)
    other = Celery("other", set_as_current=False)  # an app without the static entry saves it anyway
    other.conf.update(etcdlock_url=etcd_url, etcdlock_beat_name=app.conf.etcdlock_beat_name)
    LeaderSchedulerEntry("static", "t", 0.2, app=other, client=connect(etcd_url)).save()
    a = scheduler_for(schedulers, app, etcd_url, "a:1")
    tick_until(a, lambda: a.is_leader, 20, "a to lead")
    for _ in range(5):
        a.tick()
    assert a.schedule["static"].schedule.run_every == timedelta(hours=1)
    assert sent_kwargs(app) == []


# -- real beat processes -------------------------------------------------------------------------------


def saver(etcd_url: str) -> Celery:
    """An app that saves runtime entries for tests.beatapp's beats (their beat name, etcd and prefix)."""
    app = Celery("saver", set_as_current=False)
    app.conf.update(etcdlock_url=etcd_url, etcdlock_prefix=url_prefix(etcd_url), etcdlock_beat_name="beatapp")
    return app


def runtime_entry(app: Celery, name: str, when: Any) -> LeaderSchedulerEntry:
    return LeaderSchedulerEntry(name, "tests.beatapp.record_runtime", when, kwargs={"entry": name}, app=app)


def sends(beats: Beats, entry: str, after: float = 0.0) -> list[tuple[str, str, float]]:
    return [p for p in beats.published() if p[0] == entry and p[2] > after]


def no_doubles(published: list[tuple[str, str, float]], interval: float) -> None:
    times = [at for _, _, at in published]
    close = [(a, b) for a, b in zip(published, published[1:], strict=False) if b[2] - a[2] < interval / 2]
    assert not close, f"sends closer than half an interval: {close} (of {len(times)})"


@pytest.mark.slow
@pytest.mark.parametrize("api", ["v3"])  # one real-process run: the in-process tests cover both APIs
def test_runtime_entries_across_a_fail_over_of_real_beats(etcd_url, redis_url, make_beats):
    """Save while three beats run: the leader alone sends; SIGKILL it: the next sends the interval entry on, and
    the crontab run that fell due with no leader up once; a schedule change, then a delete, are followed."""
    ttl = 2
    beats = make_beats(etcd_url, redis_url, ttl, "every")
    for _ in range(3):
        beats.start_beat()
    beats.start_worker()
    beats.leader()
    app = saver(etcd_url)
    saved_at = time.time()
    runtime_entry(app, "rt", 1.0).save()
    runtime_entry(app, "rt-cron", crontab(minute="*")).save()
    first = wait_until(lambda: sends(beats, "rt"), 5 + 5, "the saved entry's first send")  # within 5 s, and slack
    print(f"first send {first[0][2] - saved_at:.2f}s after save()")
    leader = first[0][1]
    assert leader in beats.beats
    # kill the leader 1.5 s before a minute starts: the crontab run falls due while nobody leads
    boundary = (int(time.time() // 60) + 1) * 60
    if boundary - time.time() < 4:
        boundary += 60
    wait_until(lambda: time.time() >= boundary - 1.5, 70, "1.5 s before the minute", interval=0.01)
    leader = sends(beats, "rt")[-1][1]
    beats.signal(leader, signal.SIGKILL)
    killed_at = time.time()
    after = wait_until(lambda: sends(beats, "rt", killed_at), ttl + 20, "a send by the new leader")
    new_leader = after[0][1]
    assert new_leader != leader
    cron = wait_until(lambda: sends(beats, "rt-cron", boundary - 2), ttl + 20, "the crontab run")
    assert [c[1] for c in cron] == [new_leader] or killed_at >= boundary
    # change the schedule: sends follow it
    changed = runtime_entry(app, "rt", 2.0)
    changed.save()
    changed_at = time.time()
    wait_until(lambda: len(sends(beats, "rt", changed_at + 1.5)) >= 3, 30, "3 sends at the new interval")
    slow = sends(beats, "rt", changed_at + 1.5)
    assert all(b[2] - a[2] > 1.5 for a, b in zip(slow, slow[1:], strict=False)), slow
    changed.delete()
    deleted_at = time.time()
    wait_until(lambda: len(sends(beats, "every", deleted_at + 3)) >= 1, 30, "3 s after the delete")
    assert sends(beats, "rt", deleted_at + 1.5) == []  # applied within a second (and a half, for the send itself)
    beats.settle()
    everything = sends(beats, "rt")
    assert {p[1] for p in everything if p[2] > killed_at} == {new_leader}
    assert {p[1] for p in everything if p[2] < killed_at} == {leader}
    no_doubles([p for p in everything if p[2] < changed_at], 1.0)
    assert len(sends(beats, "rt-cron", boundary - 2)) == 1  # sent once, however many beats
    runs = [r for r in beats.runs("rt") if r["sender"]]
    assert runs and {r["sender"] for r in runs} <= {leader, new_leader}  # judged by the messages' origin


V02 = "86eef16"  # celery_etcdlock 0.2: knows nothing of runtime entries


@pytest.fixture(scope="module")
def release_02(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """celery_etcdlock as of 0.2, extracted from git, to put first on a process's PYTHONPATH."""
    where = tmp_path_factory.mktemp("v02")
    archive = subprocess.run(["git", "archive", V02, "celery_etcdlock"], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive.stdout, check=True)
    # as the celery program finds it (its sys.path starts with its own folder, not with the working directory)
    code = "import sys; sys.path.pop(0); import celery_etcdlock.beat as b, celery_etcdlock as c; print(b.__file__)"
    env = {**os.environ, "PYTHONPATH": f"{where}{os.pathsep}{ROOT}"}
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    assert found.stdout.split() == [str(where / "celery_etcdlock" / "beat.py")], found.stdout
    return where


@pytest.mark.slow
@pytest.mark.parametrize("api", ["v3"])
def test_a_rolling_deploy_new_then_02_then_new_sends_nothing_twice(etcd_url, redis_url, make_beats, release_02):
    """A 0.2 leader between two new ones sends the static entries on (runtime entries wait for a new leader), and
    neither the state document nor the runtime entries' run records are damaged by it."""
    ttl = 2
    beats = make_beats(etcd_url, redis_url, ttl, "every")
    app = saver(etcd_url)
    runtime_entry(app, "rt", 1.0).save()
    new = beats.start_beat()
    beats.start_worker()
    wait_until(lambda: len(sends(beats, "rt")) >= 2 and len(sends(beats, "every")) >= 2, 30, "the new beat's sends")
    current = beats.env["PYTHONPATH"]
    beats.env["PYTHONPATH"] = f"{release_02}{os.pathsep}{current}"
    old = beats.start_beat()
    beats.env["PYTHONPATH"] = current
    wait_until(lambda: "campaigning" in beats.log(old), 30, "the 0.2 beat to campaign")
    beats.signal(new, signal.SIGKILL)
    first_kill = time.time()
    wait_until(lambda: len(sends(beats, "every", first_kill)) >= 3, ttl + 30, "3 sends by the 0.2 leader")
    assert {p[1] for p in sends(beats, "every", first_kill)} == {old}
    assert sends(beats, "rt", first_kill + 0.5) == []  # 0.2 does not know runtime entries
    again = beats.start_beat()
    wait_until(lambda: "campaigning" in beats.log(again), 30, "the second new beat to campaign")
    beats.signal(old, signal.SIGKILL)
    second_kill = time.time()
    wait_until(lambda: len(sends(beats, "rt", second_kill)) >= 3, ttl + 30, "3 runtime sends by the new leader")
    wait_until(lambda: len(sends(beats, "every", second_kill)) >= 3, 30, "3 static sends by the new leader")
    beats.settle()
    assert {p[1] for p in sends(beats, "rt", second_kill)} == {again}
    no_doubles(sends(beats, "every"), 1.0)
    no_doubles(sends(beats, "rt"), 1.0)
    client = connect(etcd_url)
    state = client.backend.get_record("records/beat-state/beatapp")
    assert state is not None and set(state.value["entries"]) == {"every"}  # 0.2's layout, static entries only
    run = client.backend.get_record(run_key("beatapp", "rt"))
    assert run is not None and run.value["leader"] == again
    assert run.value["total_run_count"] >= len(sends(beats, "rt"))  # counted on from the first leader's
