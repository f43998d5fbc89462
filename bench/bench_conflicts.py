"""What a task run costs etcd when its lock is taken: requests per skipped run and per waited run.

    python -m bench.bench_conflicts                      # this checkout
    python -m bench.bench_conflicts --code /path/to/old  # another checkout's package, for a before/after

A `@singleton_task(key=["n"])` runs in-process (``Task.apply``, as a worker's
pool runs it) while a Mutex of another client holds its lock:

- **skip**: ``on_conflict="skip"``; the run finds the lock held and returns.
- **wait**: ``on_conflict="wait"``; the holder releases 0.2 s after the run
  starts, and the run then takes the lock and finishes; the holder's own
  release is subtracted.

Requests are counted by the server (``grpc_server_started_total`` on etcd
3.5 for v3, ``etcd_http_received_total`` on etcd 3.4 for v2; a v3 watch is
one), from the first run to the last, divided by the runs.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
from typing import Any

RUNS = 20


def requests_served(server: Any) -> int:
    metric = "grpc_server_started_total" if server.api == "v3" else "etcd_http_received_total"
    return sum(int(float(v)) for v in re.findall(rf"^{metric}{{[^}}]*}} (\S+)$", server.metrics(), re.M))


def measure(server: Any, api: str, runs: int) -> dict[str, float]:
    import celery

    from celery_etcdlock import Mutex, connect, singleton_task

    url = server.url(prefix=f"/conflicts-{api}")
    app = celery.Celery("conflicts", set_as_current=False)
    app.conf.update(etcdlock_url=url, etcdlock_prefix=f"/conflicts-{api}")

    @singleton_task(app=app, key=["n"], on_conflict="skip", shared=False)
    def skipping(n: int) -> str:
        return "ran"

    @singleton_task(app=app, key=["n"], on_conflict="wait", lock_timeout=30, shared=False)
    def waiting(n: int) -> str:
        return "ran"

    holder_client = connect(url)
    results = {}
    for kind, task in (("skip", app.tasks[skipping.name]), ("wait", app.tasks[waiting.name])):
        task.apply(args=(0,))  # warm: the run's client, session and lease exist before counting
        holders = [Mutex(holder_client, task.lock_name_for((n,)), ttl=30) for n in range(1, runs + 1)]
        for holder in holders:
            assert holder.acquire(timeout=10)
        before = requests_served(server)
        released = 0
        for n, holder in enumerate(holders, 1):
            if kind == "wait":
                timer = threading.Timer(0.2, holder.release)
                timer.start()
                released += 1
            outcome = task.apply(args=(n,)).get()
            assert outcome == (None if kind == "skip" else "ran"), outcome
        after = requests_served(server)
        for holder in holders:
            if holder.held:
                holder.release()
        results[kind] = (after - before - released) / runs  # the holders' releases are theirs, not the run's
    holder_client.close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_conflicts", description=__doc__.split("\n")[0])
    parser.add_argument("--code", help="a checkout whose celery_etcdlock to measure (default: this one)")
    parser.add_argument("--runs", type=int, default=RUNS)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    from bench.common import EtcdServer  # the servers: always this checkout's

    if args.code:  # the package measured: another checkout's
        sys.path.insert(0, args.code)
        for name in [m for m in sys.modules if m.startswith("celery_etcdlock")]:
            del sys.modules[name]

    figures = {}
    for api, version, v2 in (("v2", "3.4", True), ("v3", "3.5", False)):
        with EtcdServer(version, enable_v2=v2, api=api) as server:
            figures[api] = measure(server, api, args.runs)
    import celery_etcdlock

    figures["code"] = celery_etcdlock.__file__.rsplit("/celery_etcdlock/", 1)[0]  # type: ignore[assignment]
    if args.json:
        print(json.dumps(figures))
    else:
        print(f"code: {figures['code']}")
        print("| api | requests per skipped run | requests per waited run |\n| --- | --- | --- |")
        for api in ("v2", "v3"):
            print(f"| {api} | {figures[api]['skip']:.2f} | {figures[api]['wait']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
