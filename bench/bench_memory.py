"""memory:// against etcd: what a lock cycle costs on the in-process backend and on real etcd.

    python -m bench.bench_memory                 # about 30 seconds on 2 cores
    python -m bench.bench_memory --cycles 1000 --seconds 3

Starts etcd 3.4 with --enable-v2 (for etcd://) and etcd 3.5 without v2 (for
etcd3://), the tests' own servers on free loopback ports, and measures in
one process:

- ``uncontended``: one Mutex acquire + release of a free lock (ttl 30), the
  three backends taking turns by blocks of 20 cycles (the first one rotating)
  so that machine noise hits all alike; median and p90 per cycle.
- ``contended``: 4 threads loop acquire / release on one Mutex for a few
  seconds: handoffs per second.

The target (issue 13): memory:// at least 50 times quicker per uncontended
cycle than etcd://. The last line says whether it was met.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import uuid

from bench.common import EtcdServer
from celery_etcdlock import Client, Mutex, connect

TARGET = 50.0  # memory:// at least this many times quicker per cycle than etcd://


def cycle_seconds(clients: dict[str, Client], cycles: int, block: int = 20) -> dict[str, list[float]]:
    """Seconds per acquire + release of a free lock, per backend.

    The backends take turns by blocks of ``block`` cycles, the first one rotating at each round,
    so that machine noise over time hits all alike, and the garbage of an etcd cycle (an HTTP
    request and its answer) is not collected in the middle of a memory:// one.
    """
    names = list(clients)
    locks = {name: Mutex(client, f"bench-{uuid.uuid4().hex[:6]}", ttl=30) for name, client in clients.items()}
    for lock in locks.values():  # warm up: sessions, leases, connections
        for _ in range(20):
            lock.acquire()
            lock.release()
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for i in range(max(1, cycles // block)):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            lock = locks[name]
            for _ in range(block):
                started = time.perf_counter()
                lock.acquire()
                lock.release()
                seconds[name].append(time.perf_counter() - started)
    return seconds


def handoffs_per_second(client: Client, threads: int, seconds: float) -> float:
    name, stop, count, guard = f"contended-{uuid.uuid4().hex[:6]}", threading.Event(), [0], threading.Lock()

    def loop() -> None:
        lock = Mutex(client, name, ttl=30)
        while not stop.is_set():
            with lock, guard:
                count[0] += 1

    workers = [threading.Thread(target=loop, daemon=True) for _ in range(threads)]
    started = time.perf_counter()
    for worker in workers:
        worker.start()
    time.sleep(seconds)
    stop.set()
    for worker in workers:
        worker.join(60)
    return count[0] / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--cycles", type=int, default=300, help="uncontended cycles per backend")
    parser.add_argument("--seconds", type=float, default=2.0, help="length of each contended run")
    parser.add_argument("--threads", type=int, default=4, help="threads of the contended runs")
    args = parser.parse_args()

    v2 = EtcdServer("3.4", enable_v2=True, name="bench-memory-v2")
    v3 = EtcdServer("3.5", enable_v2=False, name="bench-memory-v3")
    try:
        v2.start()
        v3.start()
        clients = {
            "memory://": connect(f"memory://bench-{uuid.uuid4().hex[:6]}"),
            "etcd://": connect(v2.url(prefix="/bench-memory")),
            "etcd3://": connect(v3.url(prefix="/bench-memory")),
        }
        seconds = cycle_seconds(clients, args.cycles)
        rates = {name: handoffs_per_second(client, args.threads, args.seconds) for name, client in clients.items()}
        for client in clients.values():
            client.close()
    finally:
        v2.close()
        v3.close()

    medians = {name: statistics.median(values) for name, values in seconds.items()}
    memory = medians["memory://"]
    print(f"Mutex acquire + release, {args.cycles} cycles each, in turns; {args.threads} threads contending:\n")
    print("| backend | median per cycle | p90 per cycle | times memory:// | handoffs/s contended |")
    print("| --- | --- | --- | --- | --- |")
    for name, values in seconds.items():
        p90 = statistics.quantiles(values, n=10)[-1]
        print(
            f"| {name} | {medians[name] * 1e6:.0f} µs | {p90 * 1e6:.0f} µs | {medians[name] / memory:.1f}x "
            f"| {rates[name]:.0f} |"
        )
    speedup = medians["etcd://"] / memory
    verdict = "met" if speedup >= TARGET else "MISSED"
    print(f"\nmemory:// is {speedup:.0f}x quicker per cycle than etcd:// (target {TARGET:.0f}x: {verdict})")


if __name__ == "__main__":
    main()
