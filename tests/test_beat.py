"""LeaderScheduler against a real etcd and Redis.

Two kinds of tests:

- in-process: a scheduler ticked by the test, for what needs precise control
  (fencing of a deposed leader, catch-up, schedule changes, lazy creation);
- real processes: ``celery -A tests.beatapp beat`` x2/x3 and a worker, killed,
  stopped and resumed for real, with an entry every second whose runs the
  worker records in Redis (sender and send time evaluated in the beat).

Every timing check is a poll with a deadline; fail-over speed is measured
by bench/bench_beat.py, not asserted here beyond generous bounds.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import redis
from celery import Celery

from celery_etcdlock import Election, _children, connect
from celery_etcdlock.beat import STATE_KIND, LeaderScheduler, beat_name
from celery_etcdlock.cli import list_elections
from celery_etcdlock.locks.store import DocumentStore
from tests.support import EtcdServer, free_port, wait_until
from tests.support.celery_processes import CELERY, ROOT, CeleryProcesses

HOST = socket.gethostname()


def unique() -> str:
    return uuid.uuid4().hex[:10]


def url_prefix(url: str) -> str:
    """The ``?prefix=`` of an etcd URL (the fixtures give each test its own)."""
    return parse_qs(urlsplit(url).query).get("prefix", ["/celery-etcdlock"])[0]


# -- in-process schedulers ---------------------------------------------------------------------------


def make_app(etcd_url: str, broker: str, schedule: dict[str, Any], ttl: float = 30, name: str = "") -> Celery:
    app = Celery("inproc", broker=broker, set_as_current=False)
    app.conf.update(
        task_default_queue=f"q-{unique()}",
        task_ignore_result=True,
        beat_schedule=schedule,
        etcdlock_url=etcd_url,
        etcdlock_prefix=url_prefix(etcd_url),
        etcdlock_beat_ttl=ttl,
        etcdlock_retry_max_delay=5,
        etcdlock_beat_name=name or f"inproc-{unique()}",
    )
    return app


def queued(app: Celery) -> int:
    """Messages published to the app's queue so far (nothing consumes it)."""
    return int(redis.Redis.from_url(app.conf.broker_url).llen(app.conf.task_default_queue))


def tick_until(scheduler: LeaderScheduler, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(min(0.05, max(0.0, scheduler.tick())))


def state(app: Celery, client: Any) -> dict[str, Any]:
    record = DocumentStore(client, STATE_KIND).get(beat_name(app))
    assert record is not None, "no schedule state in etcd"
    return record.value


@pytest.fixture
def schedulers() -> Iterator[list[LeaderScheduler]]:
    made: list[LeaderScheduler] = []
    yield made
    for scheduler in made:
        scheduler.close()


def scheduler_for(made: list[LeaderScheduler], app: Celery, url: str, identity: str) -> LeaderScheduler:
    # a client of its own, so that each scheduler has its own session, as separate processes do
    scheduler = LeaderScheduler(app, etcd_client=connect(url), identity=identity)
    made.append(scheduler)
    return scheduler


def test_lazy_and_unticked_schedulers_do_not_campaign(etcd_url, redis_url, schedulers):
    url = etcd_url
    app = make_app(url, redis_url, {"every": {"task": "t", "schedule": 1.0}})
    banner = LeaderScheduler(app, lazy=True)  # what `celery beat` builds for its banner
    assert "beat/" in banner.info
    scheduler = scheduler_for(schedulers, app, url, "a:1")
    assert "every" in scheduler.schedule
    observer = Election(connect(url), f"beat/{beat_name(app)}", identity="observer", ttl=5)
    assert observer.leader() is None  # nobody campaigned yet
    tick_until(scheduler, lambda: scheduler.is_leader, 20, "the ticked scheduler to lead")
    assert observer.leader() == "a:1"
    banner.close()  # a banner copy closes without touching etcd
    assert observer.leader() == "a:1"


@pytest.mark.slow
@pytest.mark.every_etcd  # a small part of the beat tests on every etcd kind
def test_only_the_leader_writes_and_sends(etcd_url, redis_url, schedulers):
    url = etcd_url
    app = make_app(url, redis_url, {"every": {"task": "t", "schedule": 0.2, "args": (1,), "kwargs": {"k": 2}}})
    a = scheduler_for(schedulers, app, url, "a:1")
    b = scheduler_for(schedulers, app, url, "b:2")
    tick_until(a, lambda: a.is_leader, 20, "a to lead")
    b.tick()  # b campaigns, finds a leading, stands by
    tick_until(a, lambda: queued(app) >= 3, 20, "a to send 3 runs")
    doc = state(app, a._client())
    assert doc["leader"] == "a:1" and doc["token"] == a._election.token
    assert doc["entries"]["every"]["total_run_count"] >= 3
    version = DocumentStore(a._client(), STATE_KIND).get(beat_name(app)).version
    sent = queued(app)
    for _ in range(3):
        b.tick()
    assert not b.is_leader
    assert queued(app) == sent
    assert DocumentStore(a._client(), STATE_KIND).get(beat_name(app)).version == version


class FrozenFence:
    def __init__(self, entry: Any) -> None:
        self.fence_entry = entry


class PausedBeforePut:
    """Wraps a scheduler's DocumentStore: the next put() stops where a process could be paused.

    That is inside ``DocumentStore.put``, after it read the fence entry (still held
    then) and before the request: the write itself is real, only its timing is
    chosen by the test.
    """

    def __init__(self, store: DocumentStore) -> None:
        self.store = store
        self.paused = threading.Event()
        self.resume = threading.Event()
        self.results: list[Any] = []

    def get(self, name: str) -> Any:
        return self.store.get(name)

    def put(self, name: str, value: dict[str, Any], *, fence: Any = None, **kwargs: Any) -> Any:
        frozen = FrozenFence(fence.fence_entry) if fence is not None else None
        self.paused.set()
        self.resume.wait(30)
        result = self.store.put(name, value, fence=frozen, **kwargs)
        self.results.append(result)
        return result


@pytest.mark.every_etcd  # a small part of the beat tests on every etcd kind
def test_deposed_leader_can_neither_write_nor_send(etcd_url, redis_url, schedulers):
    """A leader paused after its last leadership check, deposed meanwhile, is fenced off when it resumes."""
    url = etcd_url
    app = make_app(url, redis_url, {"every": {"task": "t", "schedule": 0.2}}, ttl=30)
    a = scheduler_for(schedulers, app, url, "a:1")
    b = scheduler_for(schedulers, app, url, "b:2")
    tick_until(a, lambda: queued(app) >= 1, 20, "a to send")
    b.tick()
    store = a._runs.store = PausedBeforePut(a._runs.store)  # type: ignore[assignment]
    ticking = threading.Thread(target=tick_until, args=(a, lambda: store.results, 30, "a's write"), daemon=True)
    ticking.start()
    try:
        assert store.paused.wait(10), "a did not try to record a run"
        # while a is paused in its write, it is deposed and b takes over
        assert connect(url).backend.delete_entry(a._election.fence_entry)
        tick_until(b, lambda: b.is_leader, 20, "b to take over")
        taken_over = DocumentStore(b._client(), STATE_KIND).get(beat_name(app))
        sent = queued(app)
    finally:
        store.resume.set()
    ticking.join(10)
    assert store.results and store.results[0] is None, "the deposed leader's write went through"
    assert DocumentStore(b._client(), STATE_KIND).get(beat_name(app)) == taken_over
    assert queued(app) == sent, "the deposed leader sent a run"
    assert not a.is_leader
    tick_until(b, lambda: queued(app) > sent, 10, "b to keep sending")


@pytest.mark.parametrize("api", ["v3"])  # v2 has no multi-key transaction: its fence is the new leader's write
def test_v3_write_of_a_leader_whose_entry_vanished_is_refused(api, etcd_url, redis_url, schedulers):
    """No other leader yet: the transaction's fence alone refuses the write, so nothing is sent."""
    app = make_app(etcd_url, redis_url, {"every": {"task": "t", "schedule": 0.2}}, ttl=30)
    a = scheduler_for(schedulers, app, etcd_url, "a:1")
    tick_until(a, lambda: queued(app) >= 1, 20, "a to send")
    store = a._runs.store = PausedBeforePut(a._runs.store)  # type: ignore[assignment]
    ticking = threading.Thread(target=tick_until, args=(a, lambda: store.results, 30, "a's write"), daemon=True)
    ticking.start()
    try:
        assert store.paused.wait(10), "a did not try to record a run"
        assert connect(etcd_url).backend.delete_entry(a._election.fence_entry)
        sent = queued(app)
    finally:
        store.resume.set()
    ticking.join(10)
    assert store.results == [None], "the write of a leader whose election entry is gone went through"
    assert queued(app) == sent, "a deposed leader sent a run"


def test_new_leader_sends_one_overdue_run_and_keeps_counts(etcd_url, redis_url, schedulers):
    url = etcd_url
    schedule = {"often": {"task": "t", "schedule": 0.1}, "hourly": {"task": "t", "schedule": 3600.0}}
    app = make_app(url, redis_url, schedule)
    a = scheduler_for(schedulers, app, url, "a:1")
    tick_until(a, lambda: queued(app) >= 3, 20, "a to send")
    a.close()
    store = DocumentStore(connect(url), STATE_KIND)
    record = store.get(beat_name(app))
    count = record.value["entries"]["often"]["total_run_count"]
    # nobody led for two hours: both entries are overdue, "often" by 72000 intervals
    doc = json.loads(json.dumps(record.value))
    for entry in doc["entries"].values():
        entry["last_run_at"] = "2000-01-01T00:00:00+00:00"
    assert store.put(beat_name(app), doc, expect=record)
    app.conf.beat_schedule = {"hourly": {"task": "t", "schedule": 3600.0}}  # one overdue run to count
    before = queued(app)
    b = scheduler_for(schedulers, app, url, "b:2")
    tick_until(b, lambda: queued(app) > before, 20, "b to send the overdue run")
    for _ in range(5):
        b.tick()
    assert queued(app) == before + 1, "one overdue run, not one per missed interval"
    doc = state(app, b._client())
    assert doc["entries"]["hourly"]["total_run_count"] == 1
    assert "often" not in doc["entries"], "the state of a removed entry was not cleaned up"
    assert count >= 3


def test_schedule_changes_apply_when_a_leader_takes_over(etcd_url, redis_url, schedulers):
    url = etcd_url
    app = make_app(url, redis_url, {"a": {"task": "t", "schedule": 0.1}, "b": {"task": "t", "schedule": 0.1}})
    old = scheduler_for(schedulers, app, url, "old:1")
    tick_until(
        old,
        lambda: old.is_leader and state(app, old._client())["entries"]["a"]["total_run_count"] >= 2,
        20,
        "runs of a",
    )
    old.close()
    count_a = state(app, old._client())["entries"]["a"]["total_run_count"]
    app.conf.beat_schedule = {"a": {"task": "t", "schedule": 60.0}, "c": {"task": "t", "schedule": 60.0}}
    new = scheduler_for(schedulers, app, url, "new:2")
    tick_until(new, lambda: new.is_leader, 20, "the new leader")
    doc = state(app, new._client())
    assert set(doc["entries"]) == {"a", "c"}
    assert doc["entries"]["a"]["total_run_count"] == count_a, "a lost its run count"
    assert doc["entries"]["c"]["total_run_count"] == 0
    assert new.schedule["a"].total_run_count == count_a
    assert new.schedule["a"].schedule.run_every == timedelta(seconds=60)


def test_interval_crontab_and_solar_entries_keep_their_state(etcd_url, redis_url, schedulers):
    pytest.importorskip("ephem", reason="solar schedules need ephem (celery[solar])")
    from celery.schedules import crontab, solar

    schedule = {
        "interval": {
            "task": "t",
            "schedule": timedelta(minutes=5),
            "args": (1, "x"),
            "kwargs": {"k": [1]},
            "options": {"expires": 60},
        },
        "cron": {"task": "t", "schedule": crontab(minute="*/15")},
        "solar": {"task": "t", "schedule": solar("sunset", 48.85, 2.35)},
    }
    app = make_app(etcd_url, redis_url, schedule)
    a = scheduler_for(schedulers, app, etcd_url, "a:1")
    tick_until(a, lambda: a.is_leader, 20, "a to lead")
    stored = state(app, a._client())["entries"]
    assert set(stored) == {"interval", "cron", "solar"}
    a.close()
    b = scheduler_for(schedulers, app, etcd_url, "b:2")
    tick_until(b, lambda: b.is_leader, 20, "b to lead")
    for name, entry in b.schedule.items():
        assert entry.last_run_at == a.schedule[name].last_run_at, name  # adopted, not restarted
        assert entry.is_due()[0] is False, name
    assert b.schedule["interval"].args == (1, "x") and b.schedule["interval"].kwargs == {"k": [1]}
    assert b.schedule["interval"].options == {"expires": 60}


def test_unusable_stored_state_is_ignored_not_fatal(etcd_url, redis_url, schedulers):
    url = etcd_url
    app = make_app(url, redis_url, {"a": {"task": "t", "schedule": 60.0}, "b": {"task": "t", "schedule": 60.0}})
    store = DocumentStore(connect(url), STATE_KIND)
    garbage = {
        "token": "x",
        "entries": {
            "a": {"last_run_at": "yesterday"},
            "b": {"last_run_at": "2020-01-01T00:00:00", "total_run_count": -1},
        },
    }
    assert store.put(beat_name(app), garbage, expect=None)
    s = scheduler_for(schedulers, app, url, "s:1")
    tick_until(s, lambda: s.is_leader, 20, "the leader")
    doc = state(app, s._client())
    assert doc["leader"] == "s:1"
    assert all(isinstance(e["total_run_count"], int) for e in doc["entries"].values())


def test_close_resigns_so_a_follower_takes_over_at_once(etcd_url, redis_url, schedulers):
    url = etcd_url
    app = make_app(url, redis_url, {"every": {"task": "t", "schedule": 0.2}}, ttl=60)
    a = scheduler_for(schedulers, app, url, "a:1")
    b = scheduler_for(schedulers, app, url, "b:2")
    tick_until(a, lambda: a.is_leader, 20, "a to lead")
    b.tick()
    a.close()
    a.close()  # celery beat closes twice on SIGTERM (handler, then the loop's finally)
    assert a.tick() > 0 and not a.is_leader
    tick_until(b, lambda: b.is_leader, 10, "b to take over long before the 60 s ttl")


# -- real processes ----------------------------------------------------------------------------------


class Beats(CeleryProcesses):
    """celery beat processes and a worker of tests.beatapp, and the runs they record."""

    def __init__(self, tmp: Path, etcd_url: str, redis_url: str, ttl: float, schedule: str = "every") -> None:
        tag = unique()
        self.prefix = url_prefix(etcd_url)
        self.redis = redis.Redis.from_url(redis_url)
        self.runs_key = f"runs-{tag}"
        env = dict(
            os.environ,
            PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            BEATAPP_BROKER=redis_url,
            BEATAPP_RUNS=self.runs_key,
            BEATAPP_QUEUE=f"beatapp-{tag}",
            BEATAPP_BEAT_TTL=str(ttl),
            BEATAPP_SCHEDULE=schedule,
            ETCDLOCK_URL=etcd_url,
            ETCDLOCK_PREFIX=self.prefix,
        )
        super().__init__(tmp, "tests.beatapp", env)
        self.beats: dict[str, subprocess.Popen[bytes]] = {}  # identity -> process
        self.others: list[subprocess.Popen[bytes]] = []

    def start_beat(self) -> str:
        args = [
            "beat",
            "-S",
            "celery_etcdlock.beat:LeaderScheduler",
            "-l",
            "info",
            "-s",
            str(self.tmp / f"unused-{unique()}"),
        ]
        proc = self.start(args, "beat")
        identity = f"{HOST}:{proc.pid}"
        self.beats[identity] = proc
        return identity

    def start_worker(self) -> None:
        args = ["worker", "-P", "solo", "-l", "warning", "--without-heartbeat", "--without-gossip", "--without-mingle"]
        self.others.append(self.start(args, "worker"))

    def log(self, identity: str) -> str:
        return self.output(self.beats[identity])

    def published(self, identity: str | None = None) -> list[tuple[str, str, float]]:
        """(entry, sender, wall time) of every message a beat published, from the beats' logs."""
        found = []
        for who in [identity] if identity else list(self.beats):
            for entry, sender, at in re.findall(r"PUBLISHED (\S+) (\S+) ([\d.]+)", self.log(who)):
                found.append((entry, sender, float(at)))
        return sorted(found, key=lambda p: p[2])

    def runs(self, entry: str = "every") -> list[dict[str, Any]]:
        runs = [json.loads(r) for r in self.redis.lrange(self.runs_key, 0, -1)]
        return sorted((r for r in runs if r["entry"] == entry), key=lambda r: r["sent_at"])

    def leader(self, timeout: float = 30) -> str:
        """The identity of the beat that sent the latest run (waiting for one)."""
        return wait_until(lambda: (self.runs() or [{}])[-1].get("sender"), timeout, "a first run")

    def runs_after(self, moment: float, entry: str = "every") -> list[dict[str, Any]]:
        return [r for r in self.runs(entry) if r["sent_at"] > moment]

    def settle(self) -> None:
        """Wait until the worker recorded every message the beats published."""
        wait_until(
            lambda: (
                len(self.runs("every")) + len(self.runs("cron"))
                >= len([p for p in self.published() if p[0] in ("every", "cron")])
            ),
            30,
            "the worker to catch up",
        )

    def check_no_doubles(self, entry: str = "every", interval: float = 1.0) -> list[dict[str, Any]]:
        runs = self.runs(entry)
        times = [r["sent_at"] for r in runs]
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        close = [(runs[i], runs[i + 1]) for i, g in enumerate(gaps) if g < interval / 2]
        assert not close, f"runs closer than half an interval: {close}"
        return runs

    def signal(self, identity: str, sig: int) -> None:
        self.beats[identity].send_signal(sig)


@pytest.fixture
def make_beats(tmp_path: Path) -> Iterator[Callable[..., Beats]]:
    made: list[Beats] = []

    def make(etcd_url: str, redis_url: str, ttl: float, schedule: str = "every") -> Beats:
        beats = Beats(tmp_path, etcd_url, redis_url, ttl, schedule)
        made.append(beats)
        return beats

    yield make
    for beats in made:
        beats.close()
        print(beats.dump())  # shown by pytest when the test failed


def start(
    make_beats: Callable[..., Beats], etcd_url: str, redis_url: str, n: int, ttl: float, schedule: str = "every"
) -> Beats:
    beats = make_beats(etcd_url, redis_url, ttl, schedule)
    for _ in range(n):
        beats.start_beat()
    beats.start_worker()
    return beats


@pytest.mark.slow
def test_two_beats_one_sender_once_a_second(etcd_url, redis_url, make_beats):
    beats = start(make_beats, etcd_url, redis_url, n=2, ttl=3)
    leader = beats.leader()
    first = beats.runs()[0]["sent_at"]
    wait_until(lambda: beats.runs_after(first + 8), 30, "8 s of runs")
    beats.settle()
    window = [r for r in beats.runs() if first <= r["sent_at"] <= first + 8]
    assert {r["sender"] for r in beats.runs()} == {leader}
    assert 7 <= len(window) <= 10, [r["sent_at"] - first for r in window]
    beats.check_no_doubles()
    follower = next(i for i in beats.beats if i != leader)
    assert beats.published(follower) == []
    assert "Sending due task" not in beats.log(follower)


@pytest.mark.slow
def test_sigkill_leader_another_takes_over_without_doubles(etcd_url, redis_url, make_beats):
    ttl = 2
    beats = start(make_beats, etcd_url, redis_url, n=3, ttl=ttl)
    leader = beats.leader()
    wait_until(lambda: len(beats.runs()) >= 3, 30, "3 runs")
    beats.signal(leader, signal.SIGKILL)
    killed_at = time.time()
    beats.beats[leader].wait(10)
    after = wait_until(lambda: beats.runs_after(killed_at), ttl + 15, "a run by the new leader")
    print(f"first run {after[0]['sent_at'] - killed_at:.2f}s after SIGKILL (ttl {ttl}s)")
    assert after[0]["sender"] != leader
    new_leader = after[0]["sender"]
    wait_until(lambda: len(beats.runs_after(killed_at)) >= 4, 30, "4 runs by the new leader")
    beats.settle()
    assert {r["sender"] for r in beats.runs_after(killed_at)} == {new_leader}
    beats.check_no_doubles()
    client = connect(etcd_url)
    try:
        [election] = [e for e in list_elections(client) if e.name.startswith("beat/")]
    finally:
        client.close()
    assert election.leader is not None and election.leader.holder == new_leader
    assert election.since is not None and election.changes == 1  # one take-over (the first election is none)


@pytest.mark.slow  # about 12 s a run (a paused leader's TTL, then its resumption)
def test_sigstop_leader_resumes_as_follower_and_sends_nothing(etcd_url, redis_url, make_beats):
    ttl = 2
    beats = start(make_beats, etcd_url, redis_url, n=2, ttl=ttl)
    leader = beats.leader()
    wait_until(lambda: len(beats.runs()) >= 2, 30, "2 runs")
    beats.signal(leader, signal.SIGSTOP)
    stopped_at = time.time()
    wait_until(
        lambda: [r for r in beats.runs_after(stopped_at) if r["sender"] != leader],
        ttl + 15,
        "the other beat to take over",
    )
    beats.signal(leader, signal.SIGCONT)
    resumed_at = time.time()
    wait_until(lambda: len(beats.runs_after(resumed_at)) >= 4, 30, "4 runs after the resume")
    beats.settle()
    assert [p for p in beats.published(leader) if p[2] >= resumed_at] == []
    assert {r["sender"] for r in beats.runs_after(resumed_at)} != {leader}
    wait_until(lambda: "stopped sending" in beats.log(leader), 10, "the resumed beat to log that it stopped")
    assert beats.beats[leader].poll() is None, "losing leadership must not be fatal"
    beats.check_no_doubles()


@pytest.mark.slow
def test_sigterm_leader_resigns_and_another_takes_over_at_once(etcd_url, redis_url, make_beats):
    ttl = 20  # a take-over well before the ttl can only come from resigning
    beats = start(make_beats, etcd_url, redis_url, n=2, ttl=ttl)
    leader = beats.leader()
    wait_until(lambda: len(beats.runs()) >= 2, 30, "2 runs")
    beats.signal(leader, signal.SIGTERM)
    termed_at = time.time()
    assert beats.beats[leader].wait(15) == 0
    after = wait_until(lambda: beats.runs_after(termed_at), ttl / 2, "a run by the new leader")
    print(f"first run {after[0]['sent_at'] - termed_at:.2f}s after SIGTERM (ttl {ttl}s)")
    assert after[0]["sender"] != leader
    assert "resigned leadership" in beats.log(leader)
    wait_until(lambda: len(beats.runs_after(termed_at)) >= 2, 30, "2 runs by the new leader")
    beats.settle()
    beats.check_no_doubles()


@pytest.mark.slow
def test_etcd_restart_sending_resumes_without_doubles(own_etcd: EtcdServer, redis_url, make_beats):
    ttl = 2
    beats = start(make_beats, own_etcd.url(prefix=f"/beat-{unique()}"), redis_url, n=2, ttl=ttl)
    leader = beats.leader()
    wait_until(lambda: len(beats.runs()) >= 2, 30, "2 runs")
    own_etcd.stop()
    down_at = time.time()
    wait_until(lambda: "stopped sending" in beats.log(leader), ttl + 15, "the leader to stop sending")
    stopped_at = time.time()
    own_etcd.start()
    up_at = time.time()
    wait_until(lambda: len(beats.runs_after(up_at)) >= 3, 60, "3 runs after etcd came back")
    beats.settle()
    # fail closed: nothing sent once the leader knew it could not record runs
    assert [r for r in beats.runs() if stopped_at <= r["sent_at"] <= up_at] == []
    assert [r for r in beats.runs() if down_at + 0.5 <= r["sent_at"] <= up_at] == []
    beats.check_no_doubles()


@pytest.mark.slow  # up to a minute: it waits for a minute boundary
@pytest.mark.parametrize("api", ["v2"])  # a minute boundary to wait for: once is enough
def test_crontab_run_due_during_failover_is_sent_exactly_once(etcd_url, redis_url, make_beats):
    ttl = 2
    beats = start(make_beats, etcd_url, redis_url, n=2, ttl=ttl, schedule="every,cron")
    leader = beats.leader()
    # kill the leader 1.5 s before a minute starts, so that the crontab run falls due with no leader up
    now = time.time()
    boundary = (int(now // 60) + 1) * 60
    if boundary - now < 5:
        boundary += 60
    wait_until(lambda: time.time() >= boundary - 1.5, 70, "1.5 s before the minute", interval=0.01)
    leader = beats.runs()[-1]["sender"]
    beats.signal(leader, signal.SIGKILL)
    killed_at = time.time()
    cron = wait_until(
        lambda: [r for r in beats.runs("cron") if r["sent_at"] >= boundary - 2], ttl + 20, "the crontab run"
    )
    wait_until(lambda: len(beats.runs_after(cron[0]["sent_at"])) >= 3, 30, "3 more runs of every")
    beats.settle()
    cron = [r for r in beats.runs("cron") if r["sent_at"] >= boundary - 2]
    print(
        f"SIGKILL {boundary - killed_at:.2f}s before the minute; crontab run sent "
        f"{cron[0]['sent_at'] - boundary:.2f}s after it by {cron[0]['sender']} (killed {leader})"
    )
    assert len(cron) == 1, cron
    if killed_at < boundary:  # the usual case: it fell due while nobody led
        assert cron[0]["sender"] != leader
    beats.check_no_doubles()


def _plain_beat(tmp_path: Path, env: dict[str, str], app: str, scheduler: str) -> tuple[subprocess.Popen[bytes], Path]:
    log = tmp_path / f"beat-{unique()}.log"
    with open(log, "wb") as out:
        proc = _children.popen(
            [CELERY, "-A", app, "beat", "-S", scheduler, "-l", "info", "-s", str(tmp_path / f"schedule-{unique()}")],
            cwd=ROOT, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    return proc, log


def test_a_beat_of_an_app_that_uses_the_package_warns_without_the_leader_scheduler(etcd_url, redis_url, tmp_path):
    """A second plain beat beside leader-elected ones would double-send every entry: it says so at its start."""
    env = {"BEATAPP_BROKER": redis_url, "ETCDLOCK_URL": etcd_url, "BEATAPP_QUEUE": f"q-{unique()}"}
    proc, log = _plain_beat(tmp_path, env, "tests.beatapp", "celery.beat:PersistentScheduler")
    try:
        wait_until(lambda: "every other beat host" in log.read_text(errors="replace"), 60, "the warning")
        text = log.read_text(errors="replace")
        assert "celery.beat.PersistentScheduler" in text and "-S celery_etcdlock.beat:LeaderScheduler" in text
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_beat_of_an_app_that_does_not_use_the_package_does_not_warn(redis_url, tmp_path):
    (tmp_path / "plainapp.py").write_text(f"import celery\napp = celery.Celery('plain', broker={redis_url!r})\n")
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}"}
    proc, log = _plain_beat(tmp_path, env, "plainapp", "celery.beat:PersistentScheduler")
    try:
        wait_until(lambda: "beat: Starting" in log.read_text(errors="replace"), 60, "the beat to start")
        proc.terminate()
        proc.wait(30)
        assert "LeaderScheduler" not in log.read_text(errors="replace")  # installed, but not used: no word
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- its log lines (issue 24.17) ----------------------------------------------------------------------


def _beat_records(caplog: Any) -> list[Any]:
    return [r for r in caplog.records if r.name.startswith("celery_etcdlock") and r.levelno >= logging.INFO]


def test_a_take_over_is_logged_once_and_etcd_down_as_a_sentence(etcd_url: str, caplog: Any) -> None:
    """The take-over was logged twice (by the election and the beat); with etcd down the beat logged a repr."""
    for logger in ("celery_etcdlock", "celery_etcdlock.beat.leader"):  # the beat logs through Celery's tree
        caplog.set_level(logging.DEBUG, logger=logger)
    app = make_app(etcd_url, "memory://", {"every": {"task": "t", "schedule": 3600}})
    scheduler = LeaderScheduler(app, identity="a:1")
    try:
        tick_until(scheduler, lambda: scheduler.is_leader, 30, "leadership")
        elected = [r for r in _beat_records(caplog) if "elected" in r.getMessage()]
        assert len(elected) == 1, [r.getMessage() for r in elected]
        client = connect(etcd_url)
        try:
            [election] = [e for e in list_elections(client) if e.name == f"beat/{beat_name(app)}"]
        finally:
            client.close()
        assert election.changes == 0  # `celery etcdlock leader`'s CHANGES counts take-overs; this was the first
    finally:
        scheduler.close()

    caplog.clear()
    down = make_app(f"etcd3://127.0.0.1:{free_port()}", "memory://", {})
    down.conf.etcdlock_retry_max_delay = 0.2
    scheduler = LeaderScheduler(down, identity="b:1")
    try:
        scheduler.tick()
        failed = lambda: [r for r in caplog.records if "could not campaign" in r.getMessage()]  # noqa: E731
        wait_until(lambda: len(failed()) >= 3, 30, "three failed campaigns")
        assert [r.levelno for r in failed()[:3]] == [logging.WARNING, logging.DEBUG, logging.DEBUG]
        assert "etcd unreachable at" in failed()[0].getMessage()
        assert "LeaderEvent(" not in caplog.text
    finally:
        scheduler.close()
