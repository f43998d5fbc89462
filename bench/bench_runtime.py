"""Benchmark of runtime entries (``LeaderSchedulerEntry``): save() to first send, and a leader's idle etcd cost.

    python -m bench.bench_runtime [--api v3|v2] [--rounds 20] [--entries 1000] [--idle 30]
    python -m bench.bench_runtime --quick            # a smoke run: 5 rounds, 200 entries, 10 s idle

A fresh etcd (3.5 for v3, 3.4 for v2) and Redis; one ``LeaderScheduler`` in this
process, ticked as ``celery beat`` ticks it (sleeping what ``tick()`` returns), with a
real Redis broker.

- Latency: an entry already due (its last run long ago) is saved by another client;
  the time from ``save()`` returning to the leader's publish of its run
  (``after_task_publish``), over ``--rounds`` entries.
- Idle cost: the leader's HTTP requests to etcd per second over ``--idle`` seconds
  while none of its entries is due, with no runtime entry and with ``--entries``
  (each due once a day). The session's renewals are in both; the entries' watch is
  one request per ``WATCH_TIMEOUT`` whatever their number.

Targets (issue 22): the cost with 1,000 entries is that with none; save-to-send
well within the 5 s the tests allow.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

from celery import Celery
from celery.signals import after_task_publish

from bench.common import Servers, install_request_counting, requests_sent
from celery_etcdlock import connect
from celery_etcdlock.beat import LeaderScheduler, LeaderSchedulerEntry


def make_app(etcd_url: str, redis_url: str, beat: str) -> Celery:
    app = Celery("bench-runtime", broker=redis_url, set_as_current=False)
    app.conf.update(
        task_default_queue=f"bench-{beat}",
        task_ignore_result=True,
        beat_schedule={},
        etcdlock_url=etcd_url,
        etcdlock_beat_name=beat,
        etcdlock_beat_ttl=10,
    )
    return app


class Ticking:
    """A scheduler ticked in a thread as celery beat ticks it."""

    def __init__(self, scheduler: LeaderScheduler) -> None:
        self.scheduler = scheduler
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            self.stop.wait(max(0.0, self.scheduler.tick()))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(15)
        self.scheduler.close()


def wait_for(what: str, check: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.01)


def latency(etcd_url: str, redis_url: str, rounds: int) -> list[float]:
    beat = f"lat-{uuid.uuid4().hex[:8]}"
    app = make_app(etcd_url, redis_url, beat)
    sent: dict[str, float] = {}

    def published(headers: dict[str, Any] | None = None, body: Any = None, **_: Any) -> None:
        if isinstance(body, tuple) and len(body) >= 2 and isinstance(body[1], dict) and "entry" in body[1]:
            sent.setdefault(body[1]["entry"], time.monotonic())

    after_task_publish.connect(published, weak=False)
    ticking = Ticking(LeaderScheduler(app, etcd_client=connect(etcd_url), identity="bench:leader"))
    try:
        wait_for("the leader", lambda: ticking.scheduler.is_leader)
        saver = connect(etcd_url)
        long_ago = datetime.now(timezone.utc) - timedelta(days=1)
        delays = []
        for i in range(rounds):
            name = f"e{i}"
            entry = LeaderSchedulerEntry(
                name, "bench.t", 3600, kwargs={"entry": name}, app=app, client=saver, last_run_at=long_ago
            )
            entry.save()
            saved = time.monotonic()
            wait_for(f"the send of {name}", lambda name=name: name in sent, 30)  # type: ignore[misc]
            delays.append(sent[name] - saved)
        return delays
    finally:
        after_task_publish.disconnect(published)
        ticking.close()


def idle_cost(etcd_url: str, redis_url: str, entries: int, seconds: float) -> float:
    beat = f"idle-{uuid.uuid4().hex[:8]}"
    app = make_app(etcd_url, redis_url, beat)
    saver = connect(etcd_url)
    now = datetime.now(timezone.utc)
    for i in range(entries):
        LeaderSchedulerEntry(f"d{i}", "bench.t", 86400, app=app, client=saver, last_run_at=now).save()
    ticking = Ticking(LeaderScheduler(app, etcd_client=connect(etcd_url), identity="bench:idle"))
    try:
        wait_for("the leader", lambda: ticking.scheduler.is_leader and len(ticking.scheduler.schedule) >= entries)
        time.sleep(1.0)  # the take-over's reads are done: measure the steady state
        before = requests_sent()
        time.sleep(seconds)
        return (requests_sent() - before) / seconds
    finally:
        ticking.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--api", choices=("v2", "v3"), default="v3")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--entries", type=int, default=1000)
    parser.add_argument("--idle", type=float, default=30.0)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.entries, args.idle = 5, 200, 10.0
    install_request_counting()
    with Servers(etcd_v2=args.api == "v2", etcd_v3=args.api == "v3", redis=True) as servers:
        etcd = servers.v2 if args.api == "v2" else servers.v3
        assert etcd is not None and servers.redis is not None
        scheme = "etcd" if args.api == "v2" else "etcd3"
        etcd_url = f"{scheme}://127.0.0.1:{etcd.port}?prefix=/bench-runtime"
        redis_url = f"redis://127.0.0.1:{servers.redis.port}/0"
        delays = latency(etcd_url, redis_url, args.rounds)
        print(f"save() -> first send ({args.api}, {len(delays)} entries): median {statistics.median(delays):.3f}s, "
              f"max {max(delays):.3f}s")  # fmt: skip
        none = idle_cost(etcd_url, redis_url, 0, args.idle)
        many = idle_cost(etcd_url, redis_url, args.entries, args.idle)
        print(f"leader's etcd requests/s while nothing is due: {none:.2f} with no runtime entry, "
              f"{many:.2f} with {args.entries}")  # fmt: skip


if __name__ == "__main__":
    main()
