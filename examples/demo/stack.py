"""The shop's stack as local processes, run by honcho: etcd, Redis, workers and beats.

    stack = LocalStack(Path(tempfile.mkdtemp()), workers=3, beats=2)
    stack.start()                 # writes a Procfile and runs `honcho start` on it
    stack.wait_servers(30)        # etcd and Redis answer
    os.environ.update(stack.env)  # what the shop's processes see: ETCDLOCK_URL, SHOP_BROKER_URL
    ...
    stack.stop()                  # honcho stops every process group (SIGTERM, then SIGKILL)

Everything listens on free 127.0.0.1 ports and keeps its data under the
stack's directory; each worker and beat serves its Prometheus metrics on a
port of its own (``metrics_url(name)``). Each worker and beat runs in a restart loop (as systemd
or docker would restart it), so the demo can kill one and watch it come
back. Every process carries a marker in its environment, so that
``leftovers()`` finds any that outlived the stop, and ``sweep()`` ends them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import redis

REPO = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
MARKER = "SHOP_DEMO_RUN"
SCHEDULER = "celery_etcdlock.beat:LeaderScheduler"
ETCD_RESTART_DELAY = 10  # seconds a killed member of a 3-member cluster stays down before it is restarted


class StackError(RuntimeError):
    """The stack did not come up; the message ends with the tail of its log."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def find_program(name: str, env_var: str, *candidates: str) -> str:
    """A server binary: $env_var, else the first of ``candidates`` that exists, else on PATH."""
    for path in (os.environ.get(env_var), *candidates, shutil.which(name)):
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise StackError(f"{name} not found: install it (apt-get install {name}) or set {env_var}=/path/to/{name}")


class LocalStack:
    def __init__(
        self,
        root: Path,
        *,
        workers: int = 3,
        beats: int = 2,
        etcd_members: int = 1,
        api: str = "v3",
        beat_ttl: float | None = None,
        python: str = sys.executable,
    ) -> None:
        self.root = root
        self.workers = [f"worker-{i}" for i in range(1, workers + 1)]
        self.beats = [f"beat-{i}" for i in range(1, beats + 1)]
        self.etcd_members = [f"etcd-{i}" for i in range(1, etcd_members + 1)]
        self.api = api
        self.python = python
        self.run_id = uuid.uuid4().hex[:12]
        self.etcd_bin = find_program("etcd", "ETCD_BIN", "/usr/bin/etcd")
        self.redis_bin = find_program("redis-server", "REDIS_SERVER", "/usr/bin/redis-server")
        self.client_ports = {m: free_port() for m in self.etcd_members}
        self.peer_ports = {m: free_port() for m in self.etcd_members}
        self.redis_port = free_port()
        # where each worker and beat serves its metrics (examples/shop/metrics.py), and a
        # multiprocess directory for each prefork worker
        self.metrics_ports = {name: free_port() for name in self.workers + self.beats}
        self.metrics_dirs = {name: root / "metrics" / name for name in self.workers}
        scheme = "etcd" if api == "v2" else "etcd3"
        endpoints = ",".join(f"{HOST}:{p}" for p in self.client_ports.values())
        self.env = {
            "ETCDLOCK_URL": f"{scheme}://{endpoints}",
            "ETCDLOCK_PREFIX": "/shop",
            "SHOP_BROKER_URL": f"redis://{HOST}:{self.redis_port}/0",
            "SHOP_RUNLOG_URL": f"redis://{HOST}:{self.redis_port}/1",
        }
        if beat_ttl is not None:
            self.env["ETCDLOCK_BEAT_TTL"] = str(beat_ttl)
        self.procfile = root / "Procfile"
        self.log = root / "stack.log"
        self.honcho: subprocess.Popen[bytes] | None = None

    # -- the Procfile ---------------------------------------------------------------------------

    def procfile_text(self) -> str:
        cluster = ",".join(f"{m}=http://{HOST}:{self.peer_ports[m]}" for m in self.etcd_members)
        lines = []
        for member in self.etcd_members:
            client = f"http://{HOST}:{self.client_ports[member]}"
            peer = f"http://{HOST}:{self.peer_ports[member]}"
            command = [
                self.etcd_bin, f"--name={member}", f"--data-dir={self.root / member}",
                f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster={cluster}", f"--initial-cluster-token=shop-{self.run_id}",
                "--initial-cluster-state=new", "--enable-v2=true", "--log-level=warn",
            ]  # fmt: skip
            if len(self.etcd_members) == 1:
                lines.append(f"{member}: exec {shlex.join(command)}")
            else:  # a member the demo kills comes back later, as systemd would restart it
                lines.append(f"{member}: while :; do {shlex.join(command)}; sleep {ETCD_RESTART_DELAY}; done")
        redis_command = [
            self.redis_bin, "--bind", HOST, "--port", str(self.redis_port), "--save", "", "--appendonly", "no",
            "--dir", str(self.root), "--loglevel", "warning",
        ]  # fmt: skip
        lines.append(f"redis: exec {shlex.join(redis_command)}")
        celery = [self.python, "-m", "celery", "-A", "examples.shop"]
        for worker in self.workers:
            command = [*celery, "worker", f"--hostname={worker}@%h", "--pool=prefork", "--concurrency=2",
                       "--loglevel=INFO"]  # fmt: skip
            lines.append(f"{worker}: {restarting(worker, command, self.metrics_env(worker))}")
        for beat in self.beats:
            command = [*celery, "beat", f"--scheduler={SCHEDULER}", f"--schedule={self.root / beat}.schedule",
                       "--loglevel=INFO"]  # fmt: skip
            lines.append(f"{beat}: {restarting(beat, command, self.metrics_env(beat))}")
        return "\n".join(lines) + "\n"

    def metrics_env(self, name: str) -> dict[str, str]:
        """What makes the worker or beat ``name`` serve its metrics (a restart keeps the directory)."""
        env = {"SHOP_METRICS_PORT": str(self.metrics_ports[name])}
        if name in self.metrics_dirs:
            env["PROMETHEUS_MULTIPROC_DIR"] = str(self.metrics_dirs[name])
        return env

    def metrics_url(self, name: str) -> str:
        return f"http://{HOST}:{self.metrics_ports[name]}/metrics"

    # -- life -------------------------------------------------------------------------------------

    def start(self) -> None:
        self.procfile.write_text(self.procfile_text())
        (self.root / "empty.env").write_text("")
        env = {**os.environ, **self.env, MARKER: self.run_id, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        with open(self.log, "wb") as log:
            self.honcho = subprocess.Popen(
                [self.python, "-m", "honcho", "start", "--no-colour", "-f", str(self.procfile), "-d", str(REPO),
                 "-e", str(self.root / "empty.env")],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )  # fmt: skip

    def wait_servers(self, timeout: float) -> None:
        """Wait until every etcd member and Redis answer."""
        deadline = time.monotonic() + timeout
        pending = [f"http://{HOST}:{p}/health" for p in self.client_ports.values()]
        redis_ok = False
        while time.monotonic() < deadline:
            self.check_running()
            pending = [url for url in pending if not _healthy(url)]
            if not redis_ok:
                with contextlib.suppress(redis.RedisError):
                    redis_ok = bool(redis.Redis(host=HOST, port=self.redis_port, socket_timeout=1).ping())
            if not pending and redis_ok:
                return
            time.sleep(0.2)
        raise StackError(f"etcd or Redis did not answer within {timeout:.0f}s\n{self.log_tail()}")

    def etcd_leader(self) -> str | None:
        """The member a majority of the etcd members name as their raft leader, or None."""
        votes: dict[str, int] = {}
        ids: dict[str, str] = {}
        for member, port in self.client_ports.items():
            status = _etcd_status(port)
            if status is None:
                continue
            ids[str(status.get("header", {}).get("member_id"))] = member
            leader = str(status.get("leader", "0"))
            if leader != "0":
                votes[leader] = votes.get(leader, 0) + 1
        for leader, count in votes.items():
            if count > len(self.etcd_members) // 2 and leader in ids:
                return ids[leader]
        return None

    def etcd_pid(self, member: str) -> int | None:
        """The pid of the etcd process of ``member`` (not its restart loop), if it runs."""
        needle = f"{MARKER}={self.run_id}".encode()
        for pid in self.leftovers():
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if needle in environ and argv and argv[0] == self.etcd_bin.encode() and f"--name={member}".encode() in argv:
                return pid
        return None

    def check_running(self) -> None:
        if self.honcho is not None and self.honcho.poll() is not None:
            raise StackError(f"honcho stopped (exit code {self.honcho.returncode})\n{self.log_tail()}")

    def stop(self, timeout: float = 20.0) -> None:
        """Stop everything: honcho sends SIGTERM to each process group, then SIGKILL after 5 s."""
        honcho, self.honcho = self.honcho, None
        if honcho is None:
            return
        if honcho.poll() is None:
            honcho.send_signal(signal.SIGTERM)
            try:
                honcho.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(honcho.pid, signal.SIGKILL)
                honcho.wait()

    def leftovers(self) -> list[int]:
        """Processes of this stack still alive (found by the marker in their environment)."""
        needle = f"{MARKER}={self.run_id}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if needle in environ.split(b"\0"):
                found.append(int(entry.name))
        return found

    def sweep(self) -> list[int]:
        """SIGKILL whatever survived the stop; returns their pids."""
        left = self.leftovers()
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return left

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(f"  | {line}" for line in text[-lines:])


def restarting(name: str, command: list[str], env: dict[str, str] | None = None) -> str:
    """A Procfile command that restarts ``command`` (with ``env`` added) one second after it dies."""
    assignments = "".join(f"{key}={shlex.quote(value)} " for key, value in (env or {}).items())
    return f"while :; do SHOP_NODE={name} {assignments}{shlex.join(command)}; sleep 1; done"


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:  # noqa: S310 - loopback etcd
            return b"true" in response.read()
    except OSError:
        return False


def _etcd_status(port: int) -> dict[str, Any] | None:
    """A member's /v3/maintenance/status (its member id and the leader it follows), or None if it does not answer."""
    request = urllib.request.Request(
        f"http://{HOST}:{port}/v3/maintenance/status", data=b"{}", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=1) as response:  # noqa: S310 - loopback etcd
            answer = json.loads(response.read())
    except (OSError, ValueError):
        return None
    return answer if isinstance(answer, dict) else None


def children_of(pid: int) -> list[int]:
    """The direct children of ``pid`` (e.g. a prefork worker's pool processes)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1 and fields[1] == str(pid):
            found.append(int(entry.name))
    return found


def kill(pids: list[int]) -> list[int]:
    """SIGKILL each pid; returns the ones that were alive."""
    killed = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        killed.append(pid)
    return killed
