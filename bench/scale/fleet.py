"""What runs inside the bench's host processes: many worker-like clients per process, each on its own.

Every client is ``connect(url)`` of its own, so it has its own session, lease and renewer thread, as
a prefork child has; a host process only saves the machine the cost of a thousand interpreters.
The main process drives each task with ``send()`` and reads its ``emit()``s (bench.common's pool):

    idle_host(urls, ttl, name)            "hold", k -> ("held", n, failed, lost); "stop" -> its counts
    busy_host(url, kind, threads, ...)    singleton runs (or the raw floor's mix) in a closed loop
    hot_waiters(urls, names, ...)         one client per waiter, all queued behind one holder per name
    beat_host(urls, ttl, name, ...)       LeaderSchedulers ticking; ("leader", identity, when) on a take-over
    tooz_host(url, ttl, name)             the idle fleet on tooz's etcd3gw locks (a lease per lock)
    floor_idle_host(endpoint, ...)        the raw floor of an idle fleet: one lease per client, kept alive
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench.common import emit, inbox, percentile, sleep_until
from bench.scale.target import Raw, b64

ACQUIRE_THREADS = 16  # per host: enough concurrency for etcd to batch the joins, not so much that Python thrashes


def _quiet_logs() -> None:
    import logging

    logging.getLogger("celery_etcdlock").setLevel(logging.ERROR)


# -- the idle fleet ---------------------------------------------------------------------------------


def idle_host(urls: list[str], ttl: float, name: str) -> dict[str, Any]:
    """One client per URL; on ("hold", k) each holds k locks in all (acquiring the missing ones)."""
    from celery_etcdlock import Mutex, connect

    _quiet_logs()
    clients = [connect(url, retry_max_delay=30) for url in urls]
    held: list[list[Any]] = [[] for _ in clients]
    lost = [0]

    def on_lost(_lock: Any) -> None:
        lost[0] += 1

    def take(c: int, j: int) -> bool:
        lock = Mutex(clients[c], f"{name}/c{c}/l{j}", ttl=ttl, on_lost=on_lost)
        if not lock.acquire(blocking=False):
            return False
        held[c].append(lock)
        return True

    emit("ready", len(clients))
    with ThreadPoolExecutor(ACQUIRE_THREADS) as pool:
        while True:
            message = inbox(None)
            if message[0] == "stop":
                break
            k = message[1]
            jobs = [(c, j) for c in range(len(clients)) for j in range(len(held[c]), k)]
            failed = sum(1 for ok in pool.map(lambda job: take(*job), jobs) if not ok)
            not_held = sum(1 for locks in held for lock in locks if not lock.held)
            emit("held", sum(len(locks) for locks in held), failed, lost[0] + not_held)
    for client in clients:
        client.close()  # one revoke a lease: what a stopping worker does
    return {"clients": len(clients), "lost": lost[0]}


def floor_idle_host(endpoint: str, clients: int, ttl: int, name: str) -> dict[str, Any]:
    """The least an idle fleet can cost: per client one lease with its k keys, one keep-alive every ttl/3.

    That is etcd's own ``concurrency.Session`` (clientv3 keeps a lease alive at TTL/3), with no
    confirming read and no listing: the requests a holder cannot do without.
    """
    raw = Raw(endpoint)
    leases = [int(raw.post("lease/grant", {"TTL": ttl})["ID"]) for _ in range(clients)]
    keys = [0] * clients
    emit("ready", clients)
    period = ttl / 3
    stop = threading.Event()

    def keep_alive() -> None:
        own = Raw(endpoint)
        start = time.monotonic()
        while not stop.is_set():
            for i, lease in enumerate(leases):  # spread over the period, as independent clients would be
                sleep_until(start + period * i / len(leases))
                if stop.is_set():
                    return
                own.post("lease/keepalive", {"ID": str(lease)})
            start += period
            sleep_until(start)
        own.close()

    thread = threading.Thread(target=keep_alive, daemon=True)
    thread.start()
    while True:
        message = inbox(None)
        if message[0] == "stop":
            break
        k = message[1]
        for i, lease in enumerate(leases):
            while keys[i] < k:
                batch = min(k - keys[i], 100)  # etcd's --max-txn-ops is 128
                puts = [{"request_put": {"key": b64(f"{name}/f{i}/l{keys[i] + n}/{lease:x}.{secrets.token_hex(8)}"),
                                         "value": b64("{}"), "lease": str(lease)}} for n in range(batch)]  # fmt: skip
                raw.post("kv/txn", {"success": puts})
                keys[i] += batch
        emit("held", sum(keys), 0, 0)
    stop.set()
    thread.join(period + 5)
    for lease in leases:
        raw.post("kv/lease/revoke", {"ID": str(lease)})
    raw.close()
    return {"clients": clients}


def tooz_host(url: str, clients: int, ttl: float, name: str) -> dict[str, Any]:
    """The idle fleet on tooz (etcd3gw driver): a coordinator per client, heartbeat on, a lease per lock."""
    import warnings

    # futurist, under tooz, imports eventlet, which warns that it is deprecated: not ours to report
    warnings.filterwarnings("ignore", message=r"(?s).*Eventlet is deprecated")
    from tooz import coordination

    coordinators = []
    for i in range(clients):
        coordinator = coordination.get_coordinator(f"{url}?lock_timeout={ttl:g}", f"{name}-{os.getpid()}-{i}".encode())
        coordinator.start(start_heart=True)
        coordinators.append(coordinator)
    held: list[list[Any]] = [[] for _ in coordinators]

    def take(c: int, j: int) -> bool:
        lock = coordinators[c].get_lock(f"{name}-c{os.getpid()}-{c}-l{j}".encode())
        if not lock.acquire(blocking=False):
            return False
        held[c].append(lock)
        return True

    emit("ready", clients)
    with ThreadPoolExecutor(ACQUIRE_THREADS) as pool:
        while True:
            message = inbox(None)
            if message[0] == "stop":
                break
            k = message[1]
            jobs = [(c, j) for c in range(clients) for j in range(len(held[c]), k)]
            failed = sum(1 for ok in pool.map(lambda job: take(*job), jobs) if not ok)
            emit("held", sum(len(locks) for locks in held), failed, 0)
        list(pool.map(lambda lock: lock.release(), [lock for locks in held for lock in locks]))
    for coordinator in coordinators:
        coordinator.stop()
    return {"clients": clients}


# -- the busy fleet ---------------------------------------------------------------------------------


def _singleton_runner(url: str, name: str) -> Any:
    """A Celery app of its own (no broker is ever used) with one singleton task; calling it runs the lock path."""
    from celery import Celery

    from celery_etcdlock import singleton_task

    app = Celery(f"scale-{name}", broker="memory://")
    app.conf.update(etcdlock_url=url, etcdlock_metrics=False)

    @singleton_task(app=app, name=f"scale.{name}", key=["i"])
    def run(i: int) -> int:
        return i

    return run


def _floor_runner(endpoint: str, name: str) -> Any:
    """The raw floor of a singleton run: put the key if absent (on a lease), then delete it if still ours."""
    raw = Raw(endpoint)
    lease = raw.post("lease/grant", {"TTL": 30})["ID"]

    def run(i: int) -> int:
        key = b64(f"{name}/{i}/{lease}")
        answer = raw.post("kv/txn", {
            "compare": [{"key": key, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
            "success": [{"request_put": {"key": key, "value": b64("{}"), "lease": lease}}],
        })  # fmt: skip
        revision = answer["header"]["revision"]
        raw.post("kv/txn", {
            "compare": [{"key": key, "target": "CREATE", "result": "EQUAL", "create_revision": revision}],
            "success": [{"request_delete_range": {"key": key}}],
        })  # fmt: skip
        return i

    return run


def busy_host(url: str, endpoint: str, kind: str, threads: int, name: str, levels: int) -> dict[str, Any]:
    """``threads`` closed loops of singleton runs on distinct keys, once per level the main process starts.

    ``kind``: "ours" (SingletonTask's lock path: ``task(i)`` without a broker; one app and client per
    thread, as one prefork child each) or "floor" (the same two writes sent raw). On each ("go", start,
    seconds, active) the first ``active`` threads loop from ``start`` for ``seconds``.
    """
    _quiet_logs()
    runners = [
        _singleton_runner(url, f"{name}-{os.getpid()}-{t}") if kind == "ours" else _floor_runner(endpoint, name)
        for t in range(threads)
    ]
    for t, run in enumerate(runners):
        run(-1 - t)  # warm up: connections, the session's lease
    emit("ready", threads)
    results = []
    for _ in range(levels):
        message = inbox(None)
        if message[0] == "stop":
            break
        _, start, seconds, active = message
        latencies: list[list[float]] = [[] for _ in range(active)]
        errors = [0]

        def loop(
            t: int, start: float = start, seconds: float = seconds, latencies: Any = latencies, errors: Any = errors
        ) -> None:
            run, mine, i = runners[t], latencies[t], 0
            sleep_until(start)
            end = start + seconds
            while (now := time.monotonic()) < end:
                i += 1
                try:
                    run(i * 1000 + t)
                except Exception:
                    errors[0] += 1
                mine.append(time.monotonic() - now)

        workers = [threading.Thread(target=loop, args=(t,)) for t in range(active)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        flat = [x for xs in latencies for x in xs]
        results.append({"runs": len(flat), "errors": errors[0], "p50": percentile(flat, 50),
                        "p99": percentile(flat, 99), "latencies": flat[:: max(1, len(flat) // 2000)]})  # fmt: skip
        emit("done", results[-1]["runs"])
    return {"levels": results}


# -- hot keys ---------------------------------------------------------------------------------------


def hot_waiters(urls: list[str], names: list[str], per_name: int, ttl: float, hold: float) -> dict[str, Any]:
    """``per_name`` waiters on each of ``names``, each its own client, blocked in ``acquire()``; each runs once."""
    from celery_etcdlock import Mutex, connect

    _quiet_logs()
    acquired = [0]
    failed = [0]
    count_lock = threading.Lock()
    clients = [connect(urls[i % len(urls)], retry_max_delay=30) for i in range(len(names) * per_name)]

    def wait(i: int) -> None:
        lock = Mutex(clients[i], names[i % len(names)], ttl=ttl)
        ok = lock.acquire(timeout=300)
        if ok:
            time.sleep(hold)  # the run under the lock
            lock.release()
        with count_lock:
            if ok:
                acquired[0] += 1
            else:
                failed[0] += 1

    threads = [threading.Thread(target=wait, args=(i,), daemon=True) for i in range(len(clients))]
    for thread in threads:
        thread.start()
    emit("ready", len(threads))
    for thread in threads:
        thread.join(600)
    emit("done", acquired[0], failed[0])
    inbox(None)  # "stop": the clients close (a revoke each) only once the main process has counted
    for client in clients:
        client.close()
    return {"acquired": acquired[0], "failed": failed[0]}


# -- beats ------------------------------------------------------------------------------------------


def beat_host(urls: list[str], ttl: float, name: str, tag: str) -> dict[str, Any]:
    """One ``LeaderScheduler`` per URL (an app and client each, an empty schedule), each ticking in a thread."""
    from celery import Celery

    from celery_etcdlock import connect
    from celery_etcdlock.beat import LeaderScheduler

    _quiet_logs()
    stop = threading.Event()
    schedulers = []
    for i, url in enumerate(urls):
        app = Celery(f"scale-beat-{tag}-{i}", broker="memory://")
        app.conf.update(etcdlock_url=url, etcdlock_beat_ttl=ttl, etcdlock_beat_name=name, etcdlock_metrics=False,
                        beat_schedule={}, result_expires=None)  # fmt: skip
        schedulers.append(LeaderScheduler(app, etcd_client=connect(url, retry_max_delay=30), identity=f"{tag}-{i}"))

    def tick(scheduler: LeaderScheduler) -> None:
        reported = False
        while not stop.is_set():
            interval = scheduler.tick()
            if scheduler.is_leader and not reported:
                reported = True
                emit("leader", scheduler.identity, time.monotonic())
            stop.wait(min(max(interval, 0.0), 1.0))

    threads = [threading.Thread(target=tick, args=(s,), daemon=True) for s in schedulers]
    for thread in threads:
        thread.start()
    emit("ready", len(schedulers))
    inbox(None)  # "stop"
    stop.set()
    for thread in threads:
        thread.join(5)
    for scheduler in schedulers:
        scheduler.close()
    return {"schedulers": len(schedulers)}
