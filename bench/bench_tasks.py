"""The task benchmark: what a singleton task run costs, through a real Celery worker, as users run one.

    python -m bench.bench_tasks                      # the full run (about 6 minutes on 2 cores)
    python -m bench.bench_tasks --quick              # a smoke run (about 1.5 minutes)
    python -m bench.bench_tasks --serial 200 --profile 2000 --json out.json

Real processes throughout: etcd 3.4 with the v2 API (``etcd://``) and etcd 3.5
with v3 (``etcd3://``), one Redis (broker, result backend, celery-singleton's
locks), and a worker per etcd API, ``celery -A bench.taskapp worker -P prefork
-c 2 -l info``, each on a queue of its own. Per round every variant gets a
warm-up of ``--warmup`` tasks, then a batch of ``--tasks`` tasks with distinct
keys sent at once, next to the plain batch of its worker (the order turns
every round):

- a plain task on each worker (the reference), ``singleton_task`` on etcd://
  and on etcd3://, and celery-singleton (on the first worker; it needs only Redis);
- T = first send -> last result (the results arrive through the Redis result
  backend); throughput = tasks / T;
- added time per run per child = 2 x (T_variant - T_plain) / tasks, against the
  plain batch of the same worker in the same round (2: the pool children);
- the floor: the median raw create + delete through the same API on the same
  server (python-etcd for v2, etcd3gw on the JSON gateway for v3, SET NX + DEL
  for celery-singleton's Redis), measured in this process before and after the
  rounds, as bench_locks measures it;
- requests and raft proposals per run from the server's /metrics, and Redis
  commands per run from INFO, over the batch and the quiet moment after it (6 s
  after a v2 batch: a v2 session removes a released queue's directory 5 s later);
- CPU per run of every process (the kernel's count, /proc/<pid>/stat).

``--serial N``: N runs of each variant one at a time (round-robin), the time
from send to result: what one run costs on an idle machine. ``--profile N``:
N more tasks of each variant with py-spy sampling the worker, then
``--profile-calls`` tasks of each on workers that count calls with cProfile;
prints where the pool children's time goes (bench/task_profile.py) and keeps
the raw profiles.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import HOST, Servers, cpu_seconds, fmt, markdown_table, median, ratio, stop_process, wait_for
from bench.locks.kinds import make_impl, warm_up
from bench.locks.uncontended import task_uncontended

ROOT = Path(__file__).resolve().parent.parent
CONCURRENCY = 2
V2_TIDY_WAIT = 6.0  # a v2 session removes a released queue's directory 5 s later: let it land outside the batch
QUIET = 1.0


@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    api: str  # the worker it runs on: "v2" (etcdlock_url etcd://) or "v3" (etcd3://)
    task: str  # its name in bench.taskapp
    floor: str  # the floor (bench.locks.kinds) its added time is divided by
    reference: str  # the plain variant of the same worker

    @property
    def plain(self) -> bool:
        return self.key == self.reference

    @property
    def quiet(self) -> float:
        return V2_TIDY_WAIT if self.key == "ours-v2" else QUIET


def variants(apis: list[str], peer: bool) -> list[Variant]:
    scheme = {"v2": "etcd://", "v3": "etcd3://"}
    out = []
    for api in apis:
        out.append(
            Variant(f"plain-{api}", f"plain task ({scheme[api]} worker)", api, "plain", f"floor-{api}", f"plain-{api}")
        )
        out.append(
            Variant(f"ours-{api}", f"singleton_task {scheme[api]}", api, "singleton", f"floor-{api}", f"plain-{api}")
        )
    if peer:
        out.append(
            Variant(
                "celery-singleton",
                "celery-singleton (Redis, locks at enqueue)",
                apis[0],
                "celery_singleton",
                "floor-redis",
                f"plain-{apis[0]}",
            )
        )
    return out


class CeleryWorker:
    """``celery -A bench.taskapp worker -P prefork -c 2`` with etcdlock_url on ``etcd_url``, on a queue of its own."""

    def __init__(
        self, api: str, etcd_url: str, redis_url: str, log: Path, loglevel: str, env: dict[str, str] | None = None
    ) -> None:
        self.api = api
        self.queue = f"bench-{api}"
        self.log = log
        env = dict(os.environ, BENCH_ETCD_URL=etcd_url, BENCH_REDIS_URL=redis_url, **(env or {}))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        with open(log, "wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "bench.taskapp", "worker", "-P", "prefork",
                 "-c", str(CONCURRENCY), "-l", loglevel, "-Q", self.queue, "-n", f"bench-{api}@%h",
                 "--without-mingle", "--without-gossip", "--without-heartbeat"],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip

    def children(self) -> list[int]:
        """The pool's processes."""
        pid = self.process.pid
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]

    def wait_ready(self, task: Any, timeout: float = 120.0) -> None:
        result = task.apply_async((-1,), queue=self.queue)

        def ready() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"the {self.api} worker exited:\n{self.log.read_text()[-3000:]}")
            return bool(result.ready())

        wait_for(ready, timeout, f"the {self.api} worker to run a task", interval=0.1)
        wait_for(lambda: len(self.children()) == CONCURRENCY, 30, f"the {self.api} worker's pool")

    def stop(self) -> None:
        stop_process(self.process, 60)  # a warm shutdown: the pool children exit as they would in production


class Counters:
    """The servers' counters, requests and proposals per etcd (/metrics) and commands (Redis INFO), and the CPU
    time every process of the benchmark has used (the kernel's count, /proc/<pid>/stat)."""

    def __init__(self, servers: Servers, workers: dict[str, CeleryWorker]) -> None:
        self.etcds = {api: e for api, e in (("v2", servers.v2), ("v3", servers.v3)) if e is not None}
        assert servers.redis is not None
        self.redis = servers.redis
        self.processes: dict[str, list[int]] = {"bench": [os.getpid()], "redis": [self.redis.pid]}
        for api, etcd in self.etcds.items():
            self.processes[f"etcd-{api}"] = [etcd.pid]
        for api, worker in workers.items():
            self.processes[f"children-{api}"] = worker.children()
            self.processes[f"main-{api}"] = [worker.process.pid]

    def snapshot(self) -> dict[str, Any]:
        cpu = {role: sum(cpu_seconds(pid) for pid in pids) for role, pids in self.processes.items()}
        return {**{api: etcd.metrics() for api, etcd in self.etcds.items()}, "redis": self.redis.commands(), "cpu": cpu}

    def delta(self, before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
        out = {"redis_commands": after["redis"] - before["redis"] - 1}  # not the INFO that read it
        for api, etcd in self.etcds.items():
            out[f"{api}_requests"] = after[api].delta(before[api], etcd.requests_metric)
            out[f"{api}_proposals"] = after[api].delta(before[api], "etcd_server_proposals_committed_total")
        for role in self.processes:
            out[f"cpu_{role}"] = after["cpu"][role] - before["cpu"][role]
        return out


class Bench:
    def __init__(
        self, args: argparse.Namespace, servers: Servers, workers: dict[str, CeleryWorker], todo: list[Variant]
    ) -> None:
        from bench import taskapp

        self.args = args
        self.servers = servers
        self.workers = workers
        self.variants = todo
        self.counters = Counters(servers, workers)
        self.taskapp = taskapp
        self.next_key = 0
        self.runs: dict[tuple[str, str], int] = {(api, "plain"): 1 for api in workers}  # wait_ready's task
        self.results: dict[str, Any] = {"batches": [], "serial": {}, "floors_ms": {}, "floor_cpu_ms": {}, "profile": {}}

    def task(self, variant: Variant) -> Any:
        return getattr(self.taskapp, variant.task)

    def keys(self, n: int) -> range:
        """``n`` arguments never used before: no two runs share a key."""
        first, self.next_key = self.next_key, self.next_key + n
        return range(first, first + n)

    def send_and_wait(self, variant: Variant, n: int) -> dict[str, float]:
        """Send ``n`` tasks at once, wait for every result: T, and the time the sending took."""
        from celery.result import ResultSet

        task, queue, keys = self.task(variant), self.workers[variant.api].queue, self.keys(n)
        started = time.perf_counter()
        results = [task.apply_async((i,), queue=queue) for i in keys]
        sent = time.perf_counter()
        values = ResultSet(results).join_native(timeout=600)
        finished = time.perf_counter()
        if values != list(keys):  # a singleton run skipped as a conflict would return None
            wrong = sum(v != k for v, k in zip(values, keys, strict=True))
            raise RuntimeError(f"{variant.key}: {wrong} of {n} runs did not return their argument")
        return {"seconds": finished - started, "send_seconds": sent - started}

    def floors(self, when: str) -> None:
        """The floors' latency (interleaved, as bench_locks times them), then the CPU each costs, one at a time."""
        kinds = sorted({v.floor for v in self.variants})
        n = self.args.floor
        print(f"floors ({when}): {', '.join(kinds)} x {n}, interleaved", flush=True)
        ports = self.servers.ports()
        raw = task_uncontended(ports, kinds, iterations=n, warmup=20, ttl=30.0)
        for kind, data in raw.items():
            self.results["floors_ms"].setdefault(kind, {})[when] = data["ms"]
        for kind in kinds:
            server = self.counters.processes[{"floor-v2": "etcd-v2", "floor-v3": "etcd-v3"}.get(kind, "redis")][0]
            impl = make_impl(kind, ports, 30.0)
            warm_up(impl)
            client, served = time.process_time(), cpu_seconds(server)
            for _ in range(n):
                handle = impl.lock(f"floor-cpu-{kind}")
                handle.acquire()
                handle.release()
            client, served = time.process_time() - client, cpu_seconds(server) - served
            impl.close()
            self.results["floor_cpu_ms"].setdefault(kind, {})[when] = {
                "client": 1000 * client / n,
                "server": 1000 * served / n,
            }

    def batch(self, variant: Variant, round_no: int) -> None:
        self.send_and_wait(variant, self.args.warmup)
        time.sleep(variant.quiet)
        before = self.counters.snapshot()
        timing = self.send_and_wait(variant, self.args.tasks)
        during = self.counters.snapshot()
        time.sleep(variant.quiet)
        after = self.counters.snapshot()
        record = {
            "variant": variant.key,
            "round": round_no,
            "tasks": self.args.tasks,
            **timing,
            "counted": self.counters.delta(before, during),
            "counted_after": self.counters.delta(during, after),
        }
        self.results["batches"].append(record)
        etcd = record["counted"].get(f"{variant.api}_requests", math.nan) / self.args.tasks
        print(
            f"round {round_no + 1} {variant.key:16} {self.args.tasks / timing['seconds']:7.1f} tasks/s "
            f"T {timing['seconds']:.2f} s  etcd requests/run {etcd:.2f}",
            flush=True,
        )

    def rounds(self) -> None:
        """Each variant next to its worker's plain batch (machine noise drifts); the orders turn every round."""
        groups = [[v for v in self.variants if v.api == api] for api in self.workers]
        for round_no in range(self.args.rounds):
            shift = round_no % len(groups)
            for group in groups[shift:] + groups[:shift]:
                for variant in group if round_no % 2 == 0 else reversed(group):
                    self.batch(variant, round_no)

    def serial(self) -> None:
        """One run at a time, round-robin over the variants: the time from send to result."""
        n = self.args.serial
        print(f"serial: {n} runs of each variant, one at a time", flush=True)
        times: dict[str, list[float]] = {v.key: [] for v in self.variants}
        for i in range(n + 10):
            shift = i % len(self.variants)
            for variant in self.variants[shift:] + self.variants[:shift]:
                took = self.run_one(variant)
                if i >= 10:
                    times[variant.key].append(1000 * took)
        self.results["serial"] = times

    def run_one(self, variant: Variant) -> float:
        """Send one task and wait for its result: the seconds that took."""
        (key,) = self.keys(1)
        started = time.perf_counter()
        value = self.task(variant).apply_async((key,), queue=self.workers[variant.api].queue).get(timeout=60)
        took = time.perf_counter() - started
        if value != key:
            raise RuntimeError(f"{variant.key}: run {key} returned {value!r}")
        return took

    def profile(self, directory: Path) -> None:
        """A batch of ``--profile`` tasks of each variant with py-spy sampling its worker's processes."""
        from bench.pyspy import Recording

        n, rate = self.args.profile, self.args.profile_rate
        for variant in self.variants:
            worker = self.workers[variant.api]
            self.send_and_wait(variant, self.args.warmup)
            time.sleep(max(v.quiet for v in self.variants if v.api == variant.api))  # what ran before is done
            path = directory / f"{variant.key}.txt"
            recording = Recording(worker.process.pid, path, rate=rate)
            time.sleep(1.0)  # py-spy attaches to every process first
            children = worker.children()
            before = sum(map(cpu_seconds, children))
            timing = self.send_and_wait(variant, n)
            after = sum(map(cpu_seconds, children))
            recording.stop()
            self.results["profile"][variant.key] = {
                "path": str(path),
                "tasks": n,
                "rate": rate,
                "children": children,
                "kernel_child_ms": 1000 * (after - before) / n,
                **timing,
            }
            print(f"profiled {variant.key}: {n} tasks in {timing['seconds']:.1f} s -> {path}", flush=True)

    def count_calls(self) -> None:
        """On workers that run each task under cProfile: ``--profile-calls`` tasks of each variant."""
        for variant in self.variants:
            for n in (self.args.warmup, self.args.profile_calls):
                self.send_and_wait(variant, n)
                self.runs[(variant.api, variant.task)] = self.runs.get((variant.api, variant.task), 0) + n
            print(f"counted calls of {variant.key}", flush=True)


def start_workers(
    servers: Servers,
    apis: list[str],
    loglevel: str,
    cprofile: Path | None = None,
) -> dict[str, CeleryWorker]:
    """A worker per API, ready; with ``cprofile``, each writes its children's profiles to cprofile/<api>."""
    from bench import taskapp

    assert servers.redis is not None
    redis_url = f"redis://{HOST}:{servers.redis.port}/0"
    workers: dict[str, CeleryWorker] = {}
    try:
        for api in apis:
            etcd = servers.v2 if api == "v2" else servers.v3
            assert etcd is not None
            url = f"{'etcd' if api == 'v2' else 'etcd3'}://{HOST}:{etcd.port}?prefix=/bench-tasks"
            env = {}
            if cprofile is not None:
                (cprofile / api).mkdir(parents=True, exist_ok=True)
                env["BENCH_CPROFILE_DIR"] = str(cprofile / api)
            log = servers.workdir / f"worker-{api}{'-cprofile' if cprofile else ''}.log"
            workers[api] = CeleryWorker(api, url, redis_url, log, loglevel, env)
        for worker in workers.values():
            worker.wait_ready(taskapp.plain)
    except BaseException:
        for worker in workers.values():
            worker.stop()
        raise
    return workers


def summarize(results: dict[str, Any], todo: list[Variant]) -> dict[str, Any]:
    """Per variant: T, throughput, added per run per child against its floor, counters per run; per round and median."""
    batches = {(b["variant"], b["round"]): b for b in results["batches"]}
    rounds = sorted({b["round"] for b in results["batches"]})
    floors = {kind: median(ms["before"] + ms["after"]) for kind, ms in results["floors_ms"].items()}
    floor_cpu = {
        kind: {part: median([c[part] for c in by_when.values()]) for part in ("client", "server")}
        for kind, by_when in results["floor_cpu_ms"].items()
    }
    out: dict[str, Any] = {"floors_ms": floors, "floor_cpu_ms": floor_cpu, "variants": {}}
    for v in todo:
        runs = [batches[(v.key, r)] for r in rounds if (v.key, r) in batches]
        if not runs:
            continue
        n = runs[0]["tasks"]
        plain_median = median([batches[(v.reference, r)]["seconds"] for r in rounds if (v.reference, r) in batches])
        added = []
        for run in runs:
            reference = plain_median if v.plain else batches[(v.reference, run["round"])]["seconds"]
            added.append(1000 * CONCURRENCY * (run["seconds"] - reference) / n)
        floor = floors.get(v.floor, math.nan)
        server = {"floor-v2": "v2", "floor-v3": "v3"}.get(v.floor, v.api)

        def per_run(name: str, after: bool = False, runs: list[dict] = runs, n: int = n) -> float:
            return median(
                [
                    (r["counted"].get(name, math.nan) + (r["counted_after"].get(name, 0) if after else 0)) / n
                    for r in runs
                ]
            )

        out["variants"][v.key] = {
            "label": v.label,
            "throughput": [n / r["seconds"] for r in runs],
            "ms_per_run_per_child": [1000 * CONCURRENCY * r["seconds"] / n for r in runs],
            "added_ms": added,
            "floor": v.floor,
            "floor_ms": floor,
            "added_vs_floor": [a / floor for a in added],
            "etcd_server": server,
            "etcd_requests_per_run": per_run(f"{server}_requests"),
            "etcd_requests_per_run_with_after": per_run(f"{server}_requests", after=True),
            "proposals_per_run": per_run(f"{server}_proposals", after=True),
            "redis_commands_per_run": per_run("redis_commands"),
            "cpu_ms_per_run": {g: 1000 * per_run_cpu(runs, roles, n) for g, roles in cpu_groups(v, server).items()},
        }
    return out


def cpu_groups(v: Variant, server: str) -> dict[str, list[str]]:
    """The processes whose CPU a variant's table row shows, by the roles ``Counters`` names them."""
    return {
        "pool children": [f"children-{v.api}"],
        "worker main process": [f"main-{v.api}"],
        "etcd": [f"etcd-{server}"] if server in ("v2", "v3") else [],
        "redis": ["redis"],
        "bench (sending, results)": ["bench"],
        "all": ["*"],
    }


def per_run_cpu(runs: list[dict], roles: list[str], n: int) -> float:
    """The median over ``runs`` of the CPU seconds per task of the ``roles`` ("*": every process) in the batch."""

    def used(run: dict) -> float:
        counted = run["counted"]
        return sum(
            value for key, value in counted.items() if key.startswith("cpu_") and ("*" in roles or key[4:] in roles)
        )

    return median([used(run) / n for run in runs])


def _spread(values: list[float], digits: int = 2) -> str:
    """The median and, in brackets, the lowest and highest of ``values``."""
    if not values:
        return "-"
    if len(values) == 1:
        return fmt(values[0], digits)
    return f"{fmt(statistics.median(values), digits)} ({fmt(min(values), digits)} to {fmt(max(values), digits)})"


def report(results: dict[str, Any], todo: list[Variant], args: argparse.Namespace) -> str:
    s = results["summary"]
    out = [
        f"### Singleton tasks through a prefork worker (-c {CONCURRENCY}, -l {args.loglevel}): "
        f"{args.tasks} tasks at once, {args.rounds} runs each\n"
    ]
    rows = []
    for v in todo:
        r = s["variants"].get(v.key)
        if r is None:
            continue
        later = r["etcd_requests_per_run_with_after"] - r["etcd_requests_per_run"]
        rows.append(
            [
                r["label"],
                _spread(r["throughput"], 0),
                _spread(r["ms_per_run_per_child"]),
                _spread(r["added_ms"]),
                f"{r['floor_ms']:.2f} ({v.floor})",
                _spread(r["added_vs_floor"]),
                f"{r['etcd_requests_per_run']:.2f}" + (f" (+{later:.2f} after)" if later else ""),
                r["proposals_per_run"],
                r["redis_commands_per_run"],
            ]
        )
    out.append(
        markdown_table(
            [
                "variant",
                "tasks/s",
                "ms per run per child",
                "added ms per run per child",
                "floor ms",
                "added / floor",
                "etcd requests per run",
                "raft proposals per run",
                "Redis commands per run",
            ],
            rows,
        )
    )
    out.append("")
    out.append(
        "CPU per run by process, ms (the kernel's count over the batch), and the added CPU of the whole "
        "machine against the plain task of the same worker:\n"
    )
    rows = []
    groups = list(next(iter(s["variants"].values()))["cpu_ms_per_run"])
    for v in todo:
        r = s["variants"].get(v.key)
        if r is None:
            continue
        cpu = r["cpu_ms_per_run"]
        plain_all = s["variants"].get(v.reference, {}).get("cpu_ms_per_run", {}).get("all", math.nan)
        added = None if v.plain else cpu["all"] - plain_all
        floor = s["floor_cpu_ms"].get(v.floor)
        floor_cpu = floor["client"] + floor["server"] if floor else math.nan
        rows.append([r["label"], *[cpu[g] for g in groups], added, floor_cpu, ratio(added, floor_cpu)])
    out.append(
        markdown_table(["variant", *groups, "added, all", "floor CPU (client + server)", "added CPU / floor CPU"], rows)
    )
    out.append("")
    floors = results["floors_ms"]
    out.append(
        "Floors (median ms, before / after the rounds): "
        + "; ".join(
            f"{kind} {median(ms['before']):.2f} / {median(ms['after']):.2f} (CPU per create+delete: "
            f"{s['floor_cpu_ms'][kind]['client']:.2f} client, {s['floor_cpu_ms'][kind]['server']:.2f} server)"
            for kind, ms in floors.items()
        )
        + "."
    )
    out.append(
        "Each cell: the median of the runs, (lowest to highest). A plain row's added time is its runs "
        "against their own median: the noise of the measurement."
    )
    out.append("")
    for api in ("v2", "v3"):
        r = s["variants"].get(f"ours-{api}")
        if r is None:
            continue
        minimum = 3 if api == "v2" else 2
        worst = max(r["added_vs_floor"])
        met = sum(x <= 1.5 for x in r["added_vs_floor"])
        requests_met = r["etcd_requests_per_run"] <= minimum + 0.05
        out.append(
            f"- {api}: added / floor {_spread(r['added_vs_floor'])}: target <= 1.5 "
            f"{'met' if worst <= 1.5 else 'MISSED'} (met in {met} of {len(r['added_vs_floor'])} runs); "
            f"etcd requests per run {r['etcd_requests_per_run']:.2f} in the batch: target {minimum} "
            f"{'met' if requests_met else 'MISSED'}"
        )
    serial = results.get("serial")
    if serial:
        out.append("")
        out.append(f"#### One run at a time ({len(next(iter(serial.values())))} each, round-robin): send -> result\n")
        rows = []
        plain = {v.key: median(serial[v.reference]) for v in todo}
        floors_ms = s["floors_ms"]
        for v in todo:
            m = median(serial[v.key])
            added = None if v.plain else m - plain[v.key]
            rows.append([v.label, m, added, ratio(added, floors_ms.get(v.floor)) if added is not None else None])
        out.append(markdown_table(["variant", "median ms", "added ms", "added / floor"], rows))
    return "\n".join(out)


def render_profiles(results: dict[str, Any], todo: list[Variant]) -> str:
    import pstats

    from bench import task_profile
    from bench.pyspy import Profile

    label = {v.key: v.label for v in todo}
    sampled = {
        label[key]: task_profile.Sampled(
            Profile.read(p["path"], p["rate"]), p["children"], p["tasks"], p["kernel_child_ms"]
        )
        for key, p in results["profile"].items()
    }
    counted = {label[key]: (pstats.Stats(*c["files"]), c["runs"]) for key, c in results["calls"].items() if c["files"]}
    return task_profile.render_samples(sampled) + "\n" + task_profile.render_calls(counted)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_tasks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=600, help="tasks per batch, sent at once (default 600)")
    parser.add_argument("--warmup", type=int, default=40, help="tasks run before each batch (default 40)")
    parser.add_argument("--rounds", type=int, default=3, help="batches of each variant (default 3)")
    parser.add_argument("--apis", default="v2,v3", help="etcd APIs: v2, v3 or v2,v3 (default)")
    parser.add_argument("--floor", type=int, default=300, help="raw create+delete timed before and after (300)")
    parser.add_argument("--loglevel", default="info", help="the workers' -l (default info, as users run them)")
    parser.add_argument("--serial", type=int, default=0, metavar="N", help="also N runs of each, one at a time")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="also N tasks of each under py-spy")
    parser.add_argument("--profile-rate", type=int, default=250, help="py-spy samples per second (default 250)")
    parser.add_argument(
        "--profile-calls",
        type=int,
        default=200,
        metavar="N",
        help="with --profile: N tasks of each on workers under cProfile, for call counts (200)",
    )
    parser.add_argument("--profile-dir", type=Path, help="where the raw profiles go (default: a new temp dir)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 round of 200 tasks, warm-up 20")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write every raw number to this JSON file")
    args = parser.parse_args(argv)
    if args.quick:
        args.tasks, args.warmup, args.rounds, args.floor = 200, 20, 1, 100
    apis = [a.strip() for a in args.apis.split(",") if a.strip()]
    if not apis or any(a not in ("v2", "v3") for a in apis):
        parser.error(f"--apis takes v2, v3 or v2,v3, not {args.apis!r}")
    profile_dir = None
    if args.profile:
        from bench.pyspy import py_spy

        try:
            py_spy()
        except RuntimeError as exc:
            parser.error(str(exc))
        profile_dir = args.profile_dir or Path(tempfile.mkdtemp(prefix="bench-tasks-profile-"))
        profile_dir.mkdir(parents=True, exist_ok=True)

    began = time.monotonic()
    with Servers(etcd_v2="v2" in apis, etcd_v3="v3" in apis, redis=True) as servers:
        assert servers.redis is not None
        redis_url = f"redis://{HOST}:{servers.redis.port}/0"
        from bench import taskapp

        taskapp.app.conf.update(broker_url=redis_url, result_backend=redis_url, singleton_backend_url=redis_url)
        todo = variants(apis, peer=taskapp.celery_singleton is not None)
        if taskapp.celery_singleton is None:
            print("note: celery-singleton is not installed (pip install -e . --group bench): left out", flush=True)
        workers = start_workers(servers, apis, args.loglevel)
        try:
            print(
                f"servers up: {servers.ports()}; workers: "
                + ", ".join(f"{api} pid {w.process.pid} children {w.children()}" for api, w in workers.items()),
                flush=True,
            )
            bench = Bench(args, servers, workers, todo)
            bench.floors("before")
            bench.rounds()
            if args.serial:
                bench.serial()
            if profile_dir is not None:
                bench.profile(profile_dir)
            bench.floors("after")
        finally:
            for worker in workers.values():
                worker.stop()
        if profile_dir is not None:
            workers = start_workers(servers, apis, args.loglevel, cprofile=profile_dir / "cprofile")
            try:
                counting = Bench(args, servers, workers, todo)
                counting.next_key = bench.next_key
                counting.count_calls()
            finally:
                for worker in workers.values():
                    worker.stop()  # the children write their profiles as they exit
            bench.results["calls"] = {
                v.key: {
                    "files": [str(f) for f in (profile_dir / "cprofile" / v.api).glob(f"bench.{v.task}-*.prof")],
                    "runs": counting.runs[(v.api, v.task)],
                }
                for v in todo
            }
    results = bench.results
    results["summary"] = summarize(results, todo)
    results["seconds"] = time.monotonic() - began
    print("\n" + report(results, todo, args))
    if profile_dir is not None:
        print(
            f"\n### Profile: py-spy at {args.profile_rate} Hz, {args.profile} tasks per variant; cProfile's call "
            f"counts over {args.profile_calls} (raw profiles in {profile_dir})\n"
        )
        print(render_profiles(results, todo))
    print(f"\n(run took {results['seconds']:.0f} s; python {sys.version.split()[0]}, {os.cpu_count()} CPUs)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
