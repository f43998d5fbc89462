"""Benchmark: what a singleton task costs, through a real Celery worker.

    /tmp/venv/bin/python -m bench.bench_tasks [--tasks 2000] [--rounds 2] [--apis v2,v3] [--json out.json]

Real processes throughout: etcd 3.4 with the v2 API and etcd 3.5 with v3 (for
``etcd://`` and ``etcd3://``), one Redis (broker, result backend, and
celery-singleton's lock store), and ``celery -A bench.bench_tasks worker
--pool=prefork --concurrency=2`` (this module is also the worker's app).

Per API, one worker runs, in alternating order each round, ``--tasks`` short
tasks with distinct keys of each kind: a plain ``@app.task``, our
``@singleton_task(key=["i"])``, and (with the v2 worker, as it only needs
Redis) celery-singleton's ``@app.task(base=Singleton)``. For each batch:

- throughput: tasks / (last task finished - first submitted);
- run time in the worker: from ``task_prerun`` to ``task_postrun`` of each
  task (the task body, our lock or celery-singleton's unlock, storing the
  result); "added per run" = median of the kind - median of plain tasks;
- etcd requests per task: the server's own request counter over the batch
  (``etcd_http_received_total`` for v2, ``grpc_server_msg_received_total``
  for v3), divided by the tasks: acquire, release, renewals amortised.

The floor, measured in the same run against the same servers, is the
cheapest correct raw exclusive create + delete: python-etcd
``write(prevExist=False)`` + ``delete`` (v2), etcd3gw ``create`` +
``delete`` (v3), median of 300 after a warm-up.

Targets (the issue): <= 3 etcd requests per singleton run; added time per run
<= 1.5 x the create + delete floor.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import redis
from celery import Celery, signals

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from celery_etcdlock.tasks import singleton_task  # noqa: E402

# -- the worker's app (this module, imported by `celery -A bench.bench_tasks worker`) -----------

ETCD_URL = os.environ.get("BENCH_ETCD_URL", "etcd://127.0.0.1:2379?prefix=/bench-tasks")
REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")

app = Celery("bench_tasks", broker=REDIS_URL, backend=REDIS_URL)
app.conf.update(
    etcdlock_url=ETCD_URL,
    etcdlock_prefix=parse_qs(urlsplit(ETCD_URL).query).get("prefix", ["/celery-etcdlock"])[0],
    singleton_backend_url=REDIS_URL,
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    worker_prefetch_multiplier=4,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)


@app.task(name="bench.plain")
def plain(i: int) -> int:
    return i


@singleton_task(app=app, name="bench.singleton", key=["i"])
def ours(i: int) -> int:
    return i


try:
    from celery_singleton import Singleton
except ImportError:  # the bench extra is not installed: compare with plain tasks only
    peer = None
else:

    @app.task(base=Singleton, name="bench.celery_singleton")
    def _peer(i: int) -> int:
        return i

    peer = _peer

KINDS = {"plain": plain, "singleton": ours, "celery-singleton": peer}


@app.task(name="bench.floor")
def floor_in_worker(n: int = 300) -> list[float]:
    """The raw create + delete floor, measured from a pool child like the tasks' own requests."""
    parts = urlsplit(ETCD_URL)
    port = int(parts.netloc.rsplit(":", 1)[1])
    return floor_v2(port, n) if parts.scheme == "etcd" else floor_v3(port, n)

_started: dict[str, float] = {}
_redis: redis.Redis | None = None


@signals.task_prerun.connect
def _prerun(task_id: str, **_: Any) -> None:
    _started[task_id] = time.perf_counter()


@signals.task_postrun.connect
def _postrun(task_id: str, task: Any, **_: Any) -> None:
    took = time.perf_counter() - _started.pop(task_id, time.perf_counter())
    global _redis
    if _redis is None:
        _redis = redis.Redis.from_url(REDIS_URL)
    _redis.rpush(f"bench:runs:{task.name}", f"{took:.9f}")


# -- the benchmark ---------------------------------------------------------------------------


def floor_v2(port: int, n: int = 300) -> list[float]:
    import etcd

    client = etcd.Client(host="127.0.0.1", port=port)
    times = []
    for i in range(n + 20):
        key = f"/bench-floor/{uuid.uuid4().hex}"
        start = time.perf_counter()
        client.write(key, "x", prevExist=False, ttl=30)
        client.delete(key)
        if i >= 20:
            times.append(time.perf_counter() - start)
    return times


def floor_v3(port: int, n: int = 300) -> list[float]:
    from etcd3gw.client import Etcd3Client

    client = Etcd3Client(host="127.0.0.1", port=port, api_path="/v3/")
    times = []
    for i in range(n + 20):
        key = f"/bench-floor/{uuid.uuid4().hex}"
        start = time.perf_counter()
        assert client.create(key, "x")
        client.delete(key)
        if i >= 20:
            times.append(time.perf_counter() - start)
    return times


class BenchWorker:
    def __init__(self, etcd_url: str, redis_url: str, log: Path) -> None:
        env = dict(os.environ, BENCH_ETCD_URL=etcd_url, BENCH_REDIS_URL=redis_url)
        env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
        self.log = log
        with open(log, "wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "bench.bench_tasks", "worker", "--pool=prefork",
                 "--concurrency=2", "-O", "fair", "-l", "warning", "--without-mingle", "--without-gossip",
                 "-n", f"bench-{uuid.uuid4().hex[:6]}@%h"],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def run_batch(kind: str, n: int, offset: int, store: redis.Redis, etcd: Any | None) -> dict[str, Any]:
    task = KINDS[kind]
    assert task is not None
    runs_key = f"bench:runs:{task.name}"
    store.delete(runs_key)
    before = etcd.metrics() if etcd is not None else None
    start = time.perf_counter()
    for i in range(n):
        task.delay(offset + i)
    submitted = time.perf_counter()
    deadline = time.monotonic() + 600
    while store.llen(runs_key) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{kind}: only {store.llen(runs_key)} of {n} tasks ran within 10 minutes")
        time.sleep(0.01)
    finished = time.perf_counter()
    runs = [float(x) for x in store.lrange(runs_key, 0, -1)]
    result: dict[str, Any] = {
        "kind": kind,
        "tasks": n,
        "seconds": finished - start,
        "throughput": n / (finished - start),
        "submit_ms": 1000 * (submitted - start) / n,
        "run_median_ms": 1000 * statistics.median(runs),
        "run_mean_ms": 1000 * statistics.fmean(runs),
    }
    if etcd is not None:
        after = etcd.metrics()
        result["etcd_requests_per_task"] = after.delta(before, etcd.requests_metric) / n
    return result


def run_serial(kind: str, n: int, offset: int, store: redis.Redis) -> dict[str, Any]:
    """One task at a time: the run time of each without any other load on the worker."""
    task = KINDS[kind]
    assert task is not None
    runs_key = f"bench:runs:{task.name}"
    store.delete(runs_key)
    for i in range(n):
        task.delay(offset + i)
        deadline = time.monotonic() + 60
        while store.llen(runs_key) <= i:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{kind}: task {i} did not run within a minute")
            time.sleep(0.0005)
    runs = [float(x) for x in store.lrange(runs_key, 0, -1)]
    return {"kind": kind, "serial_tasks": n, "serial_run_median_ms": 1000 * statistics.median(runs)}


def wait_ready(store: redis.Redis, worker: BenchWorker) -> None:
    handle = plain.delay(-1)
    deadline = time.monotonic() + 120
    while not handle.ready():
        if worker.process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the bench worker did not start:\n{worker.log.read_text()[-3000:]}")
        time.sleep(0.1)


def main() -> None:
    from bench.common import Servers, markdown_table

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--serial", type=int, default=300, help="tasks run one at a time, per kind")
    parser.add_argument("--apis", default="v2,v3")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    apis = [a.strip() for a in args.apis.split(",") if a.strip()]

    results: list[dict[str, Any]] = []
    serial: list[dict[str, Any]] = []
    floors: dict[str, list[float]] = {}
    worker_floors: dict[str, list[float]] = {}
    with Servers(etcd_v2="v2" in apis, etcd_v3="v3" in apis, redis=True) as servers:
        assert servers.redis is not None
        redis_url = f"redis://127.0.0.1:{servers.redis.port}/0"
        store = redis.Redis.from_url(redis_url)
        app.conf.update(broker_url=redis_url, result_backend=redis_url, singleton_backend_url=redis_url)
        offset = 0
        for api in apis:
            etcd = servers.v2 if api == "v2" else servers.v3
            assert etcd is not None
            scheme = "etcd" if api == "v2" else "etcd3"
            etcd_url = f"{scheme}://127.0.0.1:{etcd.port}?prefix=/bench-tasks-{api}"
            floor = floor_v2 if api == "v2" else floor_v3
            floors.setdefault(api, []).extend(floor(etcd.port))
            worker = BenchWorker(etcd_url, redis_url, servers.workdir / f"worker-{api}.log")
            try:
                wait_ready(store, worker)
                kinds = ["plain", "singleton"]
                if api == apis[0] and peer is not None:
                    kinds.append("celery-singleton")
                for kind in kinds:  # warm-up: imports, connections, first leases
                    run_batch(kind, 50, offset, store, None)
                    offset += 50
                for round_ in range(2):
                    worker_floors.setdefault(api, []).extend(floor_in_worker.delay(150).get(timeout=300))
                    for kind in kinds if round_ == 0 else reversed(kinds):
                        one = run_serial(kind, args.serial // 2, offset, store)
                        offset += args.serial // 2
                        one.update(api=api, round=round_)
                        serial.append(one)
                for round_ in range(args.rounds):
                    order = kinds if round_ % 2 == 0 else list(reversed(kinds))
                    for kind in order:
                        batch = run_batch(kind, args.tasks, offset, store, etcd)
                        offset += args.tasks
                        batch.update(api=api, round=round_)
                        results.append(batch)
                        print(
                            f"{api} round {round_} {kind:17s} {batch['throughput']:7.1f} tasks/s  "
                            f"run median {batch['run_median_ms']:.2f} ms  "
                            f"etcd requests/task {batch.get('etcd_requests_per_task', 0):.2f}",
                            flush=True,
                        )
            finally:
                worker.stop()
            floors[api].extend(floor(etcd.port))  # and after, so drift shows in both

    def med(api: str, kind: str, field: str) -> float:
        return statistics.median(r[field] for r in results if r["api"] == api and r["kind"] == kind)

    def serial_med(api: str, kind: str) -> float:
        return statistics.median(r["serial_run_median_ms"] for r in serial if r["api"] == api and r["kind"] == kind)

    rows = []
    summary: dict[str, Any] = {"floors_ms": {}, "worker_floors_ms": {}, "rows": []}
    for api in apis:
        summary["floors_ms"][api] = 1000 * statistics.median(floors[api])
        floor_ms = summary["worker_floors_ms"][api] = 1000 * statistics.median(worker_floors[api])
        plain_serial = serial_med(api, "plain")
        plain_tp = med(api, "plain", "throughput")
        for kind in ("plain", "singleton", "celery-singleton"):
            if not any(r["api"] == api and r["kind"] == kind for r in results):
                continue
            added = serial_med(api, kind) - plain_serial
            row = {
                "api": api,
                "kind": kind,
                "throughput": med(api, kind, "throughput"),
                "vs_plain": med(api, kind, "throughput") / plain_tp,
                "submit_ms": med(api, kind, "submit_ms"),
                "run_median_ms": med(api, kind, "run_median_ms"),
                "serial_run_median_ms": serial_med(api, kind),
                "added_ms": added if kind != "plain" else None,
                "added_vs_floor": added / floor_ms if kind != "plain" else None,
                "etcd_requests_per_task": med(api, kind, "etcd_requests_per_task"),
            }
            summary["rows"].append(row)
            rows.append(
                [api, kind, row["throughput"], row["vs_plain"], row["submit_ms"], row["run_median_ms"],
                 row["serial_run_median_ms"], row["added_ms"], row["added_vs_floor"], row["etcd_requests_per_task"]]
            )  # fmt: skip
    print()
    print(
        markdown_table(
            ["api", "task", "tasks/s", "vs plain", "submit ms/task", "run ms, loaded", "run ms, alone",
             "added ms/run", "added / floor", "etcd requests/task"],
            rows,
        )
    )  # fmt: skip
    print()
    for api in apis:
        print(
            f"floor ({api}, raw create + delete, median of {len(floors[api])} in the bench process, "
            f"{len(worker_floors[api])} in a pool child): {summary['floors_ms'][api]:.2f} ms, "
            f"{summary['worker_floors_ms'][api]:.2f} ms"
        )
    for row in summary["rows"]:
        if row["kind"] == "singleton":
            ok_requests = row["etcd_requests_per_task"] <= 3
            ok_added = row["added_vs_floor"] <= 1.5
            print(
                f"{row['api']}: etcd requests per singleton run {row['etcd_requests_per_task']:.2f} (target <= 3: "
                f"{'met' if ok_requests else 'MISSED'}); added {row['added_ms']:.2f} ms = "
                f"{row['added_vs_floor']:.2f} x floor (target <= 1.5: {'met' if ok_added else 'MISSED'})"
            )
        if row["kind"] == "celery-singleton":
            ours_row = next(r for r in summary["rows"] if r["api"] == row["api"] and r["kind"] == "singleton")
            versus = ours_row["throughput"] / row["throughput"]
            print(f"{row['api']}: throughput of ours / celery-singleton: {versus:.2f}")
    if args.json:
        raw = {"batches": results, "serial": serial, "floors_s": floors, "worker_floors_s": worker_floors}
        args.json.write_text(json.dumps({**raw, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
