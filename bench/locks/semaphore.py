"""Semaphore of 4 against a Mutex: N processes loop acquire / work / release.

For N = 2, 8, 32 spawned processes (the contention counts), ``semaphore_seconds``
each, with ``semaphore_work`` seconds of work under the lock, ttl 10. A shared
counter of the processes inside the lock catches any over-admission (more
than the limit inside at once). Per lock and N: acquisitions/s, raft proposals
and requests per acquisition from the server's counters, fairness (min / max
acquisitions per process) and over-admissions, which must be 0.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

from bench import common
from bench.common import markdown_table, ratio
from bench.locks.harness import Harness, merge_runs, timed_phases
from bench.locks.kinds import connect_ours

LIMIT = 4


def task_slots(api: str, ports: dict[str, int], name: str, limit: int, ttl: float, work: float) -> None:
    """Loop acquire / sleep ``work`` / release on a Semaphore of ``limit`` (a Mutex when ``limit`` is 1)."""

    def setup() -> Any:
        from celery_etcdlock import Mutex, Semaphore

        client = connect_ours(api, ports)
        warm = Mutex(client, f"warmup-{os.getpid()}", ttl=ttl)
        warm.acquire()
        warm.release()
        if limit == 1:
            return client, lambda: Mutex(client, name, ttl=ttl)
        return client, lambda: Semaphore(client, name, limit=limit, ttl=ttl)

    def loop(state: Any, end_at: float) -> dict:
        _, make = state
        inside = common.shared("inside")
        acquisitions = over = 0
        while time.monotonic() < end_at:
            lock = make()
            lock.acquire()
            with inside.get_lock():
                inside.value += 1
                over += inside.value > limit
            time.sleep(work)
            with inside.get_lock():
                inside.value -= 1
            lock.release()
            acquisitions += 1
        return {"acquisitions": acquisitions, "overlaps": over}

    def teardown(state: Any) -> None:
        state[0].close()

    timed_phases(setup, loop, teardown)


def run(h: Harness) -> None:
    s = h.settings
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for n in s.contention_procs:
        for api in h.ours_apis():
            for limit in (LIMIT, 1):
                name = f"slots-{limit}-{n}-{uuid.uuid4().hex[:6]}"
                kwargs = dict(api=api, ports=h.ports, name=name, limit=limit, ttl=s.contention_ttl,
                              work=s.semaphore_work)  # fmt: skip
                one = h.timed_run(api, f"{__name__}:task_slots", [kwargs] * n, s.semaphore_seconds, h.new_counter())
                merged = merge_runs([one])
                out.setdefault(f"{limit}-{api}", {})[str(n)] = merged
                print(
                    f"semaphore limit {limit} {api} x{n:<2}: {merged['per_second']:7.1f} acquisitions/s "
                    f"over-admissions={merged['overlaps']}",
                    flush=True,
                )
    h.results["semaphore"] = out


def render(results: dict[str, Any], s: dict[str, Any]) -> list[str]:
    sem = results["semaphore"]
    rows = []
    for key, by_n in sem.items():
        limit, api = key.split("-")
        for n, r in by_n.items():
            mutex = sem.get(f"1-{api}", {}).get(n, {}).get("per_second")
            rows.append(
                [
                    f"{'Semaphore of ' + limit if limit != '1' else 'Mutex'} {api}",
                    n,
                    r["per_second"],
                    ratio(r["per_second"], mutex) if limit != "1" else None,
                    r["overlaps"],
                    f"{r['fairness']:.2f} ({r['per_proc_min']}/{r['per_proc_max']})",
                    r["proposals_per_op"],
                    r["requests_per_op"],
                ]
            )
    return [
        f"### Semaphore of {LIMIT} against a Mutex, {s['semaphore_work'] * 1000:.0f} ms of work under the lock, "
        f"{s['semaphore_seconds']} s per cell\n",
        markdown_table(
            [
                "lock",
                "procs",
                "acquisitions/s",
                "semaphore / Mutex",
                "over-admissions",
                "fairness min/max",
                "proposals / acquisition",
                "requests / acquisition",
            ],
            rows,
        ),
        "",
    ]
