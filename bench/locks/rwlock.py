"""RWLock under a read-mostly mix, against a Mutex doing the same work.

N processes do ``rw_read_share`` reads / the rest writes for ``rw_seconds``. A
read holds ``rw.read()``, reads the counter, sleeps the work time and reads it
again (a change means a writer overlapped); a write holds ``rw.write()`` and
does read, sleep, write + 1. The Mutex row does the same work under ``Mutex``
for everything. 20 ms of work at 2, 8, 32 processes, and 5 ms at 8, where both
locks are bound by their own request rate on 2 cores. Per cell: acquisitions/s,
the RWLock / Mutex ratio, lost updates, exclusion violations, and proposals and
requests per acquisition from the server's counters.
"""

from __future__ import annotations

import os
import random
import time
import uuid
from typing import Any

from bench import common
from bench.common import markdown_table, ratio
from bench.locks.harness import Harness, merge_runs, read_counter, timed_phases, write_counter
from bench.locks.kinds import connect_ours


def task_rw_mix(
    api: str,
    ports: dict[str, int],
    mode: str,
    name: str,
    counter: str,
    ttl: float,
    read_share: float,
    work: float,
    seed: int,
) -> None:
    """Reads and writes at random (``read_share`` reads) under ``mode``: "rwlock" or "mutex"."""

    def setup() -> tuple[Any, Any, int]:
        from celery_etcdlock import Mutex, RWLock

        client = connect_ours(api, ports)
        rw = RWLock(client, name, ttl=ttl)
        if mode == "rwlock":

            def factory(reading: bool) -> Any:
                return rw.read() if reading else rw.write()
        else:

            def factory(reading: bool) -> Any:
                return Mutex(client, name, ttl=ttl)

        warm = Mutex(client, f"warmup-{os.getpid()}", ttl=ttl)
        warm.acquire()
        warm.release()
        return client, factory, os.open(counter, os.O_RDWR)

    def loop(state: tuple[Any, Any, int], end_at: float) -> dict:
        _, factory, fd = state
        rng = random.Random(seed)
        readers, writers = common.shared("readers"), common.shared("writers")
        reads = writes = violations = changed = 0
        while time.monotonic() < end_at:
            reading = rng.random() < read_share
            lock = factory(reading)
            lock.acquire()
            if reading:
                with writers.get_lock():
                    readers.value += 1
                    violations += writers.value > 0
                before = read_counter(fd)
                time.sleep(work)
                changed += read_counter(fd) != before
                with writers.get_lock():
                    readers.value -= 1
                reads += 1
            else:
                with writers.get_lock():
                    writers.value += 1
                    violations += writers.value > 1 or readers.value > 0
                value = read_counter(fd)
                time.sleep(work)
                write_counter(fd, value + 1)
                with writers.get_lock():
                    writers.value -= 1
                writes += 1
            lock.release()
        return {"acquisitions": reads + writes, "reads": reads, "writes": writes, "overlaps": violations + changed}

    def teardown(state: tuple[Any, Any, int]) -> None:
        state[0].close()
        os.close(state[2])

    timed_phases(setup, loop, teardown)


def run(h: Harness) -> None:
    s = h.settings
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for work, procs in s.rw_cells:
        for n in procs:
            for api in h.ours_apis():
                for mode in ("rwlock", "mutex"):
                    counter = h.new_counter()
                    name = f"rw-{mode}-{n}-{uuid.uuid4().hex[:6]}"
                    kwargs_list = [
                        dict(
                            api=api,
                            ports=h.ports,
                            mode=mode,
                            name=name,
                            counter=counter,
                            ttl=s.contention_ttl,
                            read_share=s.rw_read_share,
                            work=work,
                            seed=i,
                        )
                        for i in range(n)
                    ]
                    one = h.timed_run(api, f"{__name__}:task_rw_mix", kwargs_list, s.rw_seconds, counter)
                    merged = merge_runs([one])
                    out.setdefault(f"{mode}-{api}-{work * 1000:.0f}", {})[str(n)] = merged
                    print(
                        f"rwlock {mode:6} {api} {work * 1000:.0f} ms x{n:<2}: {merged['per_second']:7.1f} ops/s "
                        f"lost={merged['lost']} overlaps={merged['overlaps']}",
                        flush=True,
                    )
    h.results["rwlock"] = out


def render(results: dict[str, Any], s: dict[str, Any]) -> list[str]:
    rw = results["rwlock"]
    rows = []
    for key, by_n in rw.items():
        mode, api, work = key.split("-")
        for n, r in by_n.items():
            mutex = rw.get(f"mutex-{api}-{work}", {}).get(n, {}).get("per_second")
            rows.append(
                [
                    f"{'RWLock' if mode == 'rwlock' else 'Mutex'} {api}",
                    f"{work} ms",
                    n,
                    r["per_second"],
                    ratio(r["per_second"], mutex) if mode == "rwlock" else None,
                    r["lost"],
                    r["overlaps"],
                    r["proposals_per_op"],
                    r["requests_per_op"],
                ]
            )
    return [
        f"### RW lock, {s['rw_read_share'] * 100:.0f}/{100 - s['rw_read_share'] * 100:.0f} reads/writes, "
        f"{s['rw_seconds']} s per cell, against Mutex doing the same work\n",
        markdown_table(
            [
                "lock",
                "work",
                "procs",
                "acquisitions/s",
                "RWLock / Mutex",
                "lost updates",
                "exclusion violations",
                "proposals / acquisition",
                "requests / acquisition",
            ],
            rows,
        ),
        "",
    ]
