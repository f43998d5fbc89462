"""Prometheus metrics (celery_etcdlock.metrics) against a real etcd, real tasks and a real prefork worker.

Each in-process test enables the metrics on a registry of its own and reads it
back with ``get_sample_value`` and the text exposition, as a scrape would.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import celery
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from celery_etcdlock import BackendUnavailable, Election, Mutex, RWLock, Semaphore, TaskLocked, connect, metrics
from celery_etcdlock.settings import enable_metrics
from celery_etcdlock.tasks import singleton_task
from tests import taskapp
from tests.procs import Proc
from tests.support import RedisServer, free_port, wait_until


@pytest.fixture
def registry() -> Iterator[CollectorRegistry]:
    """The metrics on, on a fresh registry; off again afterwards (whoever turned them on before)."""
    metrics.disable()
    fresh = CollectorRegistry()
    metrics.enable(registry=fresh)
    yield fresh
    metrics.disable()


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    """The sample ``celery_etcdlock_<name>{labels}``, None if there is no such series."""
    return registry.get_sample_value(f"celery_etcdlock_{name}", labels)


def lock_labels(name: str, kind: str = "mutex", task: str = "") -> dict[str, str]:
    return {"kind": kind, "lock": name, "task": task}


def exposition(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


# -- locks ------------------------------------------------------------------------------------------


def test_acquisitions_by_outcome_wait_and_hold_times_and_locks_held(client: Any, registry: CollectorRegistry) -> None:
    name = f"m-{uuid.uuid4().hex[:6]}"
    labels = lock_labels(name)
    holder = Mutex(client, name, ttl=5)
    assert holder.acquire()
    assert value(registry, "locks_held", **labels) == 1
    assert not Mutex(client, name, ttl=5).acquire(blocking=False)
    assert not Mutex(client, name, ttl=5).acquire(timeout=0.2)
    waiter = Mutex(client, name, ttl=5)
    got: list[bool] = []
    thread = threading.Thread(target=lambda: got.append(waiter.acquire(timeout=30)))
    thread.start()
    wait_until(lambda: len(holder.holders()) == 1 and waiter.conflict is not None, 10, "the waiter to queue")
    holder.release()
    thread.join(30)
    assert got == [True]
    assert value(registry, "locks_held", **labels) == 1  # the waiter's now
    waiter.release()

    assert value(registry, "acquisitions_total", **labels, outcome="acquired") == 2
    assert value(registry, "acquisitions_total", **labels, outcome="refused") == 1
    assert value(registry, "acquisitions_total", **labels, outcome="timed_out") == 1
    assert value(registry, "locks_held", **labels) == 0
    assert value(registry, "wait_seconds_count", **labels) == 2
    assert value(registry, "hold_seconds_count", **labels) == 2
    assert (value(registry, "wait_seconds_sum", **labels) or 0) > 0  # the waiter waited for the release
    assert value(registry, "wait_seconds_bucket", **labels, le="+Inf") == 2


def test_every_kind_of_lock_is_labelled_with_its_kind(client: Any, registry: CollectorRegistry) -> None:
    rw, sem = f"rw-{uuid.uuid4().hex[:6]}", f"sem-{uuid.uuid4().hex[:6]}"
    with RWLock(client, rw, ttl=5).read():
        assert value(registry, "locks_held", **lock_labels(rw, "read")) == 1
    with RWLock(client, rw, ttl=5).write():
        assert value(registry, "locks_held", **lock_labels(rw, "write")) == 1
    with Semaphore(client, sem, limit=2, ttl=5), Semaphore(client, sem, limit=2, ttl=5):
        assert value(registry, "locks_held", **lock_labels(sem, "semaphore")) == 2
    for kind, name in (("read", rw), ("write", rw), ("semaphore", sem)):
        assert value(registry, "locks_held", **lock_labels(name, kind)) == 0
        assert (value(registry, "hold_seconds_count", **lock_labels(name, kind)) or 0) >= 1


def test_lost_locks_are_counted_by_cause(etcd_url: str, registry: CollectorRegistry) -> None:
    from celery_etcdlock.cli import force_release

    client = connect(etcd_url)
    lost = threading.Event()
    deleted = Mutex(client, "deleted", ttl=5, on_lost=lambda lock: lost.set())
    assert deleted.acquire(timeout=5)
    assert force_release(client, "deleted") == [deleted.token]
    assert lost.wait(10)
    closed = Mutex(client, "closed", ttl=5)
    assert closed.acquire(timeout=5)
    client.close()
    assert not closed.held
    for cause, name in (("deleted", "deleted"), ("closed", "closed")):
        assert value(registry, "locks_lost_total", **lock_labels(name), cause=cause) == 1
        assert value(registry, "locks_held", **lock_labels(name)) == 0
        assert value(registry, "hold_seconds_count", **lock_labels(name)) == 1
    deleted.release()
    closed.release()  # a lost lock's release is not counted again
    assert value(registry, "hold_seconds_count", **lock_labels("deleted")) == 1


# -- elections and the beat -------------------------------------------------------------------------


def test_leadership_gauge_and_changes(client: Any, registry: CollectorRegistry) -> None:
    name = f"svc-{uuid.uuid4().hex[:6]}"
    a = Election(client, name, identity="a", ttl=5)
    assert a.campaign(timeout=5)
    assert value(registry, "leader", election=name) == 1
    a.resign()
    assert value(registry, "leader", election=name) == 0
    assert value(registry, "leadership_changes_total", election=name, change="elected") == 1
    assert value(registry, "leadership_changes_total", election=name, change="resigned") == 1
    assert "\ncelery_etcdlock_acquisitions_total{" not in exposition(registry)  # leading is not locking


def test_a_standby_candidate_exports_leader_0(client: Any) -> None:
    """Issue 24.15: a standby beat exported no celery_etcdlock_leader sample at all, though the docs say 0."""
    name = f"standby-{uuid.uuid4().hex[:6]}"
    metrics.disable()
    leader = Election(client, name, identity="a", ttl=5)
    assert leader.campaign(timeout=5)  # while the metrics are off: this process's gauge sees only the standby
    registry = CollectorRegistry()
    metrics.enable(registry=registry)
    standby = Election(client, name, identity="b", ttl=5)
    try:
        standby.start()
        wait_until(lambda: value(registry, "leader", election=name) is not None, 10, "the standby's sample")
        assert value(registry, "leader", election=name) == 0
        leader.resign()
        wait_until(lambda: value(registry, "leader", election=name) == 1, 10, "the standby to lead")
    finally:
        standby.stop()
        leader.resign()
        metrics.disable()


def test_a_leader_scheduler_turns_the_metrics_on_as_the_settings_say(etcd_url: str, redis_url: str) -> None:
    from celery_etcdlock.beat import LeaderScheduler

    metrics.disable()
    registry = CollectorRegistry()
    name = f"metrics-{uuid.uuid4().hex[:6]}"
    app = celery.Celery("inproc-beat", broker=redis_url, set_as_current=False)
    app.conf.update(
        task_default_queue=f"q-{name}", task_ignore_result=True, etcdlock_url=etcd_url,
        etcdlock_prefix=parse_qs(urlsplit(etcd_url).query)["prefix"][0], etcdlock_beat_name=name,
        beat_schedule={"every": {"task": "t", "schedule": 0.2}}, etcdlock_metrics_registry=registry,
    )  # fmt: skip
    scheduler = LeaderScheduler(app, identity="a:1")
    try:
        assert metrics.enabled()
        sent = lambda: value(registry, "beat_runs_sent_total", beat=name, entry="every") or 0  # noqa: E731
        wait_until(lambda: scheduler.tick() is not None and sent() >= 3, 30, "3 sends")
        assert value(registry, "leader", election=f"beat/{name}") == 1
        scheduler.close()
        assert value(registry, "leader", election=f"beat/{name}") == 0
        assert value(registry, "leadership_changes_total", election=f"beat/{name}", change="resigned") == 1
    finally:
        scheduler.close()
        metrics.disable()


# -- tasks: labels carry the task name, never argument values -------------------------------------------

app = celery.Celery("metrics-inproc", set_as_current=False)
app.conf.update(etcdlock_ttl=5, etcdlock_retry_max_delay=5)


@singleton_task(app=app, bind=True, key=["customer_id"], on_conflict="skip")
def sync_customer(self: Any, customer_id: str) -> str:
    return "ran"


@singleton_task(app=app, bind=True, key=["customer_id"], on_conflict="raise")
def charge_customer(self: Any, customer_id: str) -> str:
    return "ran"


def test_a_keyed_task_makes_one_series_per_task_and_no_customer_id_shows(
    etcd_url: str, client: Any, registry: CollectorRegistry
) -> None:
    app.conf.update(etcdlock_url=etcd_url, etcdlock_prefix=parse_qs(urlsplit(etcd_url).query)["prefix"][0])
    customers = [f"cust{uuid.uuid4().hex[:12]}" for _ in range(25)]
    for customer in customers:
        assert sync_customer(customer) == "ran"
    busy = customers[0]
    for task in (sync_customer, charge_customer):  # as a run of it elsewhere holds its lock
        other_run = {"task_id": "other", "task": task.name, "hostname": "elsewhere"}
        with Mutex(client, task.lock_name_for((busy,)), ttl=5, data=other_run):
            if task is sync_customer:
                assert sync_customer(busy) is None  # skipped
            else:
                with pytest.raises(TaskLocked, match="held by"):
                    charge_customer(busy)

    task = sync_customer.name
    labels = lock_labels(task, task=task)
    assert value(registry, "acquisitions_total", **labels, outcome="acquired") == 25 + 1
    assert value(registry, "acquisitions_total", **labels, outcome="skipped") == 1
    assert value(registry, "acquisitions_total", **labels, outcome="refused") is None  # the skip counts once
    assert value(registry, "task_conflicts_total", task=task, on_conflict="skip") == 1
    assert value(registry, "hold_seconds_count", **labels) == 25 + 1  # with the other run's
    charge = lock_labels(charge_customer.name, task=charge_customer.name)
    assert value(registry, "acquisitions_total", **charge, outcome="refused") == 1
    assert value(registry, "task_conflicts_total", task=charge_customer.name, on_conflict="raise") == 1

    text = exposition(registry)
    leaked = [c for c in customers if c in text]
    assert not leaked, f"argument values in the metrics: {leaked}"
    series = [line for line in text.splitlines() if line.startswith("celery_etcdlock_hold_seconds_count")]
    assert series == [
        f'celery_etcdlock_hold_seconds_count{{kind="mutex",lock="{t}",task="{t}"}} {n}'
        for t, n in ((sync_customer.name, 26.0), (charge_customer.name, 1.0))
    ]


# -- etcd retries and failures -------------------------------------------------------------------------


def test_retries_and_failures_are_counted_by_endpoint_without_credentials(registry: CollectorRegistry) -> None:
    port = free_port()  # nobody listens there
    client = connect(f"etcd3://alice:s3cret-pw@127.0.0.1:{port}?retry_max_delay=0.5")
    try:
        with pytest.raises(BackendUnavailable):
            Mutex(client, "unreachable", ttl=5).acquire(timeout=1)
    finally:
        client.close()
    endpoint = f"http://127.0.0.1:{port}"
    assert (value(registry, "etcd_retries_total", endpoint=endpoint) or 0) >= 1
    assert value(registry, "etcd_failures_total", endpoint=endpoint) == 1
    text = exposition(registry)
    assert "s3cret-pw" not in text and "alice" not in text


@pytest.mark.parametrize(
    ("endpoint", "label"),
    [
        ("http://127.0.0.1:2379", "http://127.0.0.1:2379"),
        ("https://bob:hunter2@etcd-1:2379", "https://etcd-1:2379"),
        ("http://[::1]:2379", "http://[::1]:2379"),
        ("not a url", "unknown"),
        (None, "unknown"),
    ],
)
def test_an_endpoint_label_never_carries_credentials(endpoint: str | None, label: str) -> None:
    assert metrics._endpoint_label(endpoint) == label


# -- turning them on and off -----------------------------------------------------------------------------


def test_enable_moves_the_metrics_to_another_registry_and_disable_unregisters(client: Any) -> None:
    metrics.disable()
    first, second = CollectorRegistry(), CollectorRegistry()
    try:
        metrics.enable(registry=first)
        metrics.enable(registry=first)  # again: nothing changes
        with Mutex(client, "moved", ttl=5):
            pass
        metrics.enable(registry=second)
        assert "\ncelery_etcdlock_" not in exposition(first)
        assert value(second, "acquisitions_total", **lock_labels("moved"), outcome="acquired") == 1  # kept
        taken = CollectorRegistry()  # where another copy of them is registered already
        taken.register(metrics._metrics.acquisitions)  # type: ignore[union-attr]
        with pytest.raises(ValueError, match="cannot be registered"):
            metrics.enable(registry=taken)
        assert value(second, "acquisitions_total", **lock_labels("moved"), outcome="acquired") == 1  # stayed
    finally:
        metrics.disable()
    assert "\ncelery_etcdlock_" not in exposition(second)
    assert not metrics.enabled()


def test_bad_metrics_settings_are_named() -> None:
    bad = celery.Celery("bad-metrics", set_as_current=False)
    bad.conf.etcdlock_metrics = "yes"
    with pytest.raises(TypeError, match="etcdlock_metrics must be True or False"):
        enable_metrics(bad)
    bad.conf.etcdlock_metrics = True
    bad.conf.etcdlock_metrics_registry = "my-registry"
    with pytest.raises(TypeError, match="etcdlock_metrics_registry: registry must be a prometheus_client"):
        enable_metrics(bad)
    assert not metrics.enabled()


NOTHING_LISTENS = """
import sys
{prelude}
import celery
from celery_etcdlock import Mutex, connect, observe
from celery_etcdlock.settings import enable_metrics
app = celery.Celery("x", set_as_current=False)
app.conf.etcdlock_metrics = {setting}
print("enabled", enable_metrics(app))
client = connect({url!r})
with Mutex(client, "quiet", ttl=5) as lock:
    assert lock.held
from celery_etcdlock import tasks  # the Celery layer: its signals listen, the metrics do not
print("metrics listen", any(type(s).__name__ == "_Metrics" for s in observe._subscribers))
print("imported", "prometheus_client" in sys.modules)
"""

NOT_INSTALLED = """
class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "prometheus_client":
            raise ModuleNotFoundError("No module named 'prometheus_client'", name=name)
        return None
sys.meta_path.insert(0, NotInstalled())
"""


@pytest.mark.slow_but_newest
@pytest.mark.parametrize(
    ("prelude", "setting"), [(NOT_INSTALLED, "True"), ("", "False")], ids=["not-installed", "turned-off"]
)
def test_without_the_extra_or_turned_off_nothing_is_imported_and_nothing_listens(
    etcd_url: str, prelude: str, setting: str
) -> None:
    code = NOTHING_LISTENS.format(prelude=prelude, setting=setting, url=etcd_url)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.split("\n")[:3] == ["enabled False", "metrics listen False", "imported False"], (
        done.stdout + done.stderr
    )


def test_primitives_alone_never_import_prometheus_client_nor_report(etcd_url: str) -> None:
    code = f"""
import sys
from celery_etcdlock import Mutex, connect, observe
with Mutex(connect({etcd_url!r}), "alone", ttl=5):
    pass
print(observe.listening(), "prometheus_client" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False False", done.stdout + done.stderr


# -- a real prefork worker in multiprocess mode -----------------------------------------------------------


@pytest.fixture(scope="module")
def redis_for_worker() -> Iterator[str]:
    redis = RedisServer().start()
    yield redis.url()
    redis.close()


def aggregated(directory: Path) -> CollectorRegistry:
    """What the worker's /metrics shows in multiprocess mode: every process's files, added up."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    return registry


@pytest.mark.slow
def test_a_prefork_worker_in_multiprocess_mode_shows_its_pool_processes_metrics(
    etcd35_server: Any, redis_for_worker: str, tmp_path: Path
) -> None:
    directory = tmp_path / "prometheus"
    directory.mkdir()
    etcd_url = etcd35_server.url(prefix=f"/metrics-worker-{uuid.uuid4().hex[:8]}")
    taskapp.configure(etcd_url, redis_for_worker)
    worker = Proc.module(
        "celery", "-A", "tests.taskapp", "worker", "--pool=prefork", "--concurrency=2", "-l", "info",
        "--without-mingle", "--without-gossip", "-n", f"metricsworker-{uuid.uuid4().hex[:6]}@%h",
        env={"ETCDLOCK_TEST_ETCD_URL": etcd_url, "ETCDLOCK_TEST_REDIS_URL": redis_for_worker,
             "PROMETHEUS_MULTIPROC_DIR": str(directory)},
        name="celery-worker",
    )  # fmt: skip
    try:
        worker.expect(r" ready\.", timeout=90)
        tag = uuid.uuid4().hex[:10]
        tags = [f"{tag}-{i}" for i in range(6)]
        handles = [taskapp.skip_task.delay(tags[0], 5.0)]
        wait_until(lambda: _events(tags[0]), 30, "the first run to start")
        handles += [taskapp.skip_task.delay(tags[0], 0.0) for _ in range(2)]  # find it held: skipped
        handles += [taskapp.skip_task.delay(t, 0.2) for t in tags[1:]]
        results = [h.get(timeout=60, propagate=False) for h in handles]
        ran, skipped = sum(r is not None for r in results), sum(r is None for r in results)
        assert (ran, skipped) == (len(tags), 2)

        task = taskapp.skip_task.name
        labels = lock_labels(task, task=task)
        registry = aggregated(directory)
        assert value(registry, "acquisitions_total", **labels, outcome="acquired") == ran
        assert value(registry, "acquisitions_total", **labels, outcome="skipped") == skipped
        assert value(registry, "hold_seconds_count", **labels) == ran
        assert value(registry, "locks_held", **labels) == 0
        text = exposition(registry)
        assert not [t for t in tags if t in text], "argument values in the metrics"
        pids = {int(p.stem.rsplit("_", 1)[1]) for p in directory.glob("counter_*.db")}
        assert pids and worker.pid not in pids  # the pool processes counted, not the main process

        # a pool process killed while it holds a lock: its replacement stops counting that lock as held
        long_tag, long_task = f"{tag}-long", taskapp.long_ttl_task.name
        held = lambda: value(aggregated(directory), "locks_held", **lock_labels(long_task, task=long_task)) or 0  # noqa: E731
        taskapp.long_ttl_task.delay(long_tag, 60.0)
        wait_until(lambda: held() == 1, 30, "the long run to hold its lock")
        (start,) = [e for e in _events(long_tag) if e["event"] == "start"]
        os.kill(start["pid"], signal.SIGKILL)
        wait_until(lambda: held() == 0, 60, "the killed holder to be forgotten")
        assert not list(directory.glob(f"gauge_live*_{start['pid']}.db"))
    finally:
        worker.terminate(timeout=30)


def _events(tag: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in taskapp.store().lrange(f"events:{tag}", 0, -1)]
