"""The lock benchmark: celery_etcdlock's Mutex, RWLock and Election side by side with their peers.

    python -m bench.bench_locks                      # the full run (about 6 minutes on 2 cores)
    python -m bench.bench_locks --quick              # a smoke run (about a minute)
    python -m bench.bench_locks --apis v3 --only contention --json out.json

It starts its own servers (etcd 3.4 with --enable-v2 for the etcd:// workloads,
etcd 3.5 without v2 for the etcd3:// ones, redis-server for the Redis peers), all
on free loopback ports with temp data dirs, runs every workload in one run with
the measurements of ours, the floors and the peers interleaved, and prints
Markdown tables (ratios first, raw numbers after) and the targets met or missed.

Workloads (``--only``):

- ``uncontended``: acquire+release latency in one process, round-robin over every
  lock and the raw create+delete floors, so machine noise hits all alike.
- ``contention``: 2/8/32 processes loop acquire / read-modify-write a counter in a
  file / release: handoffs/s, lost updates, fairness, raft proposals and requests
  per handoff (server-side counters from /metrics, Redis INFO).
- ``killed``: a holder SIGKILLed right after a renewal (the worst case); how long a
  queued waiter takes to get the lock.
- ``election``: 3 candidates, ttl 3: new leader after resign() and after SIGKILL.
- ``rwlock``: a 90/10 read/write mix under RWLock against Mutex doing the same work.
- ``hold``: 500 locks held for 10 s with ttl 5: keep-alive requests per second.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench import common
from bench.common import (
    Pool,
    Servers,
    WorkerError,
    emit,
    fmt,
    inbox,
    markdown_table,
    median,
    percentile,
    ratio,
    requests_sent,
    sleep_until,
)

HOST = common.HOST
OURS_PREFIX = "/etcdlock-bench"

# ---------------------------------------------------------------------------------------------
# The locks, as seen from inside a worker process
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LockKind:
    key: str  # id used on the command line and in the JSON
    label: str  # what the tables call it
    server: str  # "v2", "v3" or "redis": where it runs (and whose counters measure it)
    ours: bool = False
    floor: bool = False  # a raw create + delete, not a lock: only for the uncontended floor


KINDS = {
    k.key: k
    for k in (
        LockKind("floor-v2", "raw python-etcd create+delete", "v2", floor=True),
        LockKind("ours-v2", "celery_etcdlock Mutex etcd://", "v2", ours=True),
        LockKind("etcd.Lock", "python-etcd etcd.Lock", "v2"),
        LockKind("floor-v3", "raw etcd3gw create+delete", "v3", floor=True),
        LockKind("ours-v3", "celery_etcdlock Mutex etcd3://", "v3", ours=True),
        LockKind("tooz-etcd3gw", "tooz etcd3gw lock", "v3"),
        LockKind("floor-redis", "raw redis SET NX + DEL", "redis", floor=True),
        LockKind("redis-lock", "python-redis-lock", "redis"),
    )
}
FLOOR_OF = {"v2": "floor-v2", "v3": "floor-v3", "redis": "floor-redis"}


def _text(body: Any) -> str:
    if body is None:
        return ""
    if isinstance(body, bytes):
        return body.decode("latin-1")
    return str(body)


class Impl:
    """One lock implementation, connected; ``lock(name)`` gives a fresh object with acquire()/release()."""

    def __init__(self, kind: str, ports: dict[str, int], ttl: float) -> None:
        self.kind = kind
        self.ports = ports
        self.ttl = ttl
        self.port = ports[KINDS[kind].server]

    def lock(self, name: str) -> Any:
        raise NotImplementedError

    def on_renewal(self, handle: Any, callback: Callable[[], None]) -> bool:
        """Call ``callback`` after each renewal of ``handle``'s hold; False if this lock never renews."""
        return False

    def close(self) -> None:
        pass


def _http_renewal_hook(predicate: Callable[[str, str, str], bool], callback: Callable[[], None]) -> None:
    def hook(method: str, url: str, body: Any) -> None:
        if predicate(method, url, _text(body)):
            callback()

    common.add_request_hook(hook)


class OursMutex(Impl):
    def __init__(self, kind: str, ports: dict[str, int], ttl: float) -> None:
        super().__init__(kind, ports, ttl)
        from celery_etcdlock import connect

        scheme = "etcd" if kind.endswith("v2") else "etcd3"
        self.client = connect(f"{scheme}://{HOST}:{self.port}?prefix={OURS_PREFIX}")

    def lock(self, name: str) -> Any:
        from celery_etcdlock import Mutex

        return Mutex(self.client, name, ttl=self.ttl)

    def on_renewal(self, handle: Any, callback: Callable[[], None]) -> bool:
        _http_renewal_hook(_ours_renewal(self.client.api), callback)
        return True

    def close(self) -> None:
        self.client.close()


def _ours_renewal(api: str) -> Callable[[str, str, str], bool]:
    if api == "v2":  # the session refreshes each entry: PUT ...?refresh=true (wakes no watcher)
        return lambda method, url, body: method == "PUT" and "refresh=true" in (url + "&" + body).lower()
    return lambda method, url, body: "/lease/keepalive" in url


class EtcdLock(Impl):
    """python-etcd's own recipe; lock_ttl = our ttl (it never renews it)."""

    def __init__(self, kind: str, ports: dict[str, int], ttl: float) -> None:
        super().__init__(kind, ports, ttl)
        import etcd

        self.client = etcd.Client(host=HOST, port=self.port, read_timeout=60)

    def lock(self, name: str) -> Any:
        import etcd

        impl = self

        class Handle:
            def __init__(self) -> None:
                self.lock = etcd.Lock(impl.client, name)

            def acquire(self) -> bool:
                while True:
                    try:
                        return bool(self.lock.acquire(blocking=True, lock_ttl=int(impl.ttl)))
                    except etcd.EtcdLockExpired:
                        # its queue key is never renewed: a wait longer than lock_ttl loses it; queue again
                        self.lock = etcd.Lock(impl.client, name)

            def release(self) -> None:
                self.lock.release()

        return Handle()


class RawV2(Impl):
    """The floor: one create (prevExist=false) and one delete with python-etcd."""

    def __init__(self, kind: str, ports: dict[str, int], ttl: float) -> None:
        super().__init__(kind, ports, ttl)
        import etcd

        self.client = etcd.Client(host=HOST, port=self.port, read_timeout=60)

    def lock(self, name: str) -> Any:
        client, key, ttl = self.client, f"/floor/{name}", int(self.ttl)

        class Handle:
            def acquire(self) -> bool:
                client.write(key, "x", ttl=ttl, prevExist=False)
                return True

            def release(self) -> None:
                client.delete(key)

        return Handle()


class ToozEtcd3gw(Impl):
    """tooz's etcd3gw driver: lock_timeout = our ttl, heartbeat thread on, tooz defaults otherwise."""

    def __init__(self, kind: str, ports: dict[str, int], ttl: float) -> None:
        super().__init__(kind, ports, ttl)
        from tooz import coordination

        url = f"etcd3+http://{HOST}:{self.port}?lock_timeout={int(ttl)}"
        self.coordinator = coordination.get_coordinator(url, uuid.uuid4().hex.encode())
        self.coordinator.start(start_heart=True)

    def lock(self, name: str) -> Any:
        return self.coordinator.get_lock(f"/{name}".encode())

    def on_renewal(self, handle: Any, callback: Callable[[], None]) -> bool:
        lease_id = str(handle._lease.id)  # the heartbeat refreshes the membership lease, then this one

        _http_renewal_hook(lambda method, url, body: "/lease/keepalive" in url and lease_id in body, callback)
        return True

    def close(self) -> None:
        self.coordinator.stop()


class RawV3(Impl):
    """The floor: etcd3gw's create (one put-if-absent transaction) and delete."""

    def __init__(self, kind: str, ports: dict[str, int], ttl: float) -> None:
        super().__init__(kind, ports, ttl)
        import etcd3gw

        self.client = etcd3gw.client(host=HOST, port=self.port)

    def lock(self, name: str) -> Any:
        client, key = self.client, f"/floor/{name}"

        class Handle:
            def acquire(self) -> bool:
                if not client.create(key, "x"):
                    raise RuntimeError(f"floor key {key} exists")
                return True

            def release(self) -> None:
                client.delete(key)

        return Handle()


class RedisLock(Impl):
    """python-redis-lock: expire = our ttl, auto_renewal on (renews every 2/3 of it)."""

    def __init__(self, kind: str, ports: dict[str, int], ttl: float) -> None:
        super().__init__(kind, ports, ttl)
        import redis

        self.client = redis.Redis(host=HOST, port=self.port)

    def lock(self, name: str) -> Any:
        import redis_lock

        return redis_lock.Lock(self.client, name, expire=int(self.ttl), auto_renewal=True)

    def on_renewal(self, handle: Any, callback: Callable[[], None]) -> bool:
        extend = handle.extend

        def extend_and_tell(*args: Any, **kwargs: Any) -> Any:
            result = extend(*args, **kwargs)
            callback()
            return result

        handle.extend = extend_and_tell
        return True

    def close(self) -> None:
        self.client.close()


class RawRedis(Impl):
    def __init__(self, kind: str, ports: dict[str, int], ttl: float) -> None:
        super().__init__(kind, ports, ttl)
        import redis

        self.client = redis.Redis(host=HOST, port=self.port)

    def lock(self, name: str) -> Any:
        client, key, ttl = self.client, f"floor:{name}", int(self.ttl)

        class Handle:
            def acquire(self) -> bool:
                if not client.set(key, "x", nx=True, ex=ttl):
                    raise RuntimeError(f"floor key {key} exists")
                return True

            def release(self) -> None:
                client.delete(key)

        return Handle()

    def close(self) -> None:
        self.client.close()


IMPLS: dict[str, type[Impl]] = {
    "floor-v2": RawV2,
    "ours-v2": OursMutex,
    "etcd.Lock": EtcdLock,
    "floor-v3": RawV3,
    "ours-v3": OursMutex,
    "tooz-etcd3gw": ToozEtcd3gw,
    "floor-redis": RawRedis,
    "redis-lock": RedisLock,
}


def make_impl(kind: str, ports: dict[str, int], ttl: float) -> Impl:
    return IMPLS[kind](kind, ports, ttl)


def ours_available(api: str) -> str | None:
    """None if celery_etcdlock's Mutex works on ``api`` in this checkout, else why not."""
    try:
        import celery_etcdlock

        for name in ("Mutex", "RWLock", "Election"):
            getattr(celery_etcdlock, name)
        if api == "v2":
            import celery_etcdlock.backends.etcd2  # noqa: F401
        else:
            import celery_etcdlock.backends.etcd3  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any reason is reported, not raised
        return f"{type(exc).__name__}: {exc}"
    return None


# ---------------------------------------------------------------------------------------------
# Tasks run in the worker processes
# ---------------------------------------------------------------------------------------------


def _warm_up(impl: Impl) -> None:
    """One acquire+release on a private name: connections, sessions and leases exist afterwards."""
    handle = impl.lock(f"warmup-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    handle.acquire()
    handle.release()


def task_uncontended(ports: dict[str, int], kinds: list[str], iterations: int, warmup: int, ttl: float) -> dict:
    """Round-robin acquire+release over every kind (rotating who goes first); latencies in ms."""
    impls = {kind: make_impl(kind, ports, ttl) for kind in kinds}
    thread = threading.get_ident()
    latencies: dict[str, list[float]] = {kind: [] for kind in kinds}
    requests: dict[str, int] = dict.fromkeys(kinds, 0)
    names = {kind: f"uncontended-{kind}-{uuid.uuid4().hex[:8]}" for kind in kinds}
    for i in range(warmup + iterations):
        order = kinds[i % len(kinds):] + kinds[: i % len(kinds)]
        for kind in order:
            sent = requests_sent(thread)
            started = time.perf_counter()
            handle = impls[kind].lock(names[kind])
            handle.acquire()
            handle.release()
            elapsed = time.perf_counter() - started
            if i >= warmup:
                latencies[kind].append(elapsed * 1000)
                requests[kind] += requests_sent(thread) - sent
    for impl in impls.values():
        impl.close()
    return {kind: {"ms": latencies[kind], "requests_per_op": requests[kind] / max(1, iterations)} for kind in kinds}


def _timed_phases(
    setup: Callable[[], Any], loop: Callable[[Any, float], dict], teardown: Callable[[Any], None]
) -> None:
    """ready -> (go) -> loop until end_at -> done(stats) -> (close) -> teardown: see ``timed_run``."""
    state = setup()
    emit("ready")
    _, start_at, end_at = inbox()
    sleep_until(start_at)
    sent = requests_sent()
    stats = loop(state, end_at)
    stats["finished"] = time.monotonic()
    stats["client_requests"] = requests_sent() - sent
    emit("done", stats)
    inbox()
    teardown(state)


def _read_counter(fd: int) -> int:
    return int(os.pread(fd, 20, 0) or b"0")


def _write_counter(fd: int, value: int) -> None:
    os.pwrite(fd, b"%020d" % value, 0)


def task_contend(kind: str, ports: dict[str, int], name: str, counter: str, ttl: float) -> None:
    """Loop acquire / read counter, sleep(0), write counter+1 / release; count overlaps as a second check."""

    def setup() -> tuple[Impl, int]:
        impl = make_impl(kind, ports, ttl)
        _warm_up(impl)
        return impl, os.open(counter, os.O_RDWR)

    def loop(state: tuple[Impl, int], end_at: float) -> dict:
        impl, fd = state
        inside = common.shared("inside")
        acquisitions = overlaps = 0
        while time.monotonic() < end_at:
            handle = impl.lock(name)
            handle.acquire()
            with inside.get_lock():
                inside.value += 1
                overlaps += inside.value > 1
            value = _read_counter(fd)
            time.sleep(0)
            _write_counter(fd, value + 1)
            with inside.get_lock():
                inside.value -= 1
            handle.release()
            acquisitions += 1
        return {"acquisitions": acquisitions, "overlaps": overlaps}

    def teardown(state: tuple[Impl, int]) -> None:
        state[0].close()
        os.close(state[1])

    _timed_phases(setup, loop, teardown)


def task_rw_mix(api: str, ports: dict[str, int], mode: str, name: str, counter: str, ttl: float,
                read_share: float, work: float, seed: int) -> None:
    """90/10 reads/writes; a reader reads the counter twice around ``work`` seconds (a change = a
    writer overlapped), a writer does read, sleep ``work``, write+1. ``mode``: "rwlock" or "mutex"."""

    def setup() -> tuple[Any, Any, int]:
        from celery_etcdlock import Mutex, RWLock, connect

        scheme = "etcd" if api == "v2" else "etcd3"
        client = connect(f"{scheme}://{HOST}:{ports[api]}?prefix={OURS_PREFIX}")
        rw = RWLock(client, name, ttl=ttl)
        if mode == "rwlock":
            def factory(reading: bool) -> Any:
                return rw.read() if reading else rw.write()
        else:
            def factory(reading: bool) -> Any:
                return Mutex(client, name, ttl=ttl)
        warm = Mutex(client, f"warmup-{os.getpid()}", ttl=ttl)
        warm.acquire()
        warm.release()
        return client, factory, os.open(counter, os.O_RDWR)

    def loop(state: tuple[Any, Any, int], end_at: float) -> dict:
        _, factory, fd = state
        rng = random.Random(seed)
        readers, writers = common.shared("readers"), common.shared("writers")
        reads = writes = violations = changed = 0
        while time.monotonic() < end_at:
            reading = rng.random() < read_share
            lock = factory(reading)
            lock.acquire()
            if reading:
                with writers.get_lock():
                    readers.value += 1
                    violations += writers.value > 0
                before = _read_counter(fd)
                time.sleep(work)
                changed += _read_counter(fd) != before
                with writers.get_lock():
                    readers.value -= 1
                reads += 1
            else:
                with writers.get_lock():
                    writers.value += 1
                    violations += writers.value > 1 or readers.value > 0
                value = _read_counter(fd)
                time.sleep(work)
                _write_counter(fd, value + 1)
                with writers.get_lock():
                    writers.value -= 1
                writes += 1
            lock.release()
        return {"acquisitions": reads + writes, "reads": reads, "writes": writes,
                "overlaps": violations + changed}

    def teardown(state: tuple[Any, Any, int]) -> None:
        state[0].close()
        os.close(state[2])

    _timed_phases(setup, loop, teardown)


def task_hold_until_killed(kind: str, ports: dict[str, int], name: str, ttl: float) -> None:
    """Acquire, report it, report each renewal after that; never return (the main process SIGKILLs us)."""
    impl = make_impl(kind, ports, ttl)
    _warm_up(impl)
    handle = impl.lock(name)
    handle.acquire()
    acquired = time.monotonic()
    renews = impl.on_renewal(handle, lambda: emit("renewed", time.monotonic()))
    emit("acquired", acquired, renews)
    while True:
        time.sleep(3600)


def task_wait_acquire(kind: str, ports: dict[str, int], name: str, ttl: float) -> float:
    """Connect, report ready; on "go" block in acquire(); return the moment it succeeded."""
    impl = make_impl(kind, ports, ttl)
    _warm_up(impl)
    emit("ready")
    inbox()
    handle = impl.lock(name)
    emit("waiting", time.monotonic())
    handle.acquire()
    acquired = time.monotonic()
    handle.release()
    impl.close()
    return acquired


def task_candidate(kind: str, ports: dict[str, int], name: str, identity: str, ttl: float, poll: float) -> float:
    """Campaign; once leader report "elected" and each renewal; on "resign" step down and return."""
    if kind == "tooz-redis":
        from tooz import coordination

        url = f"redis://{HOST}:{ports['redis']}?lock_timeout={int(ttl)}&membership_timeout={int(ttl)}"
        coordinator = coordination.get_coordinator(url, identity.encode())
        coordinator.start(start_heart=True)
        group = name.encode()
        with contextlib.suppress(coordination.GroupAlreadyExist):
            coordinator.create_group(group).get()
        coordinator.join_group(group).get()
        elected = threading.Event()
        coordinator.watch_elected_as_leader(group, lambda event: elected.set())
        emit("campaigning")
        while not elected.is_set():  # tooz elects in run_watchers(), which the application calls
            coordinator.run_watchers()
            if not elected.is_set():
                time.sleep(poll)
        emit("elected", time.monotonic(), identity)
        heartbeat = coordinator.heartbeat

        def heartbeat_and_tell() -> Any:
            result = heartbeat()
            emit("renewed", time.monotonic())
            return result

        coordinator.heartbeat = heartbeat_and_tell  # type: ignore[method-assign]
        inbox()
        resigning = time.monotonic()
        emit("resigning", resigning)
        coordinator.stop()  # the redis driver has no stand_down_group_leader: stop() releases the leader lock
        return resigning

    from celery_etcdlock import Election, connect

    api = "v2" if kind.endswith("v2") else "v3"
    client = connect(f"{'etcd' if api == 'v2' else 'etcd3'}://{HOST}:{ports[api]}?prefix={OURS_PREFIX}")
    election = Election(client, name, identity, ttl=ttl)
    emit("campaigning")
    election.campaign()
    emit("elected", time.monotonic(), identity)
    _http_renewal_hook(_ours_renewal(api), lambda: emit("renewed", time.monotonic()))
    inbox()
    resigning = time.monotonic()
    emit("resigning", resigning)
    election.resign()
    client.close()
    return resigning


def task_hold_many(kind: str, ports: dict[str, int], count: int, ttl: float) -> dict:
    """Acquire ``count`` locks; report "held"; count own requests between "start" and "stop"; release."""
    impl = make_impl(kind, ports, ttl)
    tag = uuid.uuid4().hex[:8]
    started = time.monotonic()
    handles = []
    for i in range(count):
        handle = impl.lock(f"hold-{tag}-{i}")
        handle.acquire()
        handles.append(handle)
    emit("held", time.monotonic() - started)
    inbox()
    sent, began = requests_sent(), time.monotonic()
    inbox()
    window_requests, window = requests_sent() - sent, time.monotonic() - began
    for handle in handles:
        handle.release()
    impl.close()
    return {"client_requests": window_requests, "window": window}


# ---------------------------------------------------------------------------------------------
# Orchestration in the main process
# ---------------------------------------------------------------------------------------------


@dataclass
class Settings:
    quick: bool
    apis: list[str]
    only: list[str]
    uncontended_iterations: int = 300
    uncontended_warmup: int = 20
    contention_procs: list[int] = field(default_factory=lambda: [2, 8, 32])
    contention_seconds: float = 2.0
    contention_rounds: int = 3
    contention_ttl: float = 10.0
    killed_trials: int = 2
    failover_ttl: float = 3.0
    resign_trials: int = 4
    kill_trials: int = 2
    tooz_poll: float = 0.1
    # (seconds of work under the lock, process counts): 20 ms at every count, and 5 ms at 8 processes,
    # where both locks are bound by their own request rate on 2 cores rather than by the work
    rw_cells: list[tuple[float, list[int]]] = field(default_factory=lambda: [(0.020, [2, 8, 32]), (0.005, [8])])
    rw_seconds: float = 3.0
    rw_read_share: float = 0.9
    hold_count: int = 500
    hold_ttl: float = 5.0
    hold_window: float = 10.0

    @classmethod
    def make(cls, quick: bool, apis: list[str], only: list[str]) -> Settings:
        if not quick:
            return cls(quick, apis, only)
        return cls(
            quick, apis, only,
            uncontended_iterations=50, uncontended_warmup=5,
            contention_procs=[2, 8], contention_seconds=1.0, contention_rounds=1,
            killed_trials=1, resign_trials=2, kill_trials=1,
            rw_cells=[(0.020, [8])], rw_seconds=1.0,
            hold_count=100, hold_window=2.0,
        )


class Bench:
    def __init__(self, settings: Settings, servers: Servers, pool: Pool) -> None:
        self.settings = settings
        self.servers = servers
        self.ports = servers.ports()
        self.pool = pool
        self.results: dict[str, Any] = {"settings": settings.__dict__, "notes": []}
        self.unavailable = {api: ours_available(api) for api in ("v2", "v3")}
        for api, why in self.unavailable.items():
            if why and api in settings.apis:
                self.note(f"celery_etcdlock on {api} not benchmarked: {why}")
        self.tmp = tempfile.mkdtemp(prefix="counters-", dir=servers.workdir)  # removed with the servers

    def note(self, text: str) -> None:
        self.results["notes"].append(text)
        print(f"  note: {text}", flush=True)

    def kinds(self, floors: bool = True) -> list[str]:
        wanted = []
        for key, kind in KINDS.items():
            if kind.floor and not floors:
                continue
            if kind.server in ("v2", "v3") and kind.server not in self.settings.apis:
                continue
            if kind.ours and self.unavailable[kind.server]:
                continue
            wanted.append(key)
        return wanted

    def ours_apis(self) -> list[str]:
        return [api for api in self.settings.apis if not self.unavailable[api]]

    # -- snapshots of the server-side counters -------------------------------------------------

    def snapshot(self, server: str) -> Any:
        if server == "redis":
            assert self.servers.redis is not None
            return self.servers.redis.commands()
        etcd = self.servers.v2 if server == "v2" else self.servers.v3
        assert etcd is not None
        return etcd.metrics()

    def counted(self, server: str, before: Any, after: Any) -> dict[str, float]:
        if server == "redis":
            return {"requests": after - before - 1, "proposals": math.nan}
        etcd = self.servers.v2 if server == "v2" else self.servers.v3
        assert etcd is not None
        return {
            "requests": after.delta(before, etcd.requests_metric),
            "proposals": after.delta(before, "etcd_server_proposals_committed_total"),
        }

    def new_counter(self) -> str:
        path = tempfile.mktemp(prefix="counter-", dir=self.tmp)
        with open(path, "wb") as out:
            out.write(b"%020d" % 0)
        return path

    # -- a timed multi-process run -------------------------------------------------------------

    def timed_run(self, server: str, target: str, kwargs_list: list[dict], seconds: float, counter: str) -> dict:
        """Start the tasks, wait until all are set up, snapshot counters, run for ``seconds``, snapshot."""
        pool, n = self.pool, len(kwargs_list)
        pool.grow(n)
        pool.reset_shared()
        if server == "v3" and self.servers.v3 is not None:
            self.servers.v3.revoke_all_leases()
        for i, kwargs in enumerate(kwargs_list):
            pool[i].run(target, **kwargs)
        broken: dict[int, str] = {}
        for i in range(n):
            try:
                pool[i].next_event(120)
            except (WorkerError, TimeoutError) as exc:
                broken[i] = str(exc)
        before = self.snapshot(server)
        start_at = time.monotonic() + 0.2
        end_at = start_at + seconds
        for i in range(n):
            if i not in broken:
                pool[i].send(("go", start_at, end_at))
        stats: list[dict] = []
        for i in range(n):
            if i in broken:
                continue
            try:
                event = pool[i].next_event(max(0.0, end_at + 20 + seconds - time.monotonic()))
                stats.append(event[1])
            except (WorkerError, TimeoutError) as exc:
                broken[i] = str(exc)
        after = self.snapshot(server)
        for i in range(n):
            if i not in broken:
                pool[i].send("close")
        for i in range(n):
            if i in broken:
                continue
            try:
                pool[i].result(60)
            except (WorkerError, TimeoutError) as exc:
                broken[i] = str(exc)
        for i in broken:
            pool.replace(i)
        for i in range(n):
            pool[i].wait_ready()
        with open(counter, "rb") as f:
            final = int(f.read() or b"0")
        acquisitions = [s["acquisitions"] for s in stats]
        total = sum(acquisitions)
        wall = (max(s["finished"] for s in stats) - start_at) if stats else math.nan
        result = {
            "procs": n,
            "acquisitions": acquisitions,
            "total": total,
            "seconds": wall,
            "overlaps": sum(s["overlaps"] for s in stats),
            "client_requests": sum(s["client_requests"] for s in stats),
            "counter": final,
            "broken": list(broken.values()),
            **self.counted(server, before, after),
        }
        if "writes" in (stats[0] if stats else {}):
            result["reads"] = sum(s["reads"] for s in stats)
            result["writes"] = sum(s["writes"] for s in stats)
        return result

    # -- workloads -------------------------------------------------------------------------------

    def uncontended(self) -> None:
        s = self.settings
        kinds = self.kinds()
        print(f"uncontended: {', '.join(kinds)} x {s.uncontended_iterations}, interleaved", flush=True)
        self.pool.grow(1)
        self.pool[0].run("bench.bench_locks:task_uncontended", ports=self.ports, kinds=kinds,
                         iterations=s.uncontended_iterations, warmup=s.uncontended_warmup, ttl=30.0)
        raw = self.pool[0].result(600)
        out = {}
        for kind, data in raw.items():
            out[kind] = {
                "median_ms": median(data["ms"]),
                "p99_ms": percentile(data["ms"], 99),
                "requests_per_op": data["requests_per_op"],
                "n": len(data["ms"]),
            }
        self.results["uncontended"] = out

    def contention(self) -> None:
        s = self.settings
        kinds = self.kinds(floors=False)
        runs: dict[str, dict[int, list[dict]]] = {k: {n: [] for n in s.contention_procs} for k in kinds}
        for round_no in range(s.contention_rounds):
            order = kinds if round_no % 2 == 0 else list(reversed(kinds))
            for n in s.contention_procs:
                for kind in order:
                    counter = self.new_counter()
                    name = f"contend-{kind}-{n}-{round_no}-{uuid.uuid4().hex[:6]}"
                    kwargs = dict(kind=kind, ports=self.ports, name=name, counter=counter, ttl=s.contention_ttl)
                    run = self.timed_run(KINDS[kind].server, "bench.bench_locks:task_contend",
                                         [kwargs] * n, s.contention_seconds, counter)
                    runs[kind][n].append(run)
                    lost = run["total"] - run["counter"]
                    print(f"contention round {round_no + 1} {kind:13} x{n:<2}: {run['total']:6} handoffs "
                          f"{run['total'] / run['seconds']:7.1f}/s lost={lost} overlaps={run['overlaps']}"
                          f"{' BROKEN: ' + str(len(run['broken'])) if run['broken'] else ''}", flush=True)
        self.results["contention"] = {k: {str(n): _merge_runs(r) for n, r in by_n.items()} for k, by_n in runs.items()}

    def rwlock(self) -> None:
        s = self.settings
        out: dict[str, dict[str, dict[str, Any]]] = {}
        for work, procs in s.rw_cells:
            for n in procs:
                for api in self.ours_apis():
                    for mode in ("rwlock", "mutex"):
                        counter = self.new_counter()
                        name = f"rw-{mode}-{n}-{uuid.uuid4().hex[:6]}"
                        kwargs_list = [dict(api=api, ports=self.ports, mode=mode, name=name, counter=counter,
                                            ttl=s.contention_ttl, read_share=s.rw_read_share, work=work,
                                            seed=i) for i in range(n)]
                        run = self.timed_run(api, "bench.bench_locks:task_rw_mix", kwargs_list, s.rw_seconds,
                                             counter)
                        merged = _merge_runs([run])
                        out.setdefault(f"{mode}-{api}-{work * 1000:.0f}", {})[str(n)] = merged
                        print(f"rwlock {mode:6} {api} {work * 1000:.0f} ms x{n:<2}: {merged['per_second']:7.1f} ops/s "
                              f"lost={merged['lost']} overlaps={merged['overlaps']}", flush=True)
        self.results["rwlock"] = out

    def killed(self) -> None:
        s = self.settings
        kinds = self.kinds(floors=False)
        self.pool.grow(2 * len(kinds))
        out: dict[str, list[dict]] = {k: [] for k in kinds}
        for trial in range(s.killed_trials):
            threads = []
            for i, kind in enumerate(kinds):
                def one(i: int = i, kind: str = kind, trial: int = trial) -> None:
                    try:
                        out[kind].append(self._killed_trial(kind, 2 * i, 2 * i + 1, trial))
                    except Exception:  # noqa: BLE001 - reported in the results
                        out[kind].append({"error": traceback.format_exc()})
                threads.append(threading.Thread(target=one))
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for kind in kinds:
                last = out[kind][-1]
                print(f"killed holder trial {trial + 1} {kind:13}: "
                      f"{fmt(last.get('after_kill'))} s after kill, "
                      f"{fmt(last.get('after_renewal'))} s after last renewal{' ERROR' if 'error' in last else ''}",
                      flush=True)
        self.results["killed"] = out

    def _killed_trial(self, kind: str, holder_index: int, waiter_index: int, trial: int) -> dict:
        ttl = self.settings.failover_ttl
        name = f"killed-{kind}-{trial}-{uuid.uuid4().hex[:6]}"
        pool = self.pool
        holder, waiter = pool[holder_index].wait_ready(), pool[waiter_index].wait_ready()
        waiter.run("bench.bench_locks:task_wait_acquire", kind=kind, ports=self.ports, name=name, ttl=ttl)
        waiter.wait_for("ready", 60)
        holder.run("bench.bench_locks:task_hold_until_killed", kind=kind, ports=self.ports, name=name, ttl=ttl)
        _, acquired_at, renews = holder.wait_for("acquired", 60)
        waiter.send("go")
        waiter.wait_for("waiting", 60)
        time.sleep(0.3)  # the waiter's acquire() is queued by now
        last_sign_of_life = acquired_at
        if renews:
            holder.drain()  # renewals that happened before the waiter queued
            _, last_sign_of_life = holder.wait_for("renewed", ttl * 2)
        killed_at = holder.kill()
        pool.replace(holder_index)
        waiter_got = waiter.result(ttl * 4 + 10)
        pool[holder_index].wait_ready()
        return {"after_kill": waiter_got - killed_at, "after_renewal": waiter_got - last_sign_of_life,
                "renews": renews}

    def election(self) -> None:
        kinds = [f"ours-{api}" for api in self.ours_apis()] + ["tooz-redis"]
        self.pool.grow(3 * len(kinds))
        out: dict[str, dict[str, Any]] = {}
        threads = []
        for i, kind in enumerate(kinds):
            def one(i: int = i, kind: str = kind) -> None:
                try:
                    out[kind] = self._election_trials(kind, list(range(3 * i, 3 * i + 3)))
                except Exception:  # noqa: BLE001 - reported in the results
                    out[kind] = {"error": traceback.format_exc()}
            threads.append(threading.Thread(target=one))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for kind, data in out.items():
            if "error" in data:
                print(f"election {kind}: ERROR\n{data['error']}", flush=True)
            else:
                print(f"election {kind:10}: resign -> {', '.join(f'{x * 1000:.0f} ms' for x in data['resign'])}; "
                      f"SIGKILL -> {', '.join(f'{x:.2f} s' for x in data['kill'])}", flush=True)
        self.results["election"] = out

    def _election_trials(self, kind: str, indexes: list[int]) -> dict:
        s = self.settings
        ttl, pool = s.failover_ttl, self.pool
        name = f"election-{kind}-{uuid.uuid4().hex[:6]}"
        serial = iter(range(1000))
        campaigning: set[int] = set()

        def wait_campaigning(index: int) -> None:
            if index not in campaigning:
                pool[index].wait_for("campaigning", 60)
            campaigning.discard(index)

        def start_candidate(index: int) -> None:
            campaigning.discard(index)
            pool[index].wait_ready().run("bench.bench_locks:task_candidate", kind=kind, ports=self.ports,
                                         name=name, identity=f"cand-{next(serial)}", ttl=ttl, poll=s.tooz_poll)

        def next_elected(timeout: float) -> tuple[int, float]:
            deadline = time.monotonic() + timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{kind}: nobody elected within {timeout}s")
                busy = [i for i in indexes if pool[i].busy]
                ready = common.multiprocessing.connection.wait([pool[i].conn for i in busy], left)
                for conn in ready:
                    index = next(i for i in busy if pool[i].conn is conn)
                    event = pool[index].next_event(0)
                    if event[0] == "campaigning":
                        campaigning.add(index)
                    if event[0] == "elected":
                        return index, event[1]

        for index in indexes:
            start_candidate(index)
        leader, _ = next_elected(120)
        for index in indexes:  # everyone in the race before the first trial
            if index != leader:
                wait_campaigning(index)
        time.sleep(0.5)
        resign: list[float] = []
        kill: list[float] = []
        kill_after_renewal: list[float] = []
        for _ in range(s.resign_trials):
            pool[leader].send("resign")
            _, resigned_at = pool[leader].wait_for("resigning", 30)
            pool[leader].result(30)
            new_leader, elected_at = next_elected(30)
            resign.append(elected_at - resigned_at)
            start_candidate(leader)
            wait_campaigning(leader)
            time.sleep(0.3)
            leader = new_leader
        for _ in range(s.kill_trials):
            pool[leader].drain()
            # kill right after a renewal: the longest its entry can outlive it
            _, renewed_at = pool[leader].wait_for("renewed", ttl * 2)
            killed_at = pool[leader].kill()
            pool.replace(leader).wait_ready()
            start_candidate(leader)  # a fresh third candidate, as a restarted host would be
            new_leader, elected_at = next_elected(ttl * 4 + 10)
            kill.append(elected_at - killed_at)
            kill_after_renewal.append(elected_at - renewed_at)
            leader = new_leader
        for index in indexes:  # end the candidates: the waiting ones are blocked in campaign()
            pool.replace(index)
        for index in indexes:
            pool[index].wait_ready()
        return {"resign": resign, "kill": kill, "kill_after_renewal": kill_after_renewal}

    def hold(self) -> None:
        s = self.settings
        kinds = [f"ours-{api}" for api in self.ours_apis()] + (["tooz-etcd3gw"] if "v3" in s.apis else [])
        out = {}
        self.pool.grow(len(kinds))
        for i, kind in enumerate(kinds):
            server = KINDS[kind].server
            # a worker of its own: what an earlier task left running (a v2 session removing 500 empty
            # queue directories a while after their locks were released) must not count here
            worker = self.pool[i]
            worker.run("bench.bench_locks:task_hold_many", kind=kind, ports=self.ports, count=s.hold_count,
                       ttl=s.hold_ttl)
            _, acquire_seconds = worker.next_event(600)
            time.sleep(min(2.0, s.hold_ttl / 2))  # let every renewal schedule settle
            before = self.snapshot(server)
            worker.send("start")
            time.sleep(s.hold_window)
            worker.send("stop")
            after = self.snapshot(server)
            client = worker.result(600)
            etcd = self.servers.v2 if server == "v2" else self.servers.v3
            assert etcd is not None
            if server == "v2":  # a v2 session refreshes each key: PUT ...?refresh=true
                keepalive = after.delta(before, "etcd_http_received_total", method="PUT")
                metric = 'etcd_http_received_total{method="PUT"}'
            else:
                keepalive = after.delta(before, "grpc_server_msg_received_total", grpc_method="LeaseKeepAlive")
                metric = 'grpc_server_msg_received_total{grpc_method="LeaseKeepAlive"}'
            out[kind] = {
                "locks": s.hold_count,
                "acquire_seconds": acquire_seconds,
                "keepalive_per_second": keepalive / s.hold_window,
                "requests_per_second": after.delta(before, etcd.requests_metric) / s.hold_window,
                "client_requests_per_second": client["client_requests"] / client["window"],
                "metric": metric,
            }
            print(f"hold {s.hold_count} {kind:13}: {out[kind]['keepalive_per_second']:.1f} keep-alive requests/s "
                  f"(acquiring took {acquire_seconds:.1f} s)", flush=True)
        self.results["hold"] = out


def _merge_runs(runs: list[dict]) -> dict:
    """Add up the rounds of one configuration (per-process counts are summed per process slot)."""
    procs = runs[0]["procs"]
    per_proc = [0] * procs
    for run in runs:
        for i, n in enumerate(run["acquisitions"]):
            per_proc[i] += n
    total = sum(r["total"] for r in runs)
    seconds = sum(r["seconds"] for r in runs)
    merged = {
        "procs": procs,
        "total": total,
        "seconds": seconds,
        "per_second": total / seconds if seconds else math.nan,
        "lost": sum(r["total"] - r["counter"] for r in runs),
        "overlaps": sum(r["overlaps"] for r in runs),
        "fairness": (min(per_proc) / max(per_proc)) if per_proc and max(per_proc) else math.nan,
        "per_proc_min": min(per_proc) if per_proc else 0,
        "per_proc_max": max(per_proc) if per_proc else 0,
        "proposals_per_op": sum(r["proposals"] for r in runs) / total if total else math.nan,
        "requests_per_op": sum(r["requests"] for r in runs) / total if total else math.nan,
        "client_requests_per_op": sum(r["client_requests"] for r in runs) / total if total else math.nan,
        "broken": [b for r in runs for b in r["broken"]],
        "rounds": len(runs),
    }
    if "writes" in runs[0]:
        merged["reads"] = sum(r["reads"] for r in runs)
        merged["writes"] = sum(r["writes"] for r in runs)
        merged["lost"] = sum(r["writes"] - r["counter"] for r in runs)
    return merged


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------

COUNTERS = {
    "v2": "etcd 3.4 v2: `etcd_server_proposals_committed_total`, requests = `etcd_http_received_total`",
    "v3": "etcd 3.5 v3: `etcd_server_proposals_committed_total`, requests = `grpc_server_msg_received_total` "
          "(the JSON gateway forwards each HTTP call as one gRPC message)",
    "redis": "redis: requests = `total_commands_processed` from INFO",
}


def report(results: dict) -> str:
    s = results["settings"]
    out: list[str] = []
    label = {k: v.label for k, v in KINDS.items()}
    label["tooz-redis"] = "tooz redis election"
    label["ours-v2"], label["ours-v3"] = "celery_etcdlock etcd://", "celery_etcdlock etcd3://"

    unc = results.get("uncontended")
    if unc:
        out.append(f"### Uncontended acquire+release ({s['uncontended_iterations']} each, interleaved round-robin)\n")
        rows = []
        for kind, r in unc.items():
            floor = unc.get(FLOOR_OF[KINDS[kind].server])
            rows.append([label[kind], KINDS[kind].server, r["median_ms"], r["p99_ms"],
                         ratio(r["median_ms"], floor and floor["median_ms"]),
                         ratio(r["p99_ms"], floor and floor["p99_ms"]), r["requests_per_op"]])
        out.append(markdown_table(["lock", "server", "median ms", "p99 ms", "median / floor", "p99 / floor",
                                   "requests per acquire+release"], rows))
        out.append("")

    con = results.get("contention")
    if con:
        out.append(f"### Contention: acquire / read-modify-write a file counter / release, "
                   f"{s['contention_rounds']} x {s['contention_seconds']} s per cell, ttl {s['contention_ttl']:.0f}\n")
        rows = []
        for kind, by_n in con.items():
            peer = {"ours-v2": "etcd.Lock", "ours-v3": "tooz-etcd3gw"}.get(kind)
            for n, r in by_n.items():
                peer_rate = con.get(peer, {}).get(n, {}).get("per_second") if peer else None
                rows.append([label[kind], n, r["per_second"], ratio(r["per_second"], peer_rate) if peer else None,
                             r["lost"], r["overlaps"], f"{r['fairness']:.2f} ({r['per_proc_min']}/{r['per_proc_max']})",
                             r["proposals_per_op"], r["requests_per_op"], r["client_requests_per_op"],
                             len(r["broken"]) or ""])
        out.append(markdown_table(["lock", "procs", "handoffs/s", "ours / peer", "lost updates", "overlaps",
                                   "fairness min/max", "proposals / handoff", "server requests / handoff",
                                   "client requests / handoff", "hung"], rows))
        out.append("\nCounters: " + "; ".join(COUNTERS.values()) + ".\n")

    killed = results.get("killed")
    if killed:
        out.append(f"### Holder SIGKILLed right after a renewal (ttl {s['failover_ttl']:.0f}): "
                   "a queued waiter acquires after\n")
        rows = []
        for kind, trials in killed.items():
            good = [t for t in trials if "error" not in t]
            rows.append([label[kind], ", ".join(f"{t['after_kill']:.2f}" for t in good) or "error",
                         ", ".join(f"{t['after_renewal']:.2f}" for t in good) or "error",
                         "yes" if good and good[0]["renews"] else "no (killed right after acquiring)"])
        out.append(markdown_table(["lock", "s after the kill", "s after its last renewal", "renews while held"], rows))
        out.append("")

    el = results.get("election")
    if el:
        out.append(f"### Election fail-over, 3 candidates, ttl {s['failover_ttl']:.0f}\n")
        rows = []
        for kind, r in el.items():
            if "error" in r:
                rows.append([label[kind], "error", "error"])
                continue
            rows.append([label[kind], ", ".join(f"{x * 1000:.0f}" for x in r["resign"]),
                         ", ".join(f"{x:.2f}" for x in r["kill"])])
        out.append(markdown_table(["election", "resign() -> new leader, ms", "SIGKILL after renewal -> new leader, s"],
                                  rows))
        out.append(f"\ntooz's candidates call run_watchers() every {s['tooz_poll'] * 1000:.0f} ms; its redis driver "
                   "has no stand_down_group_leader(), so it resigns with stop(), which releases the leader lock.\n")

    rw = results.get("rwlock")
    if rw:
        out.append(f"### RW lock, {s['rw_read_share'] * 100:.0f}/{100 - s['rw_read_share'] * 100:.0f} reads/writes, "
                   f"{s['rw_seconds']} s per cell, against Mutex doing the same work\n")
        rows = []
        for key, by_n in rw.items():
            mode, api, work = key.split("-")
            for n, r in by_n.items():
                mutex = rw.get(f"mutex-{api}-{work}", {}).get(n, {}).get("per_second")
                rows.append([f"{'RWLock' if mode == 'rwlock' else 'Mutex'} {api}", f"{work} ms", n, r["per_second"],
                             ratio(r["per_second"], mutex) if mode == "rwlock" else None, r["lost"], r["overlaps"],
                             r["proposals_per_op"], r["requests_per_op"]])
        out.append(markdown_table(["lock", "work", "procs", "acquisitions/s", "RWLock / Mutex", "lost updates",
                                   "exclusion violations", "proposals / acquisition", "requests / acquisition"], rows))
        out.append("")

    hold = results.get("hold")
    if hold:
        out.append(f"### {s['hold_count']} locks held with ttl {s['hold_ttl']:.0f} for {s['hold_window']:.0f} s\n")
        rows = [[label[k], r["keepalive_per_second"], r["requests_per_second"], r["client_requests_per_second"],
                 r["metric"]] for k, r in hold.items()]
        out.append(markdown_table(["lock", "keep-alive requests/s", "all server requests/s", "client requests/s",
                                   "keep-alive counter"], rows))
        out.append("")

    targets = check_targets(results)
    if targets:
        out.append("### Targets\n")
        out.append(markdown_table(["target", "measured", "met"], targets))
        out.append("")
    for note in results.get("notes", []):
        out.append(f"- note: {note}")
    return "\n".join(out)


def check_targets(results: dict) -> list[list[Any]]:
    rows: list[list[Any]] = []
    unc, con = results.get("uncontended", {}), results.get("contention", {})
    for api, limit in (("v2", 1.3), ("v3", 1.1)):
        ours, floor = unc.get(f"ours-{api}"), unc.get(f"floor-{api}")
        if ours and floor:
            r = ratio(ours["median_ms"], floor["median_ms"])
            rows.append([f"{api} uncontended acquire+release <= {limit}x raw floor (median)", f"{r:.2f}x", r <= limit])
    for api, peer, factor in (("v2", "etcd.Lock", 1.2), ("v3", "tooz-etcd3gw", 2.0)):
        ours = con.get(f"ours-{api}", {})
        big = ours.get("32") or (ours.get(max(ours, key=int)) if ours else None)
        if not big:
            continue
        n = str(big["procs"])
        small = ours.get("2")
        p = big["proposals_per_op"]
        if api == "v2":
            rows.append([f"v2 proposals per handoff at {n} procs <= 2.1", f"{p:.2f}", p <= 2.1])
        if small:
            drift = abs(p / small["proposals_per_op"] - 1)
            rows.append([f"{api} proposals per handoff at {n} procs within 10% of 2 procs",
                         f"{p:.2f} vs {small['proposals_per_op']:.2f} ({drift * 100:.0f}%)", drift <= 0.10])
        peer_rate = con.get(peer, {}).get(n, {}).get("per_second")
        if peer_rate:
            r = ratio(big["per_second"], peer_rate)
            rows.append([f"{api} handoffs/s at {n} procs >= {factor}x {peer}", f"{r:.2f}x", r >= factor])
        rows.append([f"{api} fairness min/max at {n} procs >= 0.9", f"{big['fairness']:.2f}", big["fairness"] >= 0.9])
    for kind, by_n in con.items():
        if KINDS[kind].ours:
            lost = sum(r["lost"] + r["overlaps"] for r in by_n.values())
            rows.append([f"{kind} zero lost updates / overlaps in every contention run", str(lost), lost == 0])
    for api in ("v2", "v3"):
        trials = [t for t in results.get("killed", {}).get(f"ours-{api}", []) if "error" not in t]
        if trials:
            worst = max(t["after_kill"] for t in trials)
            rows.append([f"{api} SIGKILLed holder (ttl 3): waiter acquires <= 3.3 s", f"{worst:.2f} s", worst <= 3.3])
    for api in ("v2", "v3"):
        el = results.get("election", {}).get(f"ours-{api}")
        if el and "error" not in el:
            if el["kill"]:
                worst = max(el["kill"])
                rows.append([f"{api} election SIGKILL -> new leader <= ttl + 0.3 s", f"{worst:.2f} s", worst <= 3.3])
            if el["resign"]:
                worst = max(el["resign"])
                rows.append([f"{api} election resign -> new leader <= 30 ms", f"{worst * 1000:.0f} ms", worst <= 0.030])
    rw = results.get("rwlock", {})
    for api in ("v2", "v3"):
        lost = 0
        for work in sorted({key.split("-")[2] for key in rw}, key=int, reverse=True):
            rwl, mtx = rw.get(f"rwlock-{api}-{work}", {}), rw.get(f"mutex-{api}-{work}", {})
            if "8" in rwl and "8" in mtx:
                r = ratio(rwl["8"]["per_second"], mtx["8"]["per_second"])
                rows.append([f"{api} RWLock 90/10 at 8 procs, {work} ms work, >= 3x Mutex", f"{r:.2f}x", r >= 3])
            if len(rwl) > 1:
                values = [rwl[n]["requests_per_op"] for n in sorted(rwl, key=int)]
                spread = max(values) / min(values) - 1
                rows.append([f"{api} RWLock requests per acquisition constant over {', '.join(sorted(rwl, key=int))} "
                             f"procs", " / ".join(f"{v:.2f}" for v in values) + f" ({spread * 100:.0f}% spread)",
                             spread <= 0.15])
            lost += sum(r["lost"] + r["overlaps"] for r in list(rwl.values()) + list(mtx.values()))
        if any(key.split("-")[1] == api for key in rw):
            rows.append([f"{api} RWLock/Mutex zero lost updates / exclusion violations", str(lost), lost == 0])
    hold = results.get("hold", {}).get("ours-v3")
    if hold:
        k = hold["keepalive_per_second"]
        rows.append([f"v3 {hold['locks']} locks held: <= 1 keep-alive request/s", f"{k:.2f}/s", k <= 1])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_locks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run (about a minute)")
    parser.add_argument("--apis", default="v2,v3", help="etcd APIs to run: v2, v3 or v2,v3 (default)")
    workloads = ["uncontended", "contention", "killed", "election", "rwlock", "hold"]
    parser.add_argument("--only", default="", help=f"comma-separated subset of: {', '.join(workloads)}")
    parser.add_argument("--json", metavar="PATH", help="also write every raw number to this JSON file")
    args = parser.parse_args(argv)
    apis = [a.strip() for a in args.apis.split(",") if a.strip()]
    if not apis or any(a not in ("v2", "v3") for a in apis):
        parser.error(f"--apis takes v2, v3 or v2,v3, not {args.apis!r}")
    only = [w.strip() for w in args.only.split(",") if w.strip()] or workloads
    unknown = [w for w in only if w not in workloads]
    if unknown:
        parser.error(f"--only: unknown workload(s) {', '.join(unknown)}; choose from {', '.join(workloads)}")
    settings = Settings.make(args.quick, apis, only)

    began = time.monotonic()
    preload = ["bench.bench_locks", "celery_etcdlock", "etcd", "etcd3gw", "redis_lock", "tooz.coordination",
               "tooz.drivers.etcd3gw", "tooz.drivers.redis"]
    pool = Pool(preload=preload, shared=["inside", "readers", "writers"])
    try:
        with Servers(etcd_v2="v2" in apis, etcd_v3="v3" in apis, redis=True) as servers:
            print(f"servers up: {servers.ports()}", flush=True)
            bench = Bench(settings, servers, pool)
            needed = [16]
            if "contention" in only:
                needed += settings.contention_procs
            if "rwlock" in only:
                needed += [n for _, procs in settings.rw_cells for n in procs]
            pool.grow(max(needed))
            for workload in workloads:
                if workload in only:
                    getattr(bench, workload)()
            results = bench.results
    finally:
        pool.close()
    results["seconds"] = time.monotonic() - began
    text = report(results)
    print("\n" + text)
    print(f"\n(run took {results['seconds']:.0f} s; python {sys.version.split()[0]}, {os.cpu_count()} CPUs)")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
