"""Locks survive every Celery pool: a task that computes for 2 x lock_ttl without yielding keeps its lock.

Under ``-P gevent`` a task is a greenlet: while it computes, nothing else of its
process runs but native threads. The session's renewer is one (``green.py``),
so the lock stays held, and a second worker never runs the same key meanwhile.

- Real workers: per etcd API, one ``-P gevent`` and one ``-P threads`` worker
  (``tests/poolapp.py``), each on a queue of its own. A run computes on one of
  them; the other is the second worker, sent the same key every half second
  while the run lasts. Redis records how many runs of the key were active at
  each start.
- A gevent-patched process (no Celery), plain and with TLS, client
  certificates and auth: the renewer starts no gevent hub of its own, sees a
  loss while the hub is starved, and ``on_lost`` then runs in a greenlet of
  the main thread.
- eventlet is refused: a worker does not start, and a lock in a patched
  process raises ``UnsupportedPool``.
"""

from __future__ import annotations

import importlib.util
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery.exceptions import TimeoutError as ResultTimeout

from celery_etcdlock import Mutex, connect, green
from celery_etcdlock.cli import force_release
from tests import poolapp
from tests.procs import Proc
from tests.support import EtcdServer, RedisServer, wait_until

RESULT_TIMEOUT = 60  # generous: 2 loaded cores
COMPUTE = 2 * poolapp.LOCK_TTL  # seconds a run computes without yielding
POOLS = ("gevent", "threads")
TRY_EVERY = 0.5  # seconds between two attempts of the second worker


# -- real workers -------------------------------------------------------------------------------


def start_worker(pool: str, etcd_url: str, redis_url: str) -> Proc:
    """A real ``celery worker -P <pool>`` of tests.poolapp, consuming the queue named after its pool."""
    return Proc.module(
        "celery", "-A", "tests.poolapp", "worker", "-P", pool, "-c", "4", "-Q", pool, "-l", "info",
        "--without-mingle", "--without-gossip", "--without-heartbeat", "-n", f"{pool}-{uuid.uuid4().hex[:6]}@%h",
        env={"ETCDLOCK_TEST_ETCD_URL": etcd_url, "ETCDLOCK_TEST_REDIS_URL": redis_url},
        name=f"celery-worker-{pool}",
    )  # fmt: skip


@pytest.fixture(scope="module")
def redis_for_workers() -> Iterator[str]:
    """A Redis of the module's own: conftest's redis_url flushes every database before each test."""
    server = RedisServer().start()
    yield server.url(1)
    server.close()


@pytest.fixture(scope="module", params=["v2", "v3"])
def workers(request: pytest.FixtureRequest, redis_for_workers: str) -> Iterator[dict[str, Any]]:
    """A gevent and a threads worker, on the v2 API (etcd 3.4) or the v3 API (etcd 3.5)."""
    server: EtcdServer = request.getfixturevalue("etcd34_server" if request.param == "v2" else "etcd35_server")
    etcd_url = server.url(prefix=f"/pools-{uuid.uuid4().hex[:8]}")
    poolapp.app.conf.update(etcdlock_url=etcd_url, broker_url=redis_for_workers, result_backend=redis_for_workers)
    procs = [start_worker(pool, etcd_url, redis_for_workers) for pool in POOLS]  # started together: each is slow
    try:
        for proc in procs:
            proc.expect(r" ready\.", timeout=90)
        yield {"etcd_url": etcd_url, "redis": redis.Redis.from_url(redis_for_workers)}
    finally:
        for proc in procs:
            proc.terminate(timeout=30)


@pytest.mark.slow
@pytest.mark.parametrize("pool", POOLS)
def test_a_task_that_never_yields_keeps_its_lock_and_no_other_worker_runs_its_key(
    workers: dict[str, Any], pool: str
) -> None:
    tag = uuid.uuid4().hex[:10]
    store: redis.Redis = workers["redis"]
    client = connect(workers["etcd_url"])
    name = poolapp.compute.lock_name_for((tag, 0.0))
    second = next(p for p in POOLS if p != pool)

    run = poolapp.compute.apply_async((tag, COMPUTE), queue=pool)
    wait_until(lambda: store.llen(f"concurrency:{tag}"), RESULT_TIMEOUT, f"the run on the {pool} worker to start")
    started = time.monotonic()
    attempts: list[tuple[float, Any]] = []  # (seconds into the run, the second worker's attempt)
    holders: set[int] = set()
    while True:  # the second worker tries the key every TRY_EVERY seconds or so, until the run ends
        attempts.append((time.monotonic() - started, poolapp.compute.apply_async((tag, 0.0), queue=second)))
        holders.update(h["token"] for h in Mutex(client, name, ttl=poolapp.LOCK_TTL).holders())
        try:
            run.get(timeout=TRY_EVERY, propagate=False)
            break
        except ResultTimeout:
            pass
    result = run.get(timeout=RESULT_TIMEOUT, propagate=False)  # LockLost if it lost its lock before it finished
    tried = [(at, handle.get(timeout=RESULT_TIMEOUT, propagate=False)) for at, handle in attempts]
    client.close()

    concurrency = [int(x) for x in store.lrange(f"concurrency:{tag}", 0, -1)]
    assert max(concurrency) == 1, f"the key ran {max(concurrency)} times at once; the run ended with {result!r}"
    assert isinstance(result, dict), f"the run failed: {result!r}"
    assert result["held"] is True and result["computed"] >= COMPUTE
    if pool == "gevent":
        assert result["ticks"] == 0, "the run let the hub run: it does not show a starved hub"
    assert holders <= {result["token"]}, f"another request held {name} during the run: tokens {holders}"
    # and the second worker did try while the lock would have expired, had it not been renewed
    refused_late = [at for at, value in tried if value is None and at > poolapp.LOCK_TTL]
    assert refused_late, f"no attempt of the {second} worker was refused after {poolapp.LOCK_TTL}s: {tried}"


# -- a gevent-patched process, plain and with TLS and auth ----------------------------------------

GEVENT_HOLDER = """
from gevent import monkey; monkey.patch_all()
import gc, os, sys, time
import gevent, gevent.event, gevent.hub
from celery_etcdlock import Mutex, connect, green

def native_thread():
    return monkey.get_original("_thread", "get_ident")()

def compute(seconds, until=lambda: False):  # pure Python: never yields to the hub
    started = time.monotonic()
    while time.monotonic() - started < seconds and not until():
        pass
    return time.monotonic() - started

main_thread, ttl = native_thread(), float(os.environ["TTL"])
told, ran_in = gevent.event.Event(), []

def on_lost(lock):
    gevent.sleep(0.01)  # may block: a greenlet, not the hub's own callback
    ran_in.append("main thread" if native_thread() == main_thread else "another thread")
    told.set()

lock = Mutex(connect(os.environ["URL"]), "cpu", ttl=ttl, on_lost=on_lost)
assert lock.acquire()
print("acquired", lock.token)
computed = compute(2 * ttl)
print(f"computed {computed:.1f}s held={lock.held}")
print("gevent hubs:", sum(isinstance(o, gevent.hub.Hub) for o in gc.get_objects()))
sys.stdin.readline()  # not patched: blocks the hub too, while the test force-releases the lock
waited = compute(4 * ttl, until=lambda: not lock.held)
print(f"held={lock.held} after {waited:.1f}s without yielding; on_lost ran in {ran_in}")
told.wait(10)  # yields: the hub runs the callback the renewer handed it
print(f"on_lost ran in {ran_in}")
"""

_KIND = {"v2": ("3.4", True), "v3": ("3.5", False)}  # etcd version, enable_v2


@pytest.mark.slow
@pytest.mark.parametrize("security", ["plain", "tls+auth"])
def test_under_gevent_the_renewer_is_a_native_thread_with_connections_of_its_own(
    api: str,
    security: str,
    etcd_url: str,
    etcd_server_factory: Callable[..., EtcdServer],
    spawn: Callable[..., Proc],
) -> None:
    if security == "tls+auth":
        version, enable_v2 = _KIND[api]
        server = etcd_server_factory(version, enable_v2=enable_v2, api=api, tls=True, auth=True, client_cert_auth=True)
        etcd_url = server.url(prefix="/gevent-tls")
    ttl = poolapp.LOCK_TTL
    holder = spawn(GEVENT_HOLDER, env={"URL": etcd_url, "TTL": str(ttl)})
    token = int(holder.expect(r"acquired (\d+)").group(1))
    computed = holder.expect(r"computed ([\d.]+)s held=(\w+)", timeout=RESULT_TIMEOUT)
    assert computed.group(2) == "True", holder.output
    assert holder.expect(r"gevent hubs: (\d+)").group(1) == "1"  # the renewer never waited on a hub of its own

    client = connect(etcd_url)
    assert [h["token"] for h in Mutex(client, "cpu", ttl=ttl).holders()] == [token]
    assert force_release(client, "cpu") == [token]
    client.close()
    holder.send("go\n")
    holder.expect(r"held=False after [\d.]+s without yielding; on_lost ran in \[\]", timeout=RESULT_TIMEOUT)
    holder.expect(r"on_lost ran in \['main thread'\]")


# -- what an unpatched process runs: what it always did ------------------------------------------


def test_an_unpatched_process_renews_from_a_threading_thread_through_its_backend(client: Any) -> None:
    lock = Mutex(client, "plain", ttl=poolapp.LOCK_TTL)
    assert lock.acquire()
    session = client.session(poolapp.LOCK_TTL)
    assert green.patched_by() is None and not session.green
    assert session.renewing_backend is client.backend
    assert isinstance(session._renewer, threading.Thread) and session._renewer.is_alive()
    lock.release()


def test_native_condition_wakes_its_waiter_on_notify_and_times_out_without() -> None:
    condition = green.NativeCondition()
    woke: list[bool] = []
    waiting = threading.Event()

    def waiter() -> None:
        with condition:
            waiting.set()
            woke.append(condition.wait(60))

    thread = threading.Thread(target=waiter)
    thread.start()
    assert waiting.wait(10)
    with condition:  # the waiter holds the lock until wait() releases it: notify comes after
        condition.notify()
    thread.join(10)
    assert woke == [True]
    with condition:
        assert condition.wait(0.01) is False  # nothing pending: times out
        condition.notify()
        condition.notify()  # a second notify while one is pending changes nothing
        assert condition.wait(0) is True
        assert condition.wait(0) is False


# -- eventlet: refused ------------------------------------------------------------------------------

# found, not imported: importing eventlet here would hook fork() in this process for the whole session
needs_eventlet = pytest.mark.skipif(importlib.util.find_spec("eventlet") is None, reason="eventlet is not installed")


@needs_eventlet
def test_an_eventlet_worker_refuses_to_start() -> None:
    with Proc.module(
        "celery", "-A", "tests.poolapp", "worker", "-P", "eventlet", "--without-mingle", "--without-gossip",
        env={"ETCDLOCK_TEST_REDIS_URL": "redis://127.0.0.1:9/1"}, name="celery-worker-eventlet",
    ) as worker:  # fmt: skip
        worker.expect(r"does not support eventlet .*Use -P gevent, -P threads or -P prefork")
        worker.expect_exit(1)


@needs_eventlet
def test_a_lock_in_an_eventlet_process_is_refused(etcd_url: str, spawn: Callable[..., Proc]) -> None:
    child = spawn(
        """
        import eventlet; eventlet.monkey_patch()
        import os
        from celery_etcdlock import Mutex, UnsupportedPool, connect
        try:
            Mutex(connect(os.environ["URL"]), "x", ttl=3).acquire()
        except UnsupportedPool as exc:
            print("refused:", exc)
        """,
        env={"URL": etcd_url},
    )
    child.expect(r"refused: celery_etcdlock does not support eventlet")
    child.expect_exit(0)
