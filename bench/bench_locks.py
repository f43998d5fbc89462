"""The lock benchmark: celery_etcdlock's Mutex, RWLock and Election side by side with their peers.

    python -m bench.bench_locks                      # the full run (about 6 minutes on 2 cores)
    python -m bench.bench_locks --quick              # a smoke run (about a minute)
    python -m bench.bench_locks --apis v3 --only contention --json out.json
    python -m bench.bench_locks --also-v3 3.6,3.7 --only uncontended,contention --rounds 1   # every etcd

It starts its own servers (etcd 3.4 with --enable-v2 for the etcd:// workloads,
etcd 3.5 without v2 for the etcd3:// ones, with ``--also-v3`` an etcd 3.6 and 3.7 for
uncontended and contention on their v3 too, redis-server for the Redis peers), all
on free loopback ports with temp data dirs, runs every workload in one run with
the measurements of ours, the floors and the peers interleaved, and prints
Markdown tables (ratios first, raw numbers after) and the targets met or missed.

Workloads (``--only``), one module each under bench/locks/:

- ``uncontended``: acquire+release latency in one process, round-robin over every
  lock and the raw create+delete floors, so machine noise hits all alike.
- ``contention``: 2/8/32 processes loop acquire / read-modify-write a counter in a
  file / release: handoffs/s, lost updates, fairness, raft proposals and requests
  per handoff (server-side counters from /metrics, Redis INFO).
- ``killed``: a holder SIGKILLed right after a renewal (the worst case); how long a
  queued waiter takes to get the lock.
- ``election``: 3 candidates, ttl 3: new leader after resign() and after SIGKILL.
- ``rwlock``: a 90/10 read/write mix under RWLock against Mutex doing the same work.
- ``semaphore``: a Semaphore of 4 against a Mutex at 2/8/32 processes: acquisitions/s,
  proposals per acquisition, fairness, over-admissions.
- ``hold``: 500 locks held for 10 s with ttl 5: keep-alive requests per second.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from bench.common import Pool, Servers
from bench.locks.harness import Harness, Settings
from bench.locks.report import WORKLOADS, report

# imported by every worker process before any timing, so that no import lands inside a measurement
LIBRARIES = [
    "celery_etcdlock",
    "etcd",
    "etcd3gw",
    "redis_lock",
    "tooz.coordination",
    "tooz.drivers.etcd3gw",
    "tooz.drivers.redis",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_locks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run (about a minute)")
    parser.add_argument("--apis", default="v2,v3", help="etcd APIs to run: v2, v3 or v2,v3 (default)")
    workloads = list(WORKLOADS)
    parser.add_argument("--only", default="", help=f"comma-separated subset of: {', '.join(workloads)}")
    parser.add_argument("--json", metavar="PATH", help="also write every raw number to this JSON file")
    parser.add_argument(
        "--also-v3",
        default="",
        metavar="LINES",
        help="etcd release lines (3.6, 3.7) whose v3 API the uncontended and contention workloads run on too, "
        "beside 3.5 and 3.4 (built by scripts/etcd-build)",
    )
    parser.add_argument("--rounds", type=int, help="contention rounds per cell (default 3; 1 with --quick)")
    args = parser.parse_args(argv)
    apis = [a.strip() for a in args.apis.split(",") if a.strip()]
    if not apis or any(a not in ("v2", "v3") for a in apis):
        parser.error(f"--apis takes v2, v3 or v2,v3, not {args.apis!r}")
    only = [w.strip() for w in args.only.split(",") if w.strip()] or workloads
    unknown = [w for w in only if w not in workloads]
    if unknown:
        parser.error(f"--only: unknown workload(s) {', '.join(unknown)}; choose from {', '.join(workloads)}")
    also_v3 = [line.strip() for line in args.also_v3.split(",") if line.strip()]
    if any(line not in ("3.6", "3.7") for line in also_v3) or "v3" not in apis and also_v3:
        parser.error(f"--also-v3 takes 3.6, 3.7 or 3.6,3.7 with --apis including v3, not {args.also_v3!r}")
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds must be at least 1, not {args.rounds}")
    settings = Settings.make(args.quick, apis, only, also_v3, args.rounds)

    began = time.monotonic()
    preload = [module.__name__ for module in WORKLOADS.values()] + LIBRARIES
    pool = Pool(preload=preload, shared=["inside", "readers", "writers"])
    try:
        with Servers(etcd_v2="v2" in apis, etcd_v3="v3" in apis, redis=True, also_v3=also_v3) as servers:
            print(f"servers up: {servers.ports()}", flush=True)
            harness = Harness(settings, servers, pool)
            pool.grow(settings.processes_needed())
            for name, workload in WORKLOADS.items():
                if name in only:
                    workload.run(harness)
            results = harness.results
    finally:
        pool.close()
    results["seconds"] = time.monotonic() - began
    text = report(results)
    print("\n" + text)
    print(f"\n(run took {results['seconds']:.0f} s; python {sys.version.split()[0]}, {os.cpu_count()} CPUs)")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
