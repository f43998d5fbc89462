"""What every lock workload runs on: its settings, the servers and worker pool, and timed multi-process runs.

    harness = Harness(Settings.make(quick, apis, only), servers, pool)
    harness.kinds(floors=False)            # the locks to run: ours on the APIs asked for, the peers
    run = harness.timed_run("v3", "bench.locks.contention:task_contend", [kwargs] * 8, 2.0, counter)
    harness.results["contention"] = ...

A timed run has two sides. In each worker process the task calls
``timed_phases(setup, loop, teardown)``: it sets up (connects, warms up) and
reports "ready"; the main process snapshots the server's counters and sends
every worker the same start and end moments (the monotonic clock is system-wide
on Linux); each worker loops until the end and reports its counts; the main
process snapshots the counters again. So set-up and tear-down never count.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.common import Pool, Servers, WorkerError, emit, inbox, requests_sent, sleep_until
from bench.locks.kinds import KINDS, ours_available


@dataclass
class Settings:
    quick: bool
    apis: list[str]
    only: list[str]
    also_v3: list[str] = field(default_factory=list)  # release lines whose v3 runs beside 3.5's
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
    semaphore_seconds: float = 3.0
    semaphore_work: float = 0.005
    hold_count: int = 500
    hold_ttl: float = 5.0
    hold_window: float = 10.0

    @classmethod
    def make(
        cls, quick: bool, apis: list[str], only: list[str], also_v3: list[str] | None = None, rounds: int | None = None
    ) -> Settings:
        """``rounds``: contention rounds instead of 3 (1 in a quick run)."""
        more: dict[str, Any] = {"also_v3": also_v3 or []}
        if rounds is not None:
            more["contention_rounds"] = rounds
        if not quick:
            return cls(quick, apis, only, **more)
        return cls(
            quick, apis, only,
            uncontended_iterations=50, uncontended_warmup=5,
            contention_procs=[2, 8], contention_seconds=1.0,
            killed_trials=1, resign_trials=2, kill_trials=1,
            rw_cells=[(0.020, [8])], rw_seconds=1.0, semaphore_seconds=1.0,
            hold_count=100, hold_window=2.0,
            **{"contention_rounds": 1, **more},
        )  # fmt: skip

    def processes_needed(self) -> int:
        """The most worker processes one workload of this run uses at once."""
        needed = [16]  # killed and election: two and three per kind
        if "contention" in self.only or "semaphore" in self.only:
            needed += self.contention_procs
        if "rwlock" in self.only:
            needed += [n for _, procs in self.rw_cells for n in procs]
        return max(needed)


class Harness:
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

    def kinds(self, floors: bool = True, other_v3: bool = False) -> list[str]:
        """The kinds to run; ``other_v3`` adds the v3 ones on the other release lines whose server is
        up (3.4's with the v2 server, 3.6's and 3.7's with ``--also-v3``)."""
        wanted = []
        for key, kind in KINDS.items():
            api = kind.server.split("-")[0]
            if kind.floor and not floors:
                continue
            if kind.server.startswith("v3-") and (not other_v3 or kind.server not in self.ports):
                continue
            if api in ("v2", "v3") and api not in self.settings.apis:
                continue
            if kind.ours and self.unavailable[api]:
                continue
            wanted.append(key)
        return wanted

    def ours_apis(self) -> list[str]:
        return [api for api in self.settings.apis if not self.unavailable[api]]

    def etcd(self, api: str) -> Any:
        """The server of ``api``: "v2" and "v3-3.4" are etcd 3.4's (measured as v2 and v3), "v3" etcd 3.5's,
        "v3-3.6" and "v3-3.7" those of ``--also-v3``."""
        return self.servers.etcd(api)

    def snapshot(self, server: str) -> Any:
        """The server's counters now: a Metrics scrape (etcd) or the commands processed (Redis)."""
        if server == "redis":
            assert self.servers.redis is not None
            return self.servers.redis.commands()
        return self.etcd(server).metrics()

    def counted(self, server: str, before: Any, after: Any) -> dict[str, float]:
        """Requests and raft proposals the server counted between two snapshots."""
        if server == "redis":
            return {"requests": after - before - 1, "proposals": math.nan}
        etcd = self.etcd(server)
        return {
            "requests": after.delta(before, etcd.requests_metric),
            "proposals": after.delta(before, "etcd_server_proposals_committed_total"),
        }

    def new_counter(self) -> str:
        """A file holding a counter at 0, for the workers' read-modify-write under the lock."""
        path = tempfile.mktemp(prefix="counter-", dir=self.tmp)
        with open(path, "wb") as out:
            out.write(b"%020d" % 0)
        return path

    def timed_run(self, server: str, target: str, kwargs_list: list[dict], seconds: float, counter: str) -> dict:
        """Start the tasks, wait until all are set up, snapshot counters, run for ``seconds``, snapshot."""
        pool, n = self.pool, len(kwargs_list)
        pool.grow(n)
        pool.reset_shared()
        if server.startswith("v3"):
            self.etcd(server).revoke_all_leases()
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
        final = read_counter_file(counter)
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


def timed_phases(setup: Callable[[], Any], loop: Callable[[Any, float], dict], teardown: Callable[[Any], None]) -> None:
    """In a worker: ready -> (go) -> loop until end_at -> done(stats) -> (close) -> teardown."""
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


def read_counter(fd: int) -> int:
    return int(os.pread(fd, 20, 0) or b"0")


def write_counter(fd: int, value: int) -> None:
    os.pwrite(fd, b"%020d" % value, 0)


def read_counter_file(path: str) -> int:
    with open(path, "rb") as f:
        return int(f.read() or b"0")


def merge_runs(runs: list[dict]) -> dict:
    """Add up the rounds of one configuration (per-process counts are summed per process slot)."""
    procs = runs[0]["procs"]
    per_proc = [0] * procs
    for run in runs:
        for i, n in enumerate(run["acquisitions"]):
            per_proc[i] += n
    total = sum(r["total"] for r in runs)
    seconds = sum(r["seconds"] for r in runs)

    def per_op(field: str) -> float:
        return sum(r[field] for r in runs) / total if total else math.nan

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
        "proposals_per_op": per_op("proposals"),
        "requests_per_op": per_op("requests"),
        "client_requests_per_op": per_op("client_requests"),
        "broken": [b for r in runs for b in r["broken"]],
        "rounds": len(runs),
    }
    if "writes" in runs[0]:
        merged["reads"] = sum(r["reads"] for r in runs)
        merged["writes"] = sum(r["writes"] for r in runs)
        merged["lost"] = sum(r["writes"] - r["counter"] for r in runs)
    return merged
