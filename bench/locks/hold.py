"""Many locks held: what keeping ``hold_count`` locks alive costs the server, per second.

One process holds ``hold_count`` locks with ttl ``hold_ttl`` for
``hold_window`` seconds (after a moment to let every renewal schedule settle);
keep-alive requests per second from the server's counters
(``grpc_server_msg_received_total{grpc_method="LeaseKeepAlive"}`` on v3,
``etcd_http_received_total{method="PUT"}`` on v2, where a renewal is a
``refresh=true`` PUT), all requests per second, and the client's own count.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from bench.common import emit, inbox, markdown_table, requests_sent
from bench.locks.harness import Harness
from bench.locks.kinds import KINDS, LABELS, make_impl


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


def run(h: Harness) -> None:
    s = h.settings
    kinds = [f"ours-{api}" for api in h.ours_apis()] + (["tooz-etcd3gw"] if "v3" in s.apis else [])
    out = {}
    h.pool.grow(len(kinds))
    for i, kind in enumerate(kinds):
        server = KINDS[kind].server
        # a worker of its own: what an earlier task left running (a v2 session removing 500 empty
        # queue directories a while after their locks were released) must not count here
        worker = h.pool[i]
        worker.run(f"{__name__}:task_hold_many", kind=kind, ports=h.ports, count=s.hold_count, ttl=s.hold_ttl)
        _, acquire_seconds = worker.next_event(600)
        time.sleep(min(2.0, s.hold_ttl / 2))  # let every renewal schedule settle
        before = h.snapshot(server)
        worker.send("start")
        time.sleep(s.hold_window)
        worker.send("stop")
        after = h.snapshot(server)
        client = worker.result(600)
        etcd = h.etcd(server)
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
        print(
            f"hold {s.hold_count} {kind:13}: {out[kind]['keepalive_per_second']:.1f} keep-alive requests/s "
            f"(acquiring took {acquire_seconds:.1f} s)",
            flush=True,
        )
    h.results["hold"] = out


def render(results: dict[str, Any], s: dict[str, Any]) -> list[str]:
    rows = [
        [LABELS[k], r["keepalive_per_second"], r["requests_per_second"], r["client_requests_per_second"], r["metric"]]
        for k, r in results["hold"].items()
    ]
    return [
        f"### {s['hold_count']} locks held with ttl {s['hold_ttl']:.0f} for {s['hold_window']:.0f} s\n",
        markdown_table(
            ["lock", "keep-alive requests/s", "all server requests/s", "client requests/s", "keep-alive counter"], rows
        ),
        "",
    ]
