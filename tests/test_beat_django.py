"""LeaderDatabaseScheduler (django-celery-beat) and leader_only() against real servers.

Real PostgreSQL (a fresh cluster by initdb, tests/support/postgres_server.py) and SQLite,
a real Django project (tests/djangoproj) migrated once into a template database, real
``celery beat -S celery_etcdlock.beat:LeaderDatabaseScheduler`` processes and a worker.
The schedule is written with Django's ORM, in this process, as the admin would.

A double send is judged by each message's ``etcdlock_beat`` header, never by timing:
two runs of one entry sent after the same previous run (``after``), or with the same
run number, are one run sent twice. PostgreSQL logs every data-changing statement
with the client's application_name, which proves that followers write nothing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from celery.beat import PersistentScheduler, Scheduler

from celery_etcdlock import connect
from celery_etcdlock.beat import STATE_KIND, LeaderMixin, LeaderScheduler, leader_only
from celery_etcdlock.locks.store import DocumentStore
from tests.djangoproj.settings import database
from tests.support import wait_until
from tests.support.celery_processes import CELERY, ROOT, CeleryProcesses
from tests.support.postgres_server import PostgresServer
from tests.test_beat import make_app, queued, tick_until, url_prefix

pytest.importorskip("django_celery_beat", reason="the django extra (django-celery-beat) is not installed")

SCHEDULER = "celery_etcdlock.beat:LeaderDatabaseScheduler"
TEMPLATE = "djangoproj_migrated"


def unique() -> str:
    return uuid.uuid4().hex[:10]


# -- the database ------------------------------------------------------------------------------------


def migrate(url: str) -> None:
    env = {**os.environ, "DJANGOPROJ_DB": url, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "django", "migrate", "--settings=tests.djangoproj.settings", "-v", "0"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    server = PostgresServer()
    try:
        server.start()
        server.create_database(TEMPLATE)
        migrate(server.url(TEMPLATE))
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def orm(postgres: PostgresServer) -> Any:
    """Django set up in this process (the ORM the tests write the schedule with); models module."""
    import django
    from django.conf import settings

    if not settings.configured:
        settings.configure(
            INSTALLED_APPS=["django.contrib.contenttypes", "django_celery_beat"],
            DATABASES={"default": database(postgres.url(TEMPLATE))},
            USE_TZ=True,
            TIME_ZONE="UTC",
            DEFAULT_AUTO_FIELD="django.db.models.AutoField",
        )
        django.setup()
    from django_celery_beat import models

    return models


@pytest.fixture
def pg_url(postgres: PostgresServer, orm: Any) -> Iterator[str]:
    """A fresh migrated database of this test's own, which the ORM of this process now uses."""
    from django.db import connections

    name = f"t_{unique()}"
    url = postgres.create_database(name, template=TEMPLATE)
    connection = connections["default"]
    connection.close()
    connection.settings_dict.update(database(url))
    yield url
    connection.close()


def every(orm: Any, name: str, seconds: int = 1, **fields: Any) -> Any:
    interval, _ = orm.IntervalSchedule.objects.get_or_create(every=seconds, period="seconds")
    return orm.PeriodicTask.objects.create(
        name=name, task="djangoproj.record", interval=interval, kwargs=json.dumps({"entry": name}), **fields
    )


def every_minute(orm: Any, name: str) -> Any:
    cron, _ = orm.CrontabSchedule.objects.get_or_create(
        minute="*", hour="*", day_of_week="*", day_of_month="*", month_of_year="*", timezone="UTC"
    )
    return orm.PeriodicTask.objects.create(
        name=name, task="djangoproj.record", crontab=cron, kwargs=json.dumps({"entry": name})
    )


# -- beat processes ----------------------------------------------------------------------------------


class DjangoBeats(CeleryProcesses):
    """celery beat processes and a worker of tests.djangoproj on one database, and the runs they record."""

    def __init__(self, tmp: Path, db_url: str, etcd_url: str, redis_url: str, ttl: float) -> None:
        tag = unique()
        self.redis = redis.Redis.from_url(redis_url)
        self.runs_key = f"djruns-{tag}"
        env = dict(
            os.environ,
            PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            DJANGOPROJ_DB=db_url,
            BEATAPP_BROKER=redis_url,
            BEATAPP_RUNS=self.runs_key,
            BEATAPP_QUEUE=f"djq-{tag}",
            BEATAPP_BEAT_TTL=str(ttl),
            BEATAPP_BEAT_NAME=f"dj-{tag}",
            ETCDLOCK_URL=etcd_url,
            ETCDLOCK_PREFIX=url_prefix(etcd_url),
        )
        super().__init__(tmp, "tests.djangoproj", env)
        self.beat_name = f"dj-{tag}"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}  # application_name -> process

    def spawn(self, role: str, args: list[str], **env: str) -> str:
        app_name = f"{role}-{len(self.procs)}-{unique()[:4]}"
        self.procs[app_name] = self.start(args, app_name, DJANGOPROJ_APP_NAME=app_name, **env)
        return app_name

    def start_beat(self) -> str:
        return self.spawn("beat", ["beat", "-S", SCHEDULER, "-l", "info", "-s", str(self.tmp / f"unused-{unique()}")])

    def start_worker(self) -> str:
        args = ["worker", "-P", "solo", "-l", "warning", "--without-heartbeat", "--without-gossip", "--without-mingle"]
        return self.spawn("worker", args)

    def identity(self, app_name: str) -> str:
        import socket

        return f"{socket.gethostname()}:{self.procs[app_name].pid}"

    def log(self, app_name: str) -> str:
        return self.output(self.procs[app_name])

    def runs(self, entry: str | None = None) -> list[dict[str, Any]]:
        """Every run the worker recorded, in the order the beats published them (one queue, a solo worker)."""
        runs = [json.loads(r) for r in self.redis.lrange(self.runs_key, 0, -1)]
        return [r for r in runs if entry is None or r["entry"] == entry]

    def senders(self, entry: str | None = None) -> list[str]:
        return [r["beat"]["sender"] for r in self.runs(entry)]

    def check_each_run_once(self, entry: str) -> list[dict[str, Any]]:
        """No two runs of ``entry`` sent after the same previous run, nor with the same run number."""
        runs = self.runs(entry)
        assert all(r["beat"] and r["beat"]["entry"] == entry for r in runs), runs
        afters = [r["beat"]["after"] for r in runs]
        numbers = [r["beat"]["run"] for r in runs]
        assert len(set(afters)) == len(afters), f"{entry}: a run sent twice (one 'after'): {runs}"
        assert len(set(numbers)) == len(numbers), f"{entry}: a run sent twice (one run number): {runs}"
        return runs


@pytest.fixture
def make_beats(tmp_path: Path) -> Iterator[Callable[..., DjangoBeats]]:
    made: list[DjangoBeats] = []

    def make(db_url: str, etcd_url: str, redis_url: str, ttl: float = 3) -> DjangoBeats:
        beats = DjangoBeats(tmp_path, db_url, etcd_url, redis_url, ttl)
        made.append(beats)
        return beats

    yield make
    for beats in made:
        beats.close()
        print(beats.dump())  # shown by pytest when the test failed


def leader_of(beats: DjangoBeats, names: list[str], timeout: float = 60) -> str:
    sender = wait_until(lambda: (beats.senders() or [None])[-1], timeout, "a first run")
    return next(n for n in names if beats.identity(n) == sender)


# -- wrapping ------------------------------------------------------------------------------------------


class RedBeatScheduler(Scheduler):
    """Named as RedBeat's class is: leader_only() refuses it by its qualified name."""


RedBeatScheduler.__module__ = "redbeat.schedulers"


def test_leader_only_refuses_what_it_cannot_wrap() -> None:
    with pytest.raises(TypeError, match="celery.beat.Scheduler subclass"):
        leader_only(dict)
    with pytest.raises(TypeError, match="celery.beat.Scheduler subclass"):
        leader_only("celery.beat:PersistentScheduler")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="leader-only already"):
        leader_only(LeaderScheduler)
    with pytest.raises(TypeError, match="leader-only already"):
        leader_only(leader_only(PersistentScheduler))
    with pytest.raises(TypeError, match="RedBeat takes a lock of its own"):
        leader_only(type("MyRedBeat", (RedBeatScheduler,), {}))
    wrapped = leader_only(PersistentScheduler)
    assert issubclass(wrapped, LeaderMixin) and issubclass(wrapped, PersistentScheduler)
    assert wrapped.__name__ == "LeaderPersistentScheduler" and wrapped.elects_a_leader


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env={**clean, "PYTHONPATH": str(ROOT), **env},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_without_the_extra_or_django_settings_the_import_error_says_what_to_do() -> None:
    hidden = "import sys; sys.modules['django_celery_beat'] = None\n"
    done = _python(hidden + "from celery_etcdlock.beat import LeaderDatabaseScheduler")
    assert "ImportError" in done.stderr and "pip install 'celery-etcdlock[django]'" in done.stderr, done.stderr
    done = _python("from celery_etcdlock.beat import LeaderScheduler, leader_only; print('OK')")
    assert done.stdout.strip() == "OK" and "django" not in done.stderr, done.stderr  # the rest never needs Django
    done = _python("from celery_etcdlock.beat import LeaderDatabaseScheduler")
    assert "Django is not configured: set DJANGO_SETTINGS_MODULE" in done.stderr, done.stderr


def _beat_refused(tmp_path: Path, app: str, **env: str) -> str:
    """Run ``celery -A app beat -S LeaderDatabaseScheduler``, expect the start refused in one line; its stderr."""
    clean = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    path = os.pathsep.join([env.pop("PYTHONPATH", ""), str(tmp_path), str(ROOT)]).lstrip(os.pathsep)
    done = subprocess.run(
        [CELERY, "-A", app, "beat", "-S", SCHEDULER, "-s", str(tmp_path / "unused")],
        cwd=ROOT, env={**clean, "PYTHONPATH": path, "BEATAPP_BROKER": "redis://127.0.0.1:1/0", **env},
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 78, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("celery_etcdlock: the beat does not start: "), done.stderr
    return lines[0]


def test_celery_beat_without_the_extra_exits_78_with_one_line_saying_what_to_install(tmp_path: Path) -> None:
    # a django_celery_beat that fails to import, first on the path: a real import failure, as when it is absent
    (shadow := tmp_path / "shadow" / "django_celery_beat").mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'django_celery_beat'\", name='django_celery_beat')\n"
    )
    line = _beat_refused(tmp_path, "tests.beatapp", PYTHONPATH=str(shadow.parent))
    assert "needs django-celery-beat, which is not installed: pip install 'celery-etcdlock[django]'" in line
    assert "add 'django_celery_beat' to INSTALLED_APPS" in line
    (shadow / "__init__.py").write_text("raise ImportError('broken on purpose')\n")
    line = _beat_refused(tmp_path, "tests.beatapp", PYTHONPATH=str(shadow.parent))
    assert "does not import (ImportError: broken on purpose): pip install 'celery-etcdlock[django]'" in line
    # as the module path, too
    done = subprocess.run(
        [CELERY, "-A", "tests.beatapp", "beat", "-S", "celery_etcdlock.beat.django:LeaderDatabaseScheduler"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow.parent), str(ROOT)])},
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 78 and "Traceback" not in done.stderr and "broken on purpose" in done.stderr, done.stderr


def test_celery_beat_with_django_not_configured_exits_78_with_one_line_saying_what_to_set(tmp_path: Path) -> None:
    line = _beat_refused(tmp_path, "tests.beatapp")  # no DJANGO_SETTINGS_MODULE anywhere
    assert "Django is not configured: set DJANGO_SETTINGS_MODULE in the Celery app module" in line
    assert "django.setup()" in line
    # set after the app is made (Celery's Django fix-up is not on), to a module that is not there
    (tmp_path / "lateproj.py").write_text(
        "import os\nfrom celery import Celery\napp = Celery('lateproj')\n"
        "os.environ['DJANGO_SETTINGS_MODULE'] = 'nosuchproj.settings'\n"
    )
    line = _beat_refused(tmp_path, "lateproj")
    assert "Django's setup failed (DJANGO_SETTINGS_MODULE='nosuchproj.settings'): ModuleNotFoundError" in line
    # configured, without django_celery_beat in INSTALLED_APPS
    (tmp_path / "bareproj_settings.py").write_text(
        "SECRET_KEY = 't'\nINSTALLED_APPS = ['django.contrib.contenttypes']\nUSE_TZ = True\n"
        "DATABASES = {'default': {'ENGINE': 'django.db.backends.sqlite3', 'NAME': ':memory:'}}\n"
    )
    line = _beat_refused(tmp_path, "tests.beatapp", DJANGO_SETTINGS_MODULE="bareproj_settings")
    assert "add 'django_celery_beat' to INSTALLED_APPS" in line


def _beat_once(db_url: str, etcd_url: str, redis_url: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "DJANGOPROJ_DB": db_url,
        "BEATAPP_BROKER": redis_url,
        "ETCDLOCK_URL": etcd_url,
        "ETCDLOCK_PREFIX": url_prefix(etcd_url),
    }
    return subprocess.run(
        [CELERY, "-A", "tests.djangoproj", "beat", "-S", SCHEDULER, "-s", str(tmp_path / "unused")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("api", ["v3"])
def test_a_database_that_is_unreachable_or_not_migrated_stops_the_beat_with_one_line(
    api, postgres, etcd_url, redis_url, tmp_path
):
    down = f"postgresql://postgres@127.0.0.1:{postgres.port + 1 if postgres.port < 65000 else 1}/nothing"
    done = _beat_once(down, etcd_url, redis_url, tmp_path)
    assert done.returncode != 0
    assert "celery-etcdlock: beat cannot start: the database 'default' (postgresql) does not answer" in done.stderr
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    postgres.create_database(empty := f"e_{unique()}")
    done = _beat_once(postgres.url(empty), etcd_url, redis_url, tmp_path)
    assert done.returncode != 0
    assert "run `python manage.py migrate django_celery_beat`" in done.stderr, done.stderr
    assert "Traceback" not in done.stdout + done.stderr, done.stderr


# -- leader_only(PersistentScheduler), in process ----------------------------------------------------------


@pytest.mark.parametrize("api", ["v3"])
def test_leader_only_persistent_scheduler_follower_opens_no_file_and_takes_over_without_repeats(
    api, etcd_url, redis_url, tmp_path
):
    LeaderPersistent = leader_only(PersistentScheduler)
    app = make_app(
        etcd_url, redis_url, {"often": {"task": "t", "schedule": 0.2}, "hourly": {"task": "t", "schedule": 3600.0}}
    )
    made = []
    try:
        a = LeaderPersistent(app, schedule_filename=str(tmp_path / "a"), etcd_client=connect(etcd_url), identity="a:1")
        b = LeaderPersistent(app, schedule_filename=str(tmp_path / "b"), etcd_client=connect(etcd_url), identity="b:2")
        made += [a, b]
        tick_until(a, lambda: queued(app) >= 3, 20, "a to send")
        b.tick()
        assert not b.is_leader and not list(tmp_path.glob("b*")), "a follower opened its schedule file"
        count, last = a.schedule["often"].total_run_count, a.schedule["often"].last_run_at
        a.close()  # syncs its file, resigns
        assert list(tmp_path.glob("a*"))
        sent = queued(app)
        tick_until(b, lambda: b.is_leader, 20, "b to take over")
        # b's own file is new: its entries took the runs etcd recorded, not a fresh start
        assert b.schedule["often"].total_run_count >= count
        assert b.schedule["often"].last_run_at >= last
        assert not b.schedule["hourly"].is_due()[0]
        tick_until(b, lambda: queued(app) > sent, 20, "b to send often")
        assert list(tmp_path.glob("b*")), "the new leader opened its own schedule file"
    finally:
        for s in made:
            s.close()


# -- LeaderDatabaseScheduler processes on PostgreSQL ----------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("api", ["v3"])
def test_two_beats_one_sender_followers_write_nothing_and_database_edits_are_picked_up(
    api, postgres, pg_url, orm, etcd_url, redis_url, make_beats
):
    every(orm, "every")
    every(orm, "doomed")
    beats = make_beats(pg_url, etcd_url, redis_url)
    names = [beats.start_beat(), beats.start_beat()]
    beats.start_worker()
    leader = leader_of(beats, names)
    follower = next(n for n in names if n != leader)
    wait_until(lambda: len(beats.runs("every")) >= 3, 30, "3 runs of every")
    # the admin's edit, in one transaction: add an entry, disable one, delete another
    from django.db import transaction

    with transaction.atomic():
        every(orm, "added")
        orm.PeriodicTask.objects.filter(name="every").update(enabled=False)
        orm.PeriodicTask.objects.get(name="doomed").delete()
        # .update() sends no signal: tell the change tracker, as the admin's save() does
        orm.PeriodicTasks.update_changed()
    edited_at = time.time()
    wait_until(lambda: beats.runs("added"), 30, "a run of the added entry")
    print(f"added entry first sent {beats.runs('added')[0]['ran_at'] - edited_at:.2f}s after the edit (ran_at)")
    wait_until(lambda: len(beats.runs("added")) >= 3, 30, "3 runs of added")
    runs = beats.runs()
    first_added = next(i for i, r in enumerate(runs) if r["entry"] == "added")
    assert not [r for r in runs[first_added:] if r["entry"] in ("every", "doomed")], "sent after it was disabled"
    assert set(beats.senders()) == {beats.identity(leader)}
    for entry in ("every", "doomed", "added"):
        beats.check_each_run_once(entry)
    assert postgres.writes_by(leader), "the leader's writes are not in the log: the check would prove nothing"
    assert postgres.writes_by(follower) == [], "a follower wrote to the database"
    assert "Sending due task" not in beats.log(follower)


@pytest.mark.slow
@pytest.mark.parametrize("api", ["v3"])
def test_sigkill_leader_each_run_once_with_a_stale_last_run_at_and_a_crontab_due_in_the_failover(
    api, postgres, pg_url, orm, etcd_url, redis_url, make_beats
):
    ttl = 2
    every(orm, "every")
    every_minute(orm, "cron")
    beats = make_beats(pg_url, etcd_url, redis_url, ttl=ttl)
    names = [beats.start_beat(), beats.start_beat()]
    beats.start_worker()
    leader_of(beats, names)
    # kill the leader 1.5 s before a minute starts, so that the crontab run falls due with no leader up
    boundary = (int(time.time() // 60) + 1) * 60
    if boundary - time.time() < 8:
        boundary += 60
    wait_until(lambda: time.time() >= boundary - 1.5, 75, "1.5 s before the minute", interval=0.01)
    old = next(n for n in names if beats.identity(n) == beats.senders()[-1])
    beats.procs[old].send_signal(signal.SIGKILL)
    beats.procs[old].wait(10)
    killed_runs = len(beats.runs("every"))
    # DatabaseScheduler writes last_run_at every 3 minutes: what the database says now is stale
    orm_every = orm.PeriodicTask.objects.get(name="every")
    stored = DocumentStore(connect(etcd_url), STATE_KIND).get(beats.beat_name)
    assert stored is not None
    recorded = datetime.fromisoformat(stored.value["entries"]["every"]["last_run_at"])
    assert orm_every.last_run_at is None or orm_every.last_run_at < recorded - timedelta(seconds=0.5), (
        "the database was not stale: the test would not prove the stale case"
    )
    new = next(n for n in names if n != old)
    # a slow start may have sent the slot before the test's minute too (due while no beat was up): count this one
    in_failover = lambda: [r for r in beats.runs("cron") if r["beat"]["sender"] == beats.identity(new)]  # noqa: E731
    wait_until(in_failover, ttl + 30, "the crontab run")
    wait_until(lambda: len(beats.runs("every")) >= killed_runs + 4, 30, "4 runs by the new leader")
    assert len(in_failover()) == 1, beats.runs("cron")
    assert [r for r in beats.runs("cron") if r["beat"]["sender"] == beats.identity(old)] == beats.runs("cron")[:-1]
    beats.check_each_run_once("cron")
    runs = beats.check_each_run_once("every")
    after_kill = runs[killed_runs:]
    assert {r["beat"]["sender"] for r in after_kill} == {beats.identity(new)}
    # the new leader continued from the run etcd recorded, not from the database's stale last_run_at
    assert datetime.fromisoformat(after_kill[0]["beat"]["after"]) == recorded
    assert after_kill[0]["beat"]["run"] == stored.value["entries"]["every"]["total_run_count"] + 1
    assert beats.procs[new].poll() is None


# -- SQLite ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("api", ["v2"])
def test_sqlite_two_beats_one_sender_each_run_once(api, etcd_url, redis_url, make_beats, tmp_path):
    db = tmp_path / "db.sqlite3"
    url = f"sqlite:///{db}"
    migrate(url)
    code = (
        "import django, json; django.setup(); from django_celery_beat.models import IntervalSchedule, PeriodicTask; "
        "i = IntervalSchedule.objects.create(every=1, period='seconds'); "
        "PeriodicTask.objects.create(name='every', task='djangoproj.record', interval=i, "
        "kwargs=json.dumps({'entry': 'every'}))"
    )
    done = _python(code, DJANGOPROJ_DB=url, DJANGO_SETTINGS_MODULE="tests.djangoproj.settings")
    assert done.returncode == 0, done.stderr
    beats = make_beats(url, etcd_url, redis_url)
    names = [beats.start_beat(), beats.start_beat()]
    beats.start_worker()
    leader = leader_of(beats, names)
    wait_until(lambda: len(beats.runs("every")) >= 4, 30, "4 runs")
    assert set(beats.senders()) == {beats.identity(leader)}
    beats.check_each_run_once("every")


# -- a deposed leader that leads again reloads the database, in process --------------------------------


def sent_headers(app: Any) -> list[dict[str, Any]]:
    """The ``etcdlock_beat`` header of every message published to the app's queue, oldest first."""
    raw = redis.Redis.from_url(app.conf.broker_url).lrange(app.conf.task_default_queue, 0, -1)
    return [json.loads(m)["headers"]["etcdlock_beat"] for m in reversed(raw)]  # LPUSHed: newest first


@pytest.mark.slow
@pytest.mark.parametrize("api", ["v3"])
def test_a_deposed_leader_that_leads_again_reloads_the_database_and_sends_no_run_twice(
    api, pg_url, orm, etcd_url, redis_url
):
    from celery_etcdlock.beat.django import LeaderDatabaseScheduler

    every(orm, "every")
    app = make_app(etcd_url, redis_url, {}, ttl=30)
    a = LeaderDatabaseScheduler(app, etcd_client=connect(etcd_url), identity="a:1")
    b = LeaderDatabaseScheduler(app, etcd_client=connect(etcd_url), identity="b:2")
    try:
        tick_until(a, lambda: queued(app) >= 2, 20, "a to send")
        b.tick()
        assert connect(etcd_url).backend.delete_entry(a._election.fence_entry)  # a is deposed
        tick_until(b, lambda: b.is_leader, 20, "b to take over")
        sent = queued(app)
        tick_until(b, lambda: queued(app) >= sent + 3, 20, "b to send 3 runs")
        a.tick()
        assert not a.is_leader
        # b is deposed without writing its last runs to the database (it syncs every 3 minutes)
        assert connect(etcd_url).backend.delete_entry(b._election.fence_entry)
        stale = orm.PeriodicTask.objects.get(name="every").last_run_at
        last_by_b = sent_headers(app)[-1]
        tick_until(a, lambda: a.is_leader, 20, "a to lead again")
        b.tick()
        tick_until(a, lambda: sent_headers(app)[-1]["sender"] == "a:1", 20, "a to send again")
        headers = sent_headers(app)
        afters = [h["after"] for h in headers]
        assert len(set(afters)) == len(afters), f"a run sent twice: {headers}"
        first_again = next(h for h in headers[headers.index(last_by_b) :] if h["sender"] == "a:1")
        assert first_again["run"] == last_by_b["run"] + 1, (first_again, last_by_b, stale)
        assert stale < datetime.fromisoformat(first_again["after"]), "the database was not stale"
    finally:
        a.close()
        b.close()
