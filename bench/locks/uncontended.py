"""Uncontended acquire + release: the latency of a free lock in one process, against the raw floors.

One worker process runs every lock and floor (on every v3 server of the run: 3.5, 3.4's v3,
``--also-v3``) in turn (the first one rotates
each iteration, so machine noise hits all alike), ``iterations`` times each
after ``warmup`` rounds, ttl 30. Per kind: median and p99 in ms, both divided by
the floor of the same server, and the requests each acquire+release sent (every
urllib3 request / Redis command of the timing thread, counted in the client).
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

from bench.common import markdown_table, median, percentile, ratio, requests_sent
from bench.locks.harness import Harness
from bench.locks.kinds import FLOOR_OF, KINDS, LABELS, make_impl

TTL = 30.0


def task_uncontended(ports: dict[str, int], kinds: list[str], iterations: int, warmup: int, ttl: float) -> dict:
    """Round-robin acquire+release over every kind (rotating who goes first); latencies in ms.

    Also called in the main process by the task benchmark, for its floors.
    """
    impls = {kind: make_impl(kind, ports, ttl) for kind in kinds}
    thread = threading.get_ident()
    latencies: dict[str, list[float]] = {kind: [] for kind in kinds}
    requests: dict[str, int] = dict.fromkeys(kinds, 0)
    names = {kind: f"uncontended-{kind}-{uuid.uuid4().hex[:8]}" for kind in kinds}
    for i in range(warmup + iterations):
        order = kinds[i % len(kinds) :] + kinds[: i % len(kinds)]
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


def run(h: Harness) -> None:
    s = h.settings
    kinds = h.kinds(other_v3=True)
    print(f"uncontended: {', '.join(kinds)} x {s.uncontended_iterations}, interleaved", flush=True)
    h.pool.grow(1)
    h.pool[0].run(
        f"{__name__}:task_uncontended",
        ports=h.ports,
        kinds=kinds,
        iterations=s.uncontended_iterations,
        warmup=s.uncontended_warmup,
        ttl=TTL,
    )
    raw = h.pool[0].result(600)
    h.results["uncontended"] = {
        kind: {
            "median_ms": median(data["ms"]),
            "p99_ms": percentile(data["ms"], 99),
            "requests_per_op": data["requests_per_op"],
            "n": len(data["ms"]),
        }
        for kind, data in raw.items()
    }


def render(results: dict[str, Any], s: dict[str, Any]) -> list[str]:
    unc = results["uncontended"]
    rows = []
    for kind, r in unc.items():
        floor = unc.get(FLOOR_OF[KINDS[kind].server])
        rows.append(
            [
                LABELS[kind],
                KINDS[kind].server,
                r["median_ms"],
                r["p99_ms"],
                ratio(r["median_ms"], floor and floor["median_ms"]),
                ratio(r["p99_ms"], floor and floor["p99_ms"]),
                r["requests_per_op"],
            ]
        )
    return [
        f"### Uncontended acquire+release ({s['uncontended_iterations']} each, interleaved round-robin)\n",
        markdown_table(
            ["lock", "server", "median ms", "p99 ms", "median / floor", "p99 / floor", "requests per acquire+release"],
            rows,
        ),
        "",
    ]
