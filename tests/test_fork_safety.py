"""Prefork safety: a worker's parent runs no thread of ours when it forks its pool.

Python 3.12+ warns at every fork of a process with threads ("use of fork() may
lead to deadlocks in the child"): a thread alive at the fork may hold a lock
that the child inherits held and never gets back. A prefork worker's parent
forks its pool at start, its beat (``-B``), and a new pool process whenever one
exits. ``tests/forkcheck.py`` records every fork with the threads of ours then
alive, and turns 3.12+'s warning into an error when one of them is ours.

- A fresh process does in its parent what a worker's parent does (connects a
  client and reads through it, turns the metrics on, hands an enqueue marker to
  the background forgetter) and forks at once: no thread of ours at the fork,
  and the child uses all three.
- A lock held at fork (what docs/pools.md says not to do): its renewer is alive
  at the fork, the lock stays the parent's, the child cannot release it.
- A real ``-P prefork`` worker of ``tests/forkapp.py`` with an embedded
  ``LeaderScheduler`` beat and ``--max-tasks-per-child=1``: forks its pool, its
  beat, and new pool processes after a revoked task's marker was forgotten,
  never with a thread of ours. And the same app under ``-P gevent`` (no pool
  processes: its tasks are greenlets of the worker).

Marked ``pythons``: scripts/test-pythons runs these on every CPython it finds.
"""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_etcdlock import connect
from celery_etcdlock.tasks.dedupe import EnqueueMarkers
from tests import forkapp
from tests.procs import Proc
from tests.support import wait_until

pytestmark = pytest.mark.pythons

RESULT_TIMEOUT = 60  # generous: 2 loaded cores
WARNS = sys.version_info >= (3, 12)  # Python's fork-with-threads DeprecationWarning

PARENT_DOES_WHAT_A_WORKER_DOES = """
from tests import forkcheck
forkcheck.install()
import os, time
from celery_etcdlock import Mutex, connect, metrics
from celery_etcdlock.tasks.dedupe import EnqueueMarkers, forget_in_background
from prometheus_client import REGISTRY

client = connect(os.environ["URL"])
Mutex(client, "job", ttl=3).holders()              # a client used in the parent: sockets, no thread
metrics.enable()                                   # as at a worker's worker_init
markers = EnqueueMarkers(client)
assert markers.claim("job", "t1", "task", ttl=30) is None
forget_in_background(client, "job", "t1")          # as the consumer does for a revoked task
pid = os.fork()                                    # at once: the delete may still be under way
if pid == 0:
    try:
        with Mutex(client, "job", ttl=3) as lock:
            assert lock.held
        assert markers.claim("job2", "t2", "task", ttl=30) is None
        forget_in_background(client, "job2", "t2")
        deadline = time.monotonic() + 30
        while markers.store.get("job2") is not None:
            assert time.monotonic() < deadline, "the child's forgetter did not delete its marker"
            time.sleep(0.02)
        labels = {"kind": "mutex", "lock": "job", "task": "", "outcome": "acquired"}
        counted = REGISTRY.get_sample_value("celery_etcdlock_acquisitions_total", labels)
        print("child ok, acquisitions counted:", counted, flush=True)
        os._exit(0)
    except BaseException as exc:
        print("child failed:", repr(exc), flush=True)
        os._exit(1)
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status))
forkcheck.check()
print("no thread of ours at the fork; parent's marker forgotten:", markers.store.get("job") is None)
"""


def test_a_parent_that_connected_enabled_metrics_and_forgot_a_marker_forks_with_no_thread_of_ours(
    etcd_url: str, spawn: Callable[..., Proc]
) -> None:
    proc = spawn(PARENT_DOES_WHAT_A_WORKER_DOES, env={"URL": etcd_url})
    proc.expect(r"child ok, acquisitions counted: 1\.0", timeout=RESULT_TIMEOUT)
    proc.expect(r"child exit 0")
    proc.expect(r"no thread of ours at the fork; parent's marker forgotten: True")
    proc.expect_exit(0)


LOCK_HELD_AT_FORK = """
from tests import forkcheck
forkcheck.install()
import os
from celery_etcdlock import Mutex, connect

client = connect(os.environ["URL"])
lock = Mutex(client, "at-import", ttl=3)
assert lock.acquire()                       # what not to do in a worker's parent: its renewer now runs
pid = os.fork()
if pid == 0:
    lock.release()                          # the parent's entry: not the child's to delete
    other = Mutex(client, "at-import", ttl=3)
    print("child got the lock:", other.acquire(blocking=False), flush=True)
    os._exit(0)
os.waitpid(pid, 0)
print("ours at the fork:", forkcheck.forks[-1]["ours"])
print("errors:", len(forkcheck.errors))
print("parent holds it:", [h["token"] for h in lock.holders()] == [lock.token] and lock.held)
"""


def test_a_lock_held_at_fork_stays_the_parents_and_its_renewer_is_what_python_warns_of(
    etcd_url: str, spawn: Callable[..., Proc]
) -> None:
    proc = spawn(LOCK_HELD_AT_FORK, env={"URL": etcd_url})
    proc.expect(r"child got the lock: False", timeout=RESULT_TIMEOUT)
    proc.expect(r"ours at the fork: \['etcdlock-renewer-3s'\]")
    proc.expect(rf"errors: {1 if WARNS else 0}$")
    proc.expect(r"parent holds it: True")
    proc.expect_exit(0)


# -- real workers ---------------------------------------------------------------------------------


def start_worker(pool: str, etcd_url: str, redis_url: str, fork_log: Path, *options: str) -> Proc:
    """A real ``celery worker -P <pool> -c 1`` of tests.forkapp, recording its forks in ``fork_log``."""
    worker = Proc.module(
        "celery", "-A", "tests.forkapp", "worker", "-P", pool, "-c", "1", "-l", "info", "--without-mingle",
        "--without-gossip", "--without-heartbeat", "-n", f"fork-{pool}-{uuid.uuid4().hex[:6]}@%h", *options,
        env={"ETCDLOCK_TEST_ETCD_URL": etcd_url, "ETCDLOCK_TEST_REDIS_URL": redis_url, "FORK_LOG": str(fork_log)},
        name=f"celery-worker-{pool}",
    )  # fmt: skip
    try:
        worker.expect(r" ready\.", timeout=90)
    except BaseException:
        worker.kill()
        raise
    return worker


@pytest.fixture
def app_on(etcd_url: str, redis_url: str) -> Iterator[redis.Redis]:
    """tests.forkapp's app, on this test's etcd and Redis; the Redis client."""
    forkapp.app.conf.update(etcdlock_url=etcd_url, broker_url=redis_url, result_backend=redis_url)
    store = redis.Redis.from_url(redis_url)
    yield store
    store.close()


def records(fork_log: Path, event: str = "fork", pid: int | None = None) -> list[dict[str, Any]]:
    lines = fork_log.read_text().splitlines() if fork_log.exists() else []
    found = [json.loads(line) for line in lines]
    return [r for r in found if r["event"] == event and (pid is None or r["pid"] == pid)]


@pytest.mark.slow
@pytest.mark.parametrize("api", ["v3"])  # a worker's start is the expensive part; v2 adds no fork path
def test_a_prefork_worker_forks_its_pool_and_beat_with_no_thread_of_ours(
    api: str, etcd_url: str, redis_url: str, app_on: redis.Redis, tmp_path: Path
) -> None:
    fork_log = tmp_path / "forks.jsonl"
    options = ("--max-tasks-per-child=1", "-B", "-s", str(tmp_path / "beat-schedule"))
    worker = start_worker("prefork", etcd_url, redis_url, fork_log, *options)
    client = connect(etcd_url)
    try:
        wait_until(lambda: app_on.llen("ticks") >= 2, RESULT_TIMEOUT, "two ticks of the embedded beat")
        # A revoked task: the consumer, in the parent, hands its enqueue marker to the forgetter.
        tag = uuid.uuid4().hex[:10]
        name = forkapp.job.lock_name_for((tag,))
        revoked = forkapp.job.apply_async((tag,), countdown=1)
        forkapp.app.control.revoke(revoked.id)
        markers = EnqueueMarkers(client)
        wait_until(lambda: markers.store.get(name) is None, RESULT_TIMEOUT, "the revoked task's marker to go")
        forks_before = len(records(fork_log, pid=worker.pid))
        run = forkapp.job.apply_async((tag,)).get(timeout=RESULT_TIMEOUT)
        wait_until(
            lambda: len(records(fork_log, pid=worker.pid)) > forks_before + 1,
            RESULT_TIMEOUT,
            "the parent to fork new pool processes after the forget",
        )
    finally:
        worker.terminate(timeout=30)
        client.close()
    assert run["pid"] != worker.pid and run["token"] > 0, run
    forks = records(fork_log, pid=worker.pid)
    assert len(forks) >= 4, forks  # the pool, the beat, and new pool processes after tasks
    with_ours = [f for f in forks if f["ours"]]
    assert not with_ours, f"the worker's parent forked with threads of ours alive: {with_ours}"
    assert not records(fork_log, "error"), records(fork_log, "error")
    assert "Revoked" in worker.output or "revoked" in worker.output


@pytest.mark.slow
@pytest.mark.parametrize("api", ["v3"])
def test_the_same_app_under_gevent_runs_its_locked_tasks_in_the_worker_itself(
    api: str, etcd_url: str, redis_url: str, app_on: redis.Redis, tmp_path: Path
) -> None:
    fork_log = tmp_path / "forks.jsonl"
    worker = start_worker("gevent", etcd_url, redis_url, fork_log)
    try:
        runs = [forkapp.job.apply_async((uuid.uuid4().hex[:10],)) for _ in range(3)]
        done = [r.get(timeout=RESULT_TIMEOUT) for r in runs]
    finally:
        worker.terminate(timeout=30)
    assert {r["pid"] for r in done} == {worker.pid}, done  # greenlets of the worker itself
    assert all(r["token"] > 0 for r in done), done
    assert not [f for f in records(fork_log) if f["ours"]], records(fork_log)
    assert not records(fork_log, "error")


def test_fork_checker_sees_a_thread_of_ours_and_not_others(spawn: Callable[..., Proc]) -> None:
    proc = spawn(
        """
        from tests import forkcheck
        forkcheck.install()
        import os, threading
        stop = threading.Event()
        for name in ("someone-elses", "etcdlock-mine"):
            threading.Thread(target=stop.wait, name=name, daemon=True).start()
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            os.waitpid(pid, 0)
        print("ours:", [f["ours"] for f in forkcheck.forks], "errors:", len(forkcheck.errors))
        try:
            forkcheck.check()
        except forkcheck.ForkWithOurThreads:
            print("refused")
        """
    )
    proc.expect(rf"ours: \[\[\], \['etcdlock-mine'\]\] errors: {1 if WARNS else 0}$")
    proc.expect("refused")
    proc.expect_exit(0)
