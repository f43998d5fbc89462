"""The scale workloads, as the main process runs them: start host processes, wait, measure a window.

    rows = idle_fleet(target, pool, settings, kind="ours")    # also "floor" and "tooz"
    rows = busy_fleet(target, pool, settings, kind="ours")    # also "floor"
    rows = hot_keys(target, pool, settings); rows = beats(target, pool, settings)
    rows = renewal_read(target, sizes)

Each returns a list of dicts (one row each, every raw number kept for the JSON). A window
starts only once the work is in its steady state (every lock held, a full renewal period
passed), and every wait has a deadline.
"""

from __future__ import annotations

import math
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from bench.common import Pool, Worker, cpu_seconds, percentile, wait_for
from bench.scale.target import Target, Window, b64, machine_load

FLEET = "bench.scale.fleet"


@dataclass
class Settings:
    quick: bool
    hosts: int = 4  # host processes for a fleet (the machine has 2 cores; more would only add switching)
    fleet_sizes: list[int] = field(default_factory=lambda: [10, 100, 1000])
    locks_per_client: list[int] = field(default_factory=lambda: [0, 1, 10, 100])
    ttl: float = 10.0
    other_ttls: list[float] = field(default_factory=lambda: [30.0])  # at N=100, K=1: the cost against the TTL
    window: float = 6.0  # rounded to whole renewal periods (window_for)
    max_locks: int = 10_000  # idle cells with more locks in all (N x K) run last, as the "big" step
    big: bool = False  # this idle step runs only the cells beyond max_locks
    big_cells: bool = True  # run them (the cluster's N=1000 x K=100: 100,000 locks)
    deadline: float = float("inf")  # monotonic: cells not started by then are skipped (the run stops itself)
    floor_cells: list[tuple[int, int]] = field(default_factory=lambda: [(100, 10), (1000, 10)])
    tooz_cells: list[tuple[int, int]] = field(default_factory=lambda: [(10, 1), (100, 10)])
    busy_threads: list[int] = field(default_factory=lambda: [1, 8, 32])
    busy_seconds: float = 4.0
    hot_names: int = 3
    hot_waiters: int = 100
    hot_hold: float = 0.002
    beat_followers: list[int] = field(default_factory=lambda: [2, 10, 50])
    beat_ttl: float = 10.0
    renewal_sizes: list[int] = field(default_factory=lambda: [100, 10_000, 100_000])

    @classmethod
    def make(cls, quick: bool) -> Settings:
        if not quick:
            return cls(quick)
        return cls(
            quick,
            hosts=2,
            fleet_sizes=[10, 100],
            locks_per_client=[0, 1, 10],
            other_ttls=[],
            window=4.0,
            floor_cells=[(100, 1)],
            tooz_cells=[(10, 1)],
            busy_threads=[1, 8],
            busy_seconds=2.0,
            hot_names=1,
            hot_waiters=20,
            beat_followers=[2],
            beat_ttl=3.0,
            renewal_sizes=[100, 10_000],
        )


def _row(window: Window, **fields: Any) -> dict[str, Any]:
    measured = dict(
        requests=window.requests,
        requests_per_s=window.requests_per_s,
        proposals_per_s=window.proposals_per_s,
        etcd_cpu_per_s=window.cpu_per_s,
        etcd_rss_mb=window.rss_mb,
        keys=window.keys,
        watchers=window.watchers,
        by_method=window.by_method,
        seconds=window.seconds,
        load=machine_load(),
    )
    return {**fields, **measured}


def renewal_period(ttl: float) -> float:
    """How often a session renews: a third of the TTL etcd is given (``server_ttl``)."""
    from celery_etcdlock.etcd.base import server_ttl

    return server_ttl(ttl) / 3


def window_for(seconds: float, ttl: float) -> float:
    """``seconds`` rounded to whole renewal periods: clients that joined together renew in step, so a
    window of 1.5 periods would catch one burst or two, and read as 0.67 or 1.33 times the true rate."""
    period = renewal_period(ttl)
    return period * max(1, round(seconds / period))


def _measure(target: Target, seconds: float, hosts: list[Worker]) -> tuple[Window, float]:
    """A window of ``seconds``: the server's rates, and the CPU seconds the host processes used in it."""
    cpu0 = sum(cpu_seconds(h.pid) for h in hosts if h.pid)
    before = target.sample()
    time.sleep(seconds)  # the measured interval itself, not a synchronisation
    window = target.sample().since(before)
    return window, sum(cpu_seconds(h.pid) for h in hosts if h.pid) - cpu0


def _split(items: list[Any], parts: int) -> list[list[Any]]:
    return [items[i::parts] for i in range(parts) if items[i::parts]]


def _start(pool: Pool, target_fn: str, kwargs_list: list[dict[str, Any]], timeout: float) -> list[Worker]:
    pool.grow(len(kwargs_list))
    hosts = [pool[i] for i in range(len(kwargs_list))]
    for host, kwargs in zip(hosts, kwargs_list, strict=True):
        host.run(f"{FLEET}:{target_fn}", **kwargs)
    for host in hosts:
        host.wait_for("ready", timeout)
    return hosts


def _hold(hosts: list[Worker], k: int, timeout: float) -> tuple[int, int, int]:
    for host in hosts:
        host.send(("hold", k))
    totals = [host.wait_for("held", timeout)[1:] for host in hosts]
    return sum(t[0] for t in totals), sum(t[1] for t in totals), sum(t[2] for t in totals)


def _stop(hosts: list[Worker], timeout: float) -> None:
    for host in hosts:
        host.send(("stop",))
    for host in hosts:
        host.result(timeout)


# -- the idle fleet ---------------------------------------------------------------------------------


def idle_fleet(target: Target, pool: Pool, settings: Settings, kind: str) -> list[dict[str, Any]]:
    """N clients, each holding K locks, for every N and K (ours), or the floor's and tooz's cells."""
    if kind == "ours":
        cells = {n: list(settings.locks_per_client) for n in settings.fleet_sizes}
        ttls = {settings.ttl: cells} | {ttl: {100: [1]} for ttl in settings.other_ttls}
    else:
        chosen = settings.floor_cells if kind == "floor" else settings.tooz_cells
        cells = {}
        for n, k in chosen:
            cells.setdefault(n, []).append(k)
        ttls = {settings.ttl: cells}
    rows = []
    for ttl, by_n in ttls.items():
        for n, ks in by_n.items():
            mine = sorted(k for k in ks if (n * k > settings.max_locks) == settings.big)
            if mine:
                rows += _idle_cells(target, pool, settings, kind, n, mine, ttl)
    return rows


def _idle_cells(
    target: Target, pool: Pool, settings: Settings, kind: str, n: int, ks: list[int], ttl: float
) -> list[dict[str, Any]]:
    name = f"idle-{uuid.uuid4().hex[:8]}"
    prefix = f"/scale-{name}"
    hosts_n = min(settings.hosts, n)
    if kind == "ours":
        urls = _split(target.urls(n, seed=n, prefix=prefix), hosts_n)
        kwargs = [dict(urls=u, ttl=ttl, name=f"held/h{i}") for i, u in enumerate(urls)]
        fn = "idle_host"
    elif kind == "floor":
        shares = [len(s) for s in _split(list(range(n)), hosts_n)]
        lease_ttl = round(3 * renewal_period(ttl))  # the TTL our sessions ask etcd for
        kwargs = [dict(endpoint=target.endpoints[i % len(target.endpoints)], clients=c, ttl=lease_ttl,
                       name=f"{prefix}/floor{i}") for i, c in enumerate(shares)]  # fmt: skip
        fn = "floor_idle_host"
    else:
        shares = [len(s) for s in _split(list(range(n)), hosts_n)]
        endpoint = target.endpoints[0]  # tooz's etcd3gw driver takes one host:port
        kwargs = [dict(url=f"etcd3+http://{endpoint}", clients=c, ttl=ttl, name=f"{name}-{i}")
                  for i, c in enumerate(shares)]  # fmt: skip
        fn = "tooz_host"
    started = time.monotonic()
    hosts = _start(pool, fn, kwargs, timeout=120 + n * 0.5)
    rows = []
    try:
        for k in ks:
            if time.monotonic() > settings.deadline:
                print(f"  idle {kind} N={n} K={k}: skipped, the run's time budget is spent", flush=True)
                continue
            t0 = time.monotonic()
            held, failed, lost = _hold(hosts, k, timeout=120 + n * k * 0.05)
            acquire_s = time.monotonic() - t0
            time.sleep(ttl / 3 + 1.0)  # a full renewal period of every client at the new K: the steady state
            window, client_cpu = _measure(target, window_for(settings.window, ttl), hosts)
            held_after, _, lost_after = _hold(hosts, k, timeout=60)  # nothing to acquire: a check that all held
            rows.append(_row(window, kind=kind, target=target.kind, n=n, k=k, ttl=ttl, held=held_after,
                             failed=failed, lost=lost_after, acquire_s=acquire_s, leases=target.leases(),
                             client_cpu_per_client=client_cpu / window.seconds / n))  # fmt: skip
            print(f"  idle {kind:<5} {target.kind:<7} ttl {ttl:g} N={n:<5} K={k:<4} "
                  f"{window.requests_per_s:8.1f} req/s {window.proposals_per_s:7.1f} prop/s "
                  f"etcd cpu {window.cpu_per_s:.2f} held {held_after} failed {failed} lost {lost_after} "
                  f"(acquired in {acquire_s:.0f}s; load {machine_load()})", flush=True)  # fmt: skip
            top = sorted(window.by_method.items(), key=lambda item: -item[1])[:4]
            print("       by method: " + ", ".join(f"{m} {v:.1f}/s" for m, v in top), flush=True)
    finally:
        _stop(hosts, timeout=120 + n)
    target.revoke_all()
    print(f"  ({kind} N={n} took {time.monotonic() - started:.0f}s)", flush=True)
    return rows


# -- the busy fleet ---------------------------------------------------------------------------------


def busy_fleet(target: Target, pool: Pool, settings: Settings, kind: str) -> list[dict[str, Any]]:
    """Closed loops of singleton runs on distinct keys, more at each level, until etcd (or the machine) saturates."""
    name = f"busy-{uuid.uuid4().hex[:8]}"
    top = max(settings.busy_threads)
    hosts_n = min(settings.hosts, top)
    per_host = math.ceil(top / hosts_n)
    urls = target.urls(hosts_n, seed=7, prefix=f"/scale-{name}")
    kwargs = [dict(url=urls[i], endpoint=target.endpoints[i % len(target.endpoints)], kind=kind, threads=per_host,
                   name=f"/scale-{name}/floor", levels=len(settings.busy_threads)) for i in range(hosts_n)]  # fmt: skip
    hosts = _start(pool, "busy_host", kwargs, timeout=180)
    rows = []
    try:
        for threads in settings.busy_threads:
            active = [len(s) for s in _split(list(range(threads)), hosts_n)]
            start = time.monotonic() + 1.0
            for host, count in zip(hosts, active, strict=False):
                host.send(("go", start, settings.busy_seconds, count))
            time.sleep(max(0.0, start - time.monotonic()))
            window, client_cpu = _measure(target, settings.busy_seconds, hosts)
            levels = [host.wait_for("done", 120) for host in hosts[: len(active)]]
            runs = sum(level[1] for level in levels)
            rows.append(_row(window, kind=kind, target=target.kind, threads=threads, runs=runs,
                             runs_per_s=runs / settings.busy_seconds, client_cpu_per_s=client_cpu / window.seconds,
                             requests_per_run=window.requests / max(1, runs),
                             proposals_per_run=window.proposals / max(1, runs),
                             etcd_cpu_ms_per_run=1000 * window.cpu / max(1, runs)))  # fmt: skip
        for host in hosts:
            host.send(("stop",))
        results = [host.result(120) for host in hosts]
    except BaseException:
        for host in hosts:
            pool.replace(pool.workers.index(host))
        raise
    for level, row in enumerate(rows):
        flat = [x for r in results if level < len(r["levels"]) for x in r["levels"][level]["latencies"]]
        row.update(p50_ms=1000 * percentile(flat, 50), p99_ms=1000 * percentile(flat, 99),
                   errors=sum(r["levels"][level]["errors"] for r in results if level < len(r["levels"])))  # fmt: skip
        print(f"  busy {kind:<5} {target.kind:<7} {row['threads']:>3} loops {row['runs_per_s']:7.0f} runs/s "
              f"p50 {row['p50_ms']:.1f} ms p99 {row['p99_ms']:.1f} ms {row['requests_per_run']:.2f} req/run "
              f"{row['proposals_per_run']:.2f} prop/run etcd {row['etcd_cpu_ms_per_run']:.2f} ms/run "
              f"(load {row['load']})", flush=True)  # fmt: skip
    target.revoke_all()
    return rows


# -- hot keys ---------------------------------------------------------------------------------------


def hot_keys(target: Target, pool: Pool, settings: Settings) -> list[dict[str, Any]]:
    """A few hot locks with many waiters each, all queued behind one holder; then the holders release."""
    from celery_etcdlock import Mutex, connect
    from celery_etcdlock.keys import LOCKS, queue_key

    tag = uuid.uuid4().hex[:8]
    prefix = f"/scale-hot-{tag}"
    names = [f"hot-{i}" for i in range(settings.hot_names)]
    holder = connect(target.urls(1, seed=3, prefix=prefix)[0], retry_max_delay=30)
    locks = [Mutex(holder, name, ttl=settings.ttl) for name in names]
    for lock in locks:
        assert lock.acquire(blocking=False)
    waiters = settings.hot_names * settings.hot_waiters
    hosts_n = min(settings.hosts, waiters)
    urls = target.urls(waiters, seed=5, prefix=prefix)
    shares = _split(list(range(waiters)), hosts_n)
    # each host gets whole rounds of the names, so every name has hot_waiters waiters in all
    per_host = [len(share) // len(names) or 1 for share in shares]
    kwargs: list[dict[str, Any]] = [
        dict(urls=[urls[i] for i in share], names=names, per_name=count, ttl=settings.ttl, hold=settings.hot_hold)
        for share, count in zip(shares, per_host, strict=True)
    ]
    expected = sum(per_host)  # waiters per name
    hosts = _start(pool, "hot_waiters", kwargs, timeout=180)
    queues = [f"{prefix}/{queue_key(LOCKS, name)}/" for name in names]
    wait_for(lambda: all(target.count(q) >= expected + 1 for q in queues), 300, "every waiter to be queued")
    wait_for(lambda: target.sample().watchers >= len(names) * expected, 60, "every waiter to watch")
    time.sleep(1.0)  # let the waiters' start-up requests pass before counting
    before = target.sample()
    for lock in locks:
        lock.release()
    done = [host.wait_for("done", 600) for host in hosts]
    window = target.sample().since(before)
    for host in hosts:
        host.send(("stop",))
    results = [host.result(120) for host in hosts]
    assert [d[1] for d in done] == [r["acquired"] for r in results]
    holder.close()
    handoffs = sum(r["acquired"] for r in results)
    row = _row(window, kind="ours", target=target.kind, names=len(names), waiters_per_name=expected,
               handoffs=handoffs, failed=sum(r["failed"] for r in results), watchers_before=before.watchers,
               handoffs_per_s=handoffs / window.seconds, requests_per_handoff=window.requests / max(1, handoffs),
               proposals_per_handoff=window.proposals / max(1, handoffs),
               events_per_handoff=window.events / max(1, handoffs))  # fmt: skip
    print(f"  hot {target.kind:<7} {len(names)} keys x {expected} waiters: {handoffs} handoffs, "
          f"{row['handoffs_per_s']:.0f}/s, {row['requests_per_handoff']:.2f} req, "
          f"{row['proposals_per_handoff']:.2f} prop, {row['events_per_handoff']:.2f} watch events per handoff "
          f"(load {row['load']})", flush=True)  # fmt: skip
    target.revoke_all()
    return [row]


# -- beats ------------------------------------------------------------------------------------------


def _next_event(hosts: list[Worker], kind: str, timeout: float) -> tuple[Worker, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for host in hosts:
            if host.conn.poll(0.05):
                message = host.next_message(0)
                if message[0] == "event" and message[1][0] == kind:
                    return host, message[1]
                if message[0] == "error":
                    raise RuntimeError(message[1])
    raise TimeoutError(f"no {kind!r} event within {timeout}s")


def beats(target: Target, pool: Pool, settings: Settings) -> list[dict[str, Any]]:
    """A leader and F followers of one beat: each follower's cost, then the leader SIGKILLed: the take-over time."""
    rows = []
    for followers in settings.beat_followers:
        tag = uuid.uuid4().hex[:8]
        prefix = f"/scale-beat-{tag}"
        urls = target.urls(followers + 1, seed=followers, prefix=prefix)
        pool.grow(1 + min(2, followers))
        leader_host = pool[0]
        leader_host.run(f"{FLEET}:beat_host", urls=urls[:1], ttl=settings.beat_ttl, name="scale", tag=f"L{tag}")
        leader_host.wait_for("ready", 120)
        leader_host.wait_for("leader", 120)
        time.sleep(settings.beat_ttl / 3 + 1.0)
        alone, _ = _measure(target, window_for(settings.window, settings.beat_ttl), [leader_host])
        shares = _split(urls[1:], min(2, followers))
        hosts = [pool[1 + i] for i in range(len(shares))]
        for i, (host, share) in enumerate(zip(hosts, shares, strict=True)):
            host.run(f"{FLEET}:beat_host", urls=share, ttl=settings.beat_ttl, name="scale", tag=f"F{i}-{tag}")
        for host in hosts:
            host.wait_for("ready", 300)
        election = f"{prefix}/elections/"
        wanted = followers + 1

        def campaigning(queue: str = election, wanted: int = wanted) -> bool:
            return target.count(queue) >= wanted

        wait_for(campaigning, 300, "every follower to campaign")
        time.sleep(settings.beat_ttl / 3 + 1.0)
        window, client_cpu = _measure(target, window_for(settings.window, settings.beat_ttl), hosts)
        killed_at = leader_host.kill()
        _, event = _next_event(hosts, "leader", settings.beat_ttl * 3 + 30)
        failover = event[2] - killed_at
        pool.replace(0)
        for host in hosts:
            host.send(("stop",))
        for host in hosts:
            host.result(120)
        per_follower = (window.requests_per_s - alone.requests_per_s) / followers
        rows.append(_row(window, kind="ours", target=target.kind, followers=followers, ttl=settings.beat_ttl,
                         leader_alone_requests_per_s=alone.requests_per_s, requests_per_s_per_follower=per_follower,
                         proposals_per_s_per_follower=(window.proposals_per_s - alone.proposals_per_s) / followers,
                         client_cpu_per_follower=client_cpu / window.seconds / followers,
                         failover_s=failover))  # fmt: skip
        print(f"  beat {target.kind:<7} {followers:>3} followers: {per_follower:.2f} req/s each "
              f"(leader alone {alone.requests_per_s:.2f}); SIGKILL fail-over {failover:.2f}s at ttl "
              f"{settings.beat_ttl:g} (load {machine_load()})", flush=True)  # fmt: skip
        target.revoke_all()
    return rows


# -- what a renewal reads ---------------------------------------------------------------------------


def renewal_read(target: Target, sizes: list[int]) -> list[dict[str, Any]]:
    """The bytes of a lease's key listing (what a v3 renewal reads) with ``size`` keys on one lease.

    The keys are named as ours are (prefix, queue, lease and nonce) and put raw, 100 a transaction.
    """
    raw = target.raw()
    rows = []
    for size in sizes:
        lease = int(raw.post("lease/grant", {"TTL": 300})["ID"])
        t0 = time.monotonic()
        for first in range(0, size, 100):
            puts = [{"request_put": {"key": b64(f"/celery-etcdlock/locks/tasks.sync_customer%3A{n}/"
                                                f"{lease:x}.{secrets.token_hex(8)}"),
                                     "value": b64('{"mode":"write"}'), "lease": str(lease)}}
                    for n in range(first, min(size, first + 100))]  # fmt: skip
            raw.post("kv/txn", {"success": puts})
        put_s = time.monotonic() - t0
        t0 = time.monotonic()
        try:
            raw.post("kv/lease/timetolive", {"ID": str(lease), "keys": True})
        except (RuntimeError, OSError) as exc:  # a limit of the server's: that is the finding, not a crash
            print(f"  renewal listing of {size} keys failed: {exc}", flush=True)
            raw = target.reconnect()
        listing_s = time.monotonic() - t0
        listed = raw.bytes_read
        raw.post("kv/lease/revoke", {"ID": str(lease)})
        rows.append(dict(target=target.kind, keys=size, bytes=listed, bytes_per_key=listed / size,
                         listing_ms=1000 * listing_s, put_s=put_s))  # fmt: skip
        print(
            f"  renewal listing of {size} keys on one lease: {listed / 1e6:.2f} MB in {1000 * listing_s:.0f} ms",
            flush=True,
        )
    return rows
