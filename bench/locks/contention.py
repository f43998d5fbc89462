"""Contention: N processes loop acquire / read-modify-write a counter in a file / release.

For N = 2, 8, 32 spawned processes, each lock for ``contention_seconds``,
``contention_rounds`` times (the order of the locks alternates per round),
ttl 10; on every v3 server of the run (3.5, 3.4's v3, ``--also-v3``). Before each run on a v3
server every lease left on it is revoked
(tooz grants a lease per failed attempt and leaves it to expire; that expiry
would bill revoke proposals and load to whatever runs next). Per lock and N:

- handoffs/s = acquisitions / (last process done - start);
- lost updates = acquisitions - final counter; overlaps = times a process
  entered the critical section while another was in it (a shared-memory
  counter, a second check);
- fairness = min / max acquisitions per process;
- proposals and server requests per handoff, from the server's counters;
  client requests per handoff, counted in the worker processes.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

from bench import common
from bench.common import markdown_table, ratio
from bench.locks.harness import Harness, merge_runs, read_counter, timed_phases, write_counter
from bench.locks.kinds import KINDS, LABELS, OTHER_V3_LINES, Impl, make_impl, warm_up

PEER_OF = {
    "ours-v2": "etcd.Lock",
    "ours-v3": "tooz-etcd3gw",
    **{f"ours-v3-{line}": f"tooz-etcd3gw-{line}" for line in OTHER_V3_LINES},
}

COUNTERS = {
    "v2": "etcd 3.4 v2: `etcd_server_proposals_committed_total`, requests = `etcd_http_received_total`",
    "v3": "etcd 3.5 v3 (and 3.4's, 3.6's, 3.7's): `etcd_server_proposals_committed_total`, requests = "
    "`grpc_server_msg_received_total` (the JSON gateway forwards each HTTP call as one gRPC message)",
    "redis": "redis: requests = `total_commands_processed` from INFO",
}


def task_contend(kind: str, ports: dict[str, int], name: str, counter: str, ttl: float) -> None:
    """Loop acquire / read counter, sleep(0), write counter+1 / release; count overlaps as a second check."""

    def setup() -> tuple[Impl, int]:
        impl = make_impl(kind, ports, ttl)
        warm_up(impl)
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
            value = read_counter(fd)
            time.sleep(0)
            write_counter(fd, value + 1)
            with inside.get_lock():
                inside.value -= 1
            handle.release()
            acquisitions += 1
        return {"acquisitions": acquisitions, "overlaps": overlaps}

    def teardown(state: tuple[Impl, int]) -> None:
        state[0].close()
        os.close(state[1])

    timed_phases(setup, loop, teardown)


def run(h: Harness) -> None:
    s = h.settings
    kinds = h.kinds(floors=False, other_v3=True)
    runs: dict[str, dict[int, list[dict]]] = {k: {n: [] for n in s.contention_procs} for k in kinds}
    for round_no in range(s.contention_rounds):
        order = kinds if round_no % 2 == 0 else list(reversed(kinds))
        for n in s.contention_procs:
            for kind in order:
                counter = h.new_counter()
                name = f"contend-{kind}-{n}-{round_no}-{uuid.uuid4().hex[:6]}"
                kwargs = dict(kind=kind, ports=h.ports, name=name, counter=counter, ttl=s.contention_ttl)
                one = h.timed_run(
                    KINDS[kind].server, f"{__name__}:task_contend", [kwargs] * n, s.contention_seconds, counter
                )
                runs[kind][n].append(one)
                lost = one["total"] - one["counter"]
                print(
                    f"contention round {round_no + 1} {kind:13} x{n:<2}: {one['total']:6} handoffs "
                    f"{one['total'] / one['seconds']:7.1f}/s lost={lost} overlaps={one['overlaps']}"
                    f"{' BROKEN: ' + str(len(one['broken'])) if one['broken'] else ''}",
                    flush=True,
                )
    h.results["contention"] = {k: {str(n): merge_runs(r) for n, r in by_n.items()} for k, by_n in runs.items()}


def render(results: dict[str, Any], s: dict[str, Any]) -> list[str]:
    con = results["contention"]
    rows = []
    for kind, by_n in con.items():
        peer = PEER_OF.get(kind)
        for n, r in by_n.items():
            peer_rate = con.get(peer, {}).get(n, {}).get("per_second") if peer else None
            rows.append(
                [
                    LABELS[kind],
                    n,
                    r["per_second"],
                    ratio(r["per_second"], peer_rate) if peer else None,
                    r["lost"],
                    r["overlaps"],
                    f"{r['fairness']:.2f} ({r['per_proc_min']}/{r['per_proc_max']})",
                    r["proposals_per_op"],
                    r["requests_per_op"],
                    r["client_requests_per_op"],
                    len(r["broken"]) or "",
                ]
            )
    return [
        f"### Contention: acquire / read-modify-write a file counter / release, "
        f"{s['contention_rounds']} x {s['contention_seconds']} s per cell, ttl {s['contention_ttl']:.0f}\n",
        markdown_table(
            [
                "lock",
                "procs",
                "handoffs/s",
                "ours / peer",
                "lost updates",
                "overlaps",
                "fairness min/max",
                "proposals / handoff",
                "server requests / handoff",
                "client requests / handoff",
                "hung",
            ],
            rows,
        ),
        "\nCounters: " + "; ".join(COUNTERS.values()) + ".\n",
    ]
