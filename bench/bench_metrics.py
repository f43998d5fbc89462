"""What the Prometheus metrics cost: Mutex acquire+release on etcd 3.5, metrics off vs on, in one run.

    python -m bench.bench_metrics                    # 2000 rounds x 2 cycles per side (about a minute)
    python -m bench.bench_metrics --quick            # a smoke run
    python -m bench.bench_metrics --multiprocess     # with PROMETHEUS_MULTIPROC_DIR (values in mmap files)

One process, one uncontended lock, the v3 API on an etcd 3.5 of its own (free
loopback port, temp data dir). The metrics are enabled once, on a registry of
their own; "off" is the state of a process without them: nothing subscribed to
``observe``, so the primitives do not even build their events. Rounds of a few
cycles alternate off/on and on/off, so machine noise hits both sides alike. The
target (issue 15): the median cycle with metrics on costs at most 5% more than
with them off. It also times, without etcd, what one cycle's two events cost the
reporting thread (building them, and the metrics' subscriber), which noise on a
shared machine cannot blur.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import uuid
from typing import Any

from bench.common import BenchEtcd, fmt, markdown_table, median, percentile, ratio

TARGET = 1.05


def measure(url: str, rounds: int, cycles: int, warmup: int) -> dict[str, list[float]]:
    from prometheus_client import CollectorRegistry

    from celery_etcdlock import Mutex, connect, metrics, observe

    client = connect(url)
    registry = CollectorRegistry()
    metrics.enable(registry=registry)
    subscriber = metrics._metrics
    assert subscriber is not None
    lock = Mutex(client, f"bench-metrics-{uuid.uuid4().hex[:8]}", ttl=30)

    cpu = {"off": 0.0, "on": 0.0}

    def side(on: bool, count: int) -> list[float]:
        if on:
            observe.subscribe(subscriber)
        else:
            observe.unsubscribe(subscriber)
        assert observe.listening() is on
        timings = []
        cpu_started = time.process_time()
        for _ in range(count):
            started = time.perf_counter()
            lock.acquire()
            lock.release()
            timings.append(time.perf_counter() - started)
        cpu["on" if on else "off"] += time.process_time() - cpu_started
        return timings

    side(False, warmup)
    side(True, warmup)  # binds the lock's series: their first use is not what a steady worker pays
    cpu.update(off=0.0, on=0.0)
    samples: dict[str, list[float]] = {"off": [], "on": []}
    for index in range(rounds):
        order = (False, True) if index % 2 == 0 else (True, False)
        for on in order:
            samples["on" if on else "off"].extend(side(on, cycles))
    samples["cpu_off"], samples["cpu_on"] = [cpu["off"]], [cpu["on"]]
    observe.subscribe(subscriber)
    samples["events_us"] = [events_cost(lock.name)]
    acquired = sum(
        s.value for m in registry.collect() if m.name == "celery_etcdlock_acquisitions" for s in m.samples
        if s.name.endswith("_total")
    )  # fmt: skip
    assert acquired >= rounds * cycles + warmup, acquired  # the "on" side really counted
    client.close()
    metrics.disable()
    return samples


def events_cost(name: str, count: int = 20000) -> float:
    """Microseconds the reporting thread spends on one cycle's events: ACQUIRED and RELEASED, built and handled."""
    from celery_etcdlock import observe

    def one_cycle() -> None:  # what QueueLock._report does for an acquire and a release
        for kind in (observe.ACQUIRED, observe.RELEASED):
            if observe.listening():
                observe.report(observe.Event(kind, name=name, lock_kind="mutex", token=1, holder="host:1",
                                             data={}, seconds=0.004))  # fmt: skip

    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(count):
            one_cycle()
        best = min(best, (time.perf_counter() - started) / count)
    return best * 1e6


def report(samples: dict[str, list[float]], multiprocess: bool) -> float:
    rows: list[list[Any]] = []
    for side in ("off", "on"):
        values = samples[side]
        rows.append([side, len(values), median(values) * 1000, percentile(values, 90) * 1000,
                     sum(values) / len(values) * 1000, samples[f"cpu_{side}"][0] / len(values) * 1e6])  # fmt: skip
    overhead = ratio(median(samples["on"]), median(samples["off"]))
    cpu_added = (samples["cpu_on"][0] / len(samples["on"]) - samples["cpu_off"][0] / len(samples["off"])) * 1e6
    mode = "multiprocess (PROMETHEUS_MULTIPROC_DIR)" if multiprocess else "in-memory values"
    print(f"\nMutex acquire+release, uncontended, etcd 3.5 (etcd3://), metrics {mode}\n")
    print(markdown_table(["metrics", "cycles", "median ms", "p90 ms", "mean ms", "client CPU us/cycle"], rows))
    print(f"\non/off (median): {fmt(overhead, 3)}   target <= {TARGET}: {'met' if overhead <= TARGET else 'MISSED'}")
    print(f"client CPU added by the metrics (process time, every thread): {cpu_added:.0f} us per cycle")
    events = samples["events_us"][0]
    print(f"one cycle's events, built and counted (no etcd, best of 5): {events:.1f} us = "
          f"{events / (median(samples['off']) * 1e6) * 100:.2f}% of the median cycle")  # fmt: skip
    return overhead


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_metrics", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 100 rounds x 2 cycles")
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--cycles", type=int, default=2, help="acquire+release cycles per side per round")
    parser.add_argument("--multiprocess", action="store_true", help="Prometheus multiprocess mode (a temp dir)")
    args = parser.parse_args(argv)
    rounds, cycles = (100, 2) if args.quick else (args.rounds, args.cycles)
    multiproc_dir = None
    if args.multiprocess:
        if "prometheus_client" in sys.modules:
            parser.error("--multiprocess must be chosen before prometheus_client is imported")
        multiproc_dir = tempfile.mkdtemp(prefix="etcdlock-bench-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = multiproc_dir
    etcd = BenchEtcd("3.5", "v3")
    try:
        etcd.start()
        url = f"etcd3://127.0.0.1:{etcd.port}?prefix=/bench-metrics"
        print(f"etcd 3.5 on port {etcd.port}; {rounds} rounds x {cycles} cycles per side, interleaved", flush=True)
        overhead = report(measure(url, rounds, cycles, warmup=max(10, cycles // 5)), args.multiprocess)
    finally:
        etcd.close()
        if multiproc_dir is not None:
            shutil.rmtree(multiproc_dir, ignore_errors=True)
    return 0 if overhead <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
