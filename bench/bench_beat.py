"""Benchmark of leader-only beats: fail-over time, and the etcd load of an idle follower.

    python -m bench.bench_beat [--rounds 3] [--idle 30] [--api v2|v3] [--kinds leader,database]
    python -m bench.bench_beat --quick              # a smoke run: 1 round, ttl 3 only, 5 s idle

``--kinds``: ``leader`` is LeaderScheduler (tests.beatapp, its schedule in beat_schedule);
``database`` is LeaderDatabaseScheduler (tests.djangoproj on a fresh PostgreSQL, its schedule
in django-celery-beat's tables), whose idle follower's database statements per second are
counted from the server's log (``log_statement=all``) beside its etcd requests.

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


KINDS = {  # kind -> (celery app, scheduler)
    "leader": ("tests.beatapp", "celery_etcdlock.beat:LeaderScheduler"),
    "database": ("tests.djangoproj", "celery_etcdlock.beat:LeaderDatabaseScheduler"),
}


class Beat:
    def __init__(self, env: dict[str, str], etcd_url: str, kind: str = "leader", name: str = "") -> None:
        self.lines: list[tuple[float, str]] = []
        self.name = name or f"beat-{uuid.uuid4().hex[:8]}"  # the database's application_name
        app, scheduler = KINDS[kind]
        self.proc = subprocess.Popen(
            [
                CELERY,
                "-A",
                app,
                "beat",
                "-S",
                scheduler,
                "-l",
                "info",
                "-s",
                f"/tmp/unused-beat-schedule-{uuid.uuid4().hex}",
            ],
            cwd=ROOT,
            env=dict(env, ETCDLOCK_URL=etcd_url, DJANGOPROJ_APP_NAME=self.name),
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


class Database:
    """A fresh PostgreSQL with tests.djangoproj migrated, for the ``database`` kind; one database per case."""

    def __init__(self) -> None:
        from tests.support.postgres_server import PostgresServer

        self.server = PostgresServer(log_statement="all").start()
        self.server.create_database("template")
        self.migrate(self.server.url("template"))

    @staticmethod
    def migrate(url: str) -> None:
        env = dict(os.environ, DJANGOPROJ_DB=url, PYTHONPATH=str(ROOT))
        subprocess.run(
            [sys.executable, "-m", "django", "migrate", "--settings=tests.djangoproj.settings", "-v", "0"],
            cwd=ROOT, env=env, check=True, timeout=300,
        )  # fmt: skip

    def fresh(self) -> str:
        """A new database from the template, with one PeriodicTask every second."""
        name = f"b_{uuid.uuid4().hex[:10]}"
        url = self.server.create_database(name, template="template")
        self.server.sql(
            "INSERT INTO django_celery_beat_intervalschedule (every, period) VALUES (1, 'seconds');"
            "INSERT INTO django_celery_beat_periodictask (name, task, interval_id, args, kwargs, enabled, "
            "total_run_count, date_changed, description, one_off, headers, priority) "
            "SELECT 'every', 'djangoproj.record', id, '[]', '{\"entry\": \"every\"}', true, 0, now(), '', "
            "false, '{}', NULL FROM django_celery_beat_intervalschedule",
            name,
        )
        return url

    def close(self) -> None:
        self.server.close()


def base_env(redis: RedisServer, ttl: float, db_url: str = "") -> dict[str, str]:
    tag = uuid.uuid4().hex[:10]
    return dict(
        os.environ,
        DJANGOPROJ_DB=db_url,
        BEATAPP_BEAT_NAME=f"bench-{tag}",
        PYTHONPATH=str(ROOT),
        BEATAPP_BROKER=redis.url(),
        BEATAPP_QUEUE=f"bench-{tag}",
        BEATAPP_RUNS=f"bench-runs-{tag}",
        BEATAPP_BEAT_TTL=str(ttl),
        ETCDLOCK_PREFIX=f"/bench-beat-{tag}",
    )


def failover(etcd: EtcdServer, redis: RedisServer, ttl: float, sig: int, kind: str, db: Database | None) -> float:
    env = base_env(redis, ttl, db.fresh() if db else "")
    beats = [Beat(env, etcd.url(), kind)]
    try:
        wait_for(lambda: beats[0].leading_since(), 60, "the first beat to lead")
        beats.append(Beat(env, etcd.url(), kind))
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


def idle_follower(
    etcd: EtcdServer, redis: RedisServer, ttl: float, seconds: float, kind: str, db: Database | None
) -> tuple[float, float, float | None]:
    """(follower's etcd requests/s, the leader's, the follower's database statements/s or None)."""
    env = base_env(redis, ttl, db.fresh() if db else "")
    leader_proxy = CountingProxy(("127.0.0.1", etcd.client_port))
    follower_proxy = CountingProxy(("127.0.0.1", etcd.client_port))
    scheme = "etcd" if etcd.api == "v2" else "etcd3"
    leader = Beat(env, f"{scheme}://127.0.0.1:{leader_proxy.port}", kind)
    follower = None
    try:
        wait_for(lambda: leader.leading_since(), 60, "the leader")
        follower = Beat(env, f"{scheme}://127.0.0.1:{follower_proxy.port}", kind)
        wait_for(lambda: any("the leader of beat/" in line for _, line in follower.lines), 60, "the follower")
        time.sleep(1.0)  # let start-up requests pass
        lead0, follow0 = leader_proxy.requests, follower_proxy.requests
        queries0 = len(db.server.statements_by(follower.name)) if db else 0
        leader_queries0 = len(db.server.statements_by(leader.name)) if db else 0
        time.sleep(seconds)
        queries = (len(db.server.statements_by(follower.name)) - queries0) / seconds if db else None
        if db is not None:
            leader_queries = (len(db.server.statements_by(leader.name)) - leader_queries0) / seconds
            print(f"  (the database leader: {leader_queries:.2f} statements/s)", flush=True)
        return (follower_proxy.requests - follow0) / seconds, (leader_proxy.requests - lead0) / seconds, queries
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
    parser.add_argument("--kinds", default="leader", help="beats to measure, comma-separated: leader, database")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.idle, args.ttls = 1, 5.0, "3"
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        parser.error(f"--kinds: unknown {unknown}; known: {', '.join(KINDS)}")
    server = EtcdServer("3.4", enable_v2=True) if args.api == "v2" else EtcdServer("3.5", enable_v2=False)
    db = Database() if "database" in kinds else None
    try:
        with server as etcd, RedisServer() as redis:
            print(f"etcd {etcd.version} ({args.api} API), {os.cpu_count()} cores; {args.rounds} rounds per case")
            print(f"{'case':<34}{'min':>8}{'median':>8}{'max':>8}   target")
            for kind in kinds:
                kind_db = db if kind == "database" else None
                for ttl in [float(t) for t in args.ttls.split(",")]:
                    for name, sig, target in (
                        ("SIGKILL", signal.SIGKILL, f"<= {ttl + 1:g} s"),
                        ("SIGTERM", signal.SIGTERM, "<= 0.5 s"),
                    ):
                        times = [failover(etcd, redis, ttl, sig, kind, kind_db) for _ in range(args.rounds)]
                        case = f"{kind} {name} fail-over, ttl {ttl:g}"
                        print(
                            f"{case:<34}{min(times):>7.2f}s{statistics.median(times):>7.2f}s{max(times):>7.2f}s"
                            f"   {target}",
                            flush=True,
                        )
            for kind in kinds:
                for ttl in [float(t) for t in args.ttls.split(",")]:
                    follower, leader, queries = idle_follower(
                        etcd, redis, ttl, args.idle, kind, db if kind == "database" else None
                    )
                    database = "" if queries is None else f", {queries:.2f} database statements/s"
                    print(
                        f"{f'{kind} idle follower, ttl {ttl:g}':<34}{follower:>7.2f} requests/s to etcd"
                        f"{database} (the leader: {leader:.2f} requests/s)   target <= 1",
                        flush=True,
                    )
    finally:
        if db is not None:
            db.close()


if __name__ == "__main__":
    main()
