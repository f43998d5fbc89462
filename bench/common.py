"""Shared helpers for the benchmarks: real servers, /metrics, request counting, worker processes, tables.

    with Servers(etcd_v2=True, etcd_v3=True, redis=True) as servers:
        before = servers.v2.metrics()
        ...
        after = servers.v2.metrics()
        after.delta(before, "etcd_server_proposals_committed_total")
        after.delta(before, servers.v2.requests_metric)   # requests the server received
        servers.v3.revoke_all_leases(); servers.redis.commands(); servers.ports()

    pool = Pool(preload=["bench.bench_locks"])
    pool.grow(8)                                    # 8 spawned processes, modules imported
    results = pool.run_all("bench.bench_locks:contend", [dict(...)] * 8, timeout=60)
    w = pool[0]; w.run("mod:fn", x=1); w.next_event(5); w.send("go"); w.kill()

Inside a worker, a task function may call ``emit(...)`` to report progress to the
main process, ``inbox(timeout)`` to receive what it ``send()``s, and read the
shared multiprocessing values the pool was made with through ``shared()``.

The servers are the tests' own (tests/support's EtcdServer and RedisServer:
real processes on free 127.0.0.1 ports, each in a fresh temp dir); this module
only adds what the benchmarks measure with. Nothing here mocks anything.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import multiprocessing
import multiprocessing.connection
import os
import re
import shutil
import signal
import statistics
import subprocess
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

# the one place bench/ imports the tests' servers from: bench_beat and bench_transport take EtcdServer and
# RedisServer from here
from tests.support import HOST, EtcdServer, RedisServer, ServerError, wait_until

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
# The processes are tests/support's (free ports, temp dirs, health checks, a clean stop, an
# atexit safety net); the wrappers add only what the benchmarks measure with.


class BenchEtcd:
    """A tests.support.EtcdServer serving one API, as the benchmarks use it.

    ``requests_metric`` names the server-side counter of client requests this
    version exposes for the API served: etcd_http_received_total (the v2 keys
    API's HTTP requests) or grpc_server_msg_received_total (v3 gRPC messages;
    the JSON gateway forwards each HTTP call as one).
    """

    def __init__(self, version: str, api: str, server: EtcdServer | None = None) -> None:
        self.server = server or EtcdServer(version, enable_v2=api == "v2", api=api, name="etcdlock-bench")
        self._api = api

    def as_api(self, api: str) -> BenchEtcd:
        """The same server, measured for another API (etcd 3.4 with --enable-v2 also serves v3)."""
        return BenchEtcd(self.server.version, api, self.server)

    @property
    def api(self) -> str:
        return self._api

    @property
    def port(self) -> int:
        return self.server.client_port

    @property
    def url(self) -> str:
        """``http://127.0.0.1:port``."""
        return self.server.client_url

    @property
    def pid(self) -> int:
        assert self.server.process is not None, "not started"
        return self.server.process.pid

    @property
    def requests_metric(self) -> str:
        return "etcd_http_received_total" if self.api == "v2" else "grpc_server_msg_received_total"

    def start(self) -> BenchEtcd:
        self.server.start()
        return self

    def metrics(self) -> Metrics:
        # tests.support scrapes with urllib, not urllib3: scrapes stay out of the client-side request counts
        return Metrics(self.server.metrics())

    def revoke_all_leases(self) -> int:
        """v3: revoke every lease left by earlier runs (tooz leaks one per failed lock attempt);
        their expiry would otherwise add revoke proposals and load to the next run. Returns how many."""
        if self.api != "v3":
            return 0
        status, reply = self.server.v3("lease/leases", {})
        if status != 200:
            raise ServerError(f"POST /v3/lease/leases on {self.server.endpoint} answered {status}: {reply}")
        leases = reply.get("leases") or []
        for lease in leases:
            self.server.v3("lease/revoke", {"ID": lease["ID"]})  # one that expired meanwhile: no matter
        return len(leases)

    def close(self) -> None:
        self.server.close()


class BenchRedis:
    """A tests.support.RedisServer; ``commands()``: server-side commands processed so far."""

    def __init__(self) -> None:
        self.server = RedisServer()
        self._client: Any = None

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def pid(self) -> int:
        assert self.server.process is not None, "not started"
        return self.server.process.pid

    def start(self) -> BenchRedis:
        import redis

        self.server.start()
        self._client = redis.Redis(host=HOST, port=self.port, socket_timeout=2)
        self._client.ping()  # connect now: the handshake must not land between two commands() calls
        return self

    def commands(self) -> int:
        """Commands the server processed so far, not counting this INFO call itself."""
        return int(self._client.info("stats")["total_commands_processed"])

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
        self.server.close()


class Servers(contextlib.AbstractContextManager["Servers"]):
    """etcd 3.4 with --enable-v2 (v2 workloads), etcd 3.5 without v2 (v3 workloads), redis-server.

    ``also_v3``: more release lines ("3.6", "3.7") whose v3 API runs beside 3.5's, one etcd each
    without v2 (``also["3.6"]``; their builds are tests/support's: scripts/etcd-build).
    ``workdir``: a temp dir for the benchmarks' own files (worker logs), removed by ``close()``.
    """

    def __init__(
        self, etcd_v2: bool = True, etcd_v3: bool = True, redis: bool = True, also_v3: Sequence[str] = ()
    ) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="etcdlock-bench-"))
        self.v2: BenchEtcd | None = None
        self.v3: BenchEtcd | None = None
        self.redis: BenchRedis | None = None
        self.also: dict[str, BenchEtcd] = {}
        try:
            self.v2 = BenchEtcd("3.4", "v2") if etcd_v2 else None
            self.v3 = BenchEtcd("3.5", "v3") if etcd_v3 else None
            for line in also_v3:
                self.also[line] = BenchEtcd(line, "v3", EtcdServer(line, enable_v2=False, name=f"etcdlock-bench{line}"))
            self.redis = BenchRedis() if redis else None
        except BaseException:
            self.close()
            raise

    def _all(self) -> list[BenchEtcd | BenchRedis]:
        return [s for s in (self.v2, self.v3, *self.also.values(), self.redis) if s is not None]

    def __enter__(self) -> Servers:
        try:
            for server in self._all():
                server.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ports(self) -> dict[str, int]:
        """Where each API is served; "v3-3.4" is the v3 API of etcd 3.4 (the v2 server serves both),
        "v3-3.6" that of ``also_v3``'s 3.6."""
        servers = [("v2", self.v2), ("v3", self.v3), ("v3-3.4", self.v2), ("redis", self.redis)]
        servers += [(f"v3-{line}", server) for line, server in self.also.items()]
        return {name: s.port for name, s in servers if s}

    def etcd(self, api: str) -> BenchEtcd:
        """The server of ``api`` ("v2", "v3", "v3-3.4", "v3-3.6"...), measured for that API."""
        if api.startswith("v3-") and api[3:] in self.also:
            return self.also[api[3:]]
        etcd = self.v3 if api == "v3" else self.v2
        if etcd is None:
            raise ServerError(f"no etcd for {api} in this run")
        return etcd.as_api("v3") if api == "v3-3.4" else etcd

    def close(self) -> None:
        for server in self._all():
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
    """Count every HTTP request and Redis command this process sends.

    HTTP requests are ours (``transport.Pool.request``, which every request of both
    backends goes through) and the peers' (urllib3's ``urlopen``: python-etcd,
    etcd3gw through requests). ``requests_sent()`` gives the total or one
    thread's count. Hooks added with ``add_request_hook`` see ``(method, url,
    body)`` of each HTTP request after its response arrived.
    """
    global _installed
    if _installed:
        return
    _installed = True
    import urllib3.connectionpool

    from celery_etcdlock.etcd import transport

    original_urlopen = urllib3.connectionpool.HTTPConnectionPool.urlopen

    def urlopen(self: Any, method: str, url: str, body: Any = None, *args: Any, **kwargs: Any) -> Any:
        _count()
        response = original_urlopen(self, method, url, body, *args, **kwargs)
        for hook in list(_hooks):
            hook(method, url, body)
        return response

    urllib3.connectionpool.HTTPConnectionPool.urlopen = urlopen  # type: ignore[method-assign]

    original_request = transport.Pool.request

    def request(self: Any, method: str, target: str, body: bytes = b"", *args: Any, **kwargs: Any) -> Any:
        _count()
        response = original_request(self, method, target, body, *args, **kwargs)
        for hook in list(_hooks):
            hook(method, target, body)
        return response

    transport.Pool.request = request  # type: ignore[method-assign]

    try:
        import redis.connection
    except ImportError:
        return
    original_send_command = redis.connection.AbstractConnection.send_command

    def send_command(self: Any, *args: Any, **kwargs: Any) -> Any:
        _count()
        return original_send_command(self, *args, **kwargs)

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


def cpu_seconds(pid: int) -> float:
    """The CPU time (user + system, all threads) process ``pid`` has used so far; nan if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14 and 15


def stop_process(process: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM ``process`` and wait for it; SIGKILL it if it has not ended within ``timeout`` seconds."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# a poll with a deadline: the tests' own (it raises TimedOut, an AssertionError, when the time is up)
wait_for = wait_until


def sleep_until(moment: float) -> None:
    """Sleep until the monotonic clock (system-wide on Linux, so shared by processes) reads ``moment``."""
    delay = moment - time.monotonic()
    if delay > 0:
        time.sleep(delay)
