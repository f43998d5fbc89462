"""Benchmark of LeaderScheduler: fail-over time, and the etcd load of an idle follower.

    python -m bench.bench_beat [--rounds 3] [--idle 30] [--api v2|v3]
    python -m bench.bench_beat --quick              # a smoke run: 1 round, ttl 3 only, 5 s idle

Real processes throughout: a fresh etcd (3.4 with the v2 API, or 3.5 with v3) and Redis, and
``celery -A tests.beatapp beat`` processes (2 per round) with an entry every
second.

- Fail-over: signal the leader (SIGKILL or SIGTERM), then time until the other
  beat logs that it leads (it has been elected *and* has taken the schedule's
  state over, so it sends from that moment), for ``etcdlock_beat_ttl`` 10 and 3.
  Log lines are timestamped on arrival through a pipe.
- Idle follower: the follower's etcd traffic goes through a counting TCP proxy;
  its HTTP requests per second over ``--idle`` seconds (the leader, for
  comparison, is counted too).

Targets (the issue): SIGKILL <= ttl + 1 s, SIGTERM <= 0.5 s, idle follower <= 1 request/s.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from bench.common import EtcdServer, RedisServer, stop_process, wait_for

ROOT = Path(__file__).resolve().parent.parent
CELERY = str(Path(sys.executable).with_name("celery"))
LEADING = re.compile(r"beat (\S+): leading beat/")


class CountingProxy:
    """A loopback TCP proxy to ``upstream`` that counts the HTTP requests passing through."""

    # a request may follow the previous one's body directly: no anchor (bodies are url-encoded or JSON)
    REQUEST = re.compile(rb"(?:GET|PUT|POST|DELETE|HEAD|PATCH) /[^ \r\n]* HTTP/1\.[01]\r\n")

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.requests = 0
        self._lock = threading.Lock()
        self.server = socket.socket()
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(64)
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, count: bool) -> None:
        tail = b""
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if count:
                    window = tail + data
                    found = len(self.REQUEST.findall(window)) - len(self.REQUEST.findall(tail))
                    with self._lock:
                        self.requests += found
                    tail = window[-256:]
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.server.close()


class Beat:
    def __init__(self, env: dict[str, str], etcd_url: str) -> None:
        self.lines: list[tuple[float, str]] = []
        self.proc = subprocess.Popen(
            [
                CELERY,
                "-A",
                "tests.beatapp",
                "beat",
                "-S",
                "celery_etcdlock.beat:LeaderScheduler",
                "-l",
                "info",
                "-s",
                f"/tmp/unused-beat-schedule-{uuid.uuid4().hex}",
            ],
            cwd=ROOT,
            env=dict(env, ETCDLOCK_URL=etcd_url),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        self.identity = f"{socket.gethostname()}:{self.proc.pid}"
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.append((time.time(), raw.decode(errors="replace")))

    def leading_since(self, after: float = 0.0) -> float | None:
        for at, line in list(self.lines):
            if at >= after and LEADING.search(line):
                return at
        return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            stop_process(self.proc, 15)


def base_env(redis: RedisServer, ttl: float) -> dict[str, str]:
    tag = uuid.uuid4().hex[:10]
    return dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        BEATAPP_BROKER=redis.url(),
        BEATAPP_QUEUE=f"bench-{tag}",
        BEATAPP_RUNS=f"bench-runs-{tag}",
        BEATAPP_BEAT_TTL=str(ttl),
        ETCDLOCK_PREFIX=f"/bench-beat-{tag}",
    )


def failover(etcd: EtcdServer, redis: RedisServer, ttl: float, sig: int) -> float:
    env = base_env(redis, ttl)
    beats = [Beat(env, etcd.url())]
    try:
        wait_for(lambda: beats[0].leading_since(), 60, "the first beat to lead")
        beats.append(Beat(env, etcd.url()))
        wait_for(
            lambda: any("the leader of beat/" in line for _, line in beats[1].lines), 60, "the second beat to follow"
        )
        signalled = time.time()
        beats[0].proc.send_signal(sig)
        taken = wait_for(lambda: beats[1].leading_since(signalled), ttl * 3 + 30, "the take-over")
        return taken - signalled
    finally:
        for beat in beats:
            beat.stop()


def idle_follower(etcd: EtcdServer, redis: RedisServer, ttl: float, seconds: float) -> tuple[float, float]:
    env = base_env(redis, ttl)
    leader_proxy = CountingProxy(("127.0.0.1", etcd.client_port))
    follower_proxy = CountingProxy(("127.0.0.1", etcd.client_port))
    scheme = "etcd" if etcd.api == "v2" else "etcd3"
    leader = Beat(env, f"{scheme}://127.0.0.1:{leader_proxy.port}")
    follower = None
    try:
        wait_for(lambda: leader.leading_since(), 60, "the leader")
        follower = Beat(env, f"{scheme}://127.0.0.1:{follower_proxy.port}")
        wait_for(lambda: any("the leader of beat/" in line for _, line in follower.lines), 60, "the follower")
        time.sleep(1.0)  # let start-up requests pass
        lead0, follow0 = leader_proxy.requests, follower_proxy.requests
        time.sleep(seconds)
        return (follower_proxy.requests - follow0) / seconds, (leader_proxy.requests - lead0) / seconds
    finally:
        for beat in (leader, follower):
            if beat is not None:
                beat.stop()
        leader_proxy.close()
        follower_proxy.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="fail-overs measured per case")
    parser.add_argument("--idle", type=float, default=30.0, help="seconds of idle-follower traffic counted")
    parser.add_argument("--ttls", default="10,3", help="beat ttls to measure, comma-separated")
    parser.add_argument("--api", default="v2", choices=["v2", "v3"], help="v2 on etcd 3.4, v3 on etcd 3.5")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 round, ttl 3 only, 5 s idle")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.idle, args.ttls = 1, 5.0, "3"
    server = EtcdServer("3.4", enable_v2=True) if args.api == "v2" else EtcdServer("3.5", enable_v2=False)
    with server as etcd, RedisServer() as redis:
        print(f"etcd {etcd.version} ({args.api} API), {os.cpu_count()} cores; {args.rounds} rounds per case")
        print(f"{'case':<24}{'min':>8}{'median':>8}{'max':>8}   target")
        for ttl in [float(t) for t in args.ttls.split(",")]:
            for name, sig, target in (
                ("SIGKILL", signal.SIGKILL, f"<= {ttl + 1:g} s"),
                ("SIGTERM", signal.SIGTERM, "<= 0.5 s"),
            ):
                times = [failover(etcd, redis, ttl, sig) for _ in range(args.rounds)]
                print(
                    f"{name + f' fail-over, ttl {ttl:g}':<24}{min(times):>7.2f}s{statistics.median(times):>7.2f}s"
                    f"{max(times):>7.2f}s   {target}",
                    flush=True,
                )
        for ttl in [float(t) for t in args.ttls.split(",")]:
            follower, leader = idle_follower(etcd, redis, ttl, args.idle)
            print(
                f"{f'idle follower, ttl {ttl:g}':<24}{follower:>7.2f} requests/s to etcd (the leader: {leader:.2f})"
                f"   target <= 1",
                flush=True,
            )


if __name__ == "__main__":
    main()
