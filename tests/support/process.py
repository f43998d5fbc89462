"""The one base of every test server: a real process in a temp dir of its own, run by mirakuru.

A subclass says what to run (``argv()``), which ports it binds (``ports()``, how to pick
them in ``choose_ports()``) and when it is ready (``ready()``, its health check). The base
does the rest, the same way for etcd and Redis:

    server.start()       first start: fresh free ports; later starts: the same ports and data
    server.pause()       SIGSTOP: the ports still accept connections, nothing answers
    server.resume()      SIGCONT
    server.kill()        SIGKILL, as a crash would
    server.stop()        SIGTERM, then SIGKILL if it takes too long
    server.restart()     stop, then start on the same ports
    server.close()       stop and remove the temp dir
    server.log_tail()    the last lines of its output, for error messages and failure reports

mirakuru starts the process in a session of its own, polls ``ready()`` until a deadline and
notices an early exit. At exit, ours kills every server still running and removes the temp
dirs (etcd preallocates 64 MB of WAL in each). A test run killed outright (no atexit) takes its
servers with it: they are started by ``celery_etcdlock._children.popen``.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import weakref
from pathlib import Path
from typing import Any, TypeVar

import mirakuru
from mirakuru.exceptions import AlreadyRunning, ProcessExitedWithError, ProcessFinishedWithError, TimeoutExpired

from celery_etcdlock import _children
from tests.support.ports import HOST
from tests.support.wait import wait_until

START_TIMEOUT = 60.0  # generous: a loaded 2-core machine is slow to fsync and elect; also the stop deadline
PORT_RETRIES = 5


ServerT = TypeVar("ServerT", bound="ServerProcess")


class ServerError(RuntimeError):
    """A test server did not start, stop or answer as expected (with its log tail)."""


_live: weakref.WeakSet[ServerProcess] = weakref.WeakSet()
_dirs: set[Path] = set()


# mirakuru's own exit hook kills every process whose mirakuru_uuid variable *contains* our pid
# as a substring: in another test run at the same time, pid 51234 or a uuid with "1234" in
# it would match our pid 1234. Ours kills exactly the servers we started.
atexit.unregister(mirakuru.base.cleanup_subprocesses)


@atexit.register
def _clean_up_leftovers() -> None:
    """The safety net: no server, and no temp dir, outlives the test run."""
    for server in list(_live):
        with contextlib.suppress(Exception):
            server.kill()
    for directory in list(_dirs):
        shutil.rmtree(directory, ignore_errors=True)


def accepts_connections(port: int) -> bool:
    """Whether something listens on the loopback ``port`` now."""
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex((HOST, port)) == 0


def tail(path: Path, lines: int) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


class _Executor(mirakuru.Executor):
    """mirakuru's executor for one run of ``server``: ready when the server's own health check says so."""

    def __init__(self, server: ServerProcess, log: Any) -> None:
        super().__init__(
            server.argv(),
            timeout=START_TIMEOUT,
            sleep=0.05,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            popen_kwargs=server.popen_kwargs(),
        )
        self._server = weakref.proxy(server)

    @property
    def _popen_kwargs(self) -> dict[str, Any]:
        kwargs = dict(super()._popen_kwargs)
        # mirakuru's preexec_fn=os.setsid runs Python between fork and exec; the same, done by Popen itself:
        if kwargs.pop("preexec_fn", None) is os.setsid:
            kwargs["start_new_session"] = True
        return kwargs

    def start(self) -> _Executor:
        # mirakuru's Executor.start, except that the process is started by _children.popen: it dies
        # with the test run even when that is SIGKILLed (no atexit hook runs then, ours or mirakuru's).
        if self.pre_start_check():
            raise AlreadyRunning(self)
        if self.process is None:
            self.process = _children.popen(self.command_parts, **self._popen_kwargs)
        self._set_timeout()
        self.wait_for(self.check_subprocess)
        return self

    def pre_start_check(self) -> bool:
        # True makes mirakuru refuse to start: something else already listens on our ports.
        return any(accepts_connections(port) for port in self._server.ports())

    def after_start_check(self) -> bool:
        return self._server.ready()


class ServerProcess:
    """A server the tests start, health-check, freeze, crash and restart for real."""

    kind = "server"  # names the server in messages, e.g. "etcd 3.4"
    log_name = "server.log"

    def __init__(self, dir_prefix: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=dir_prefix))
        _dirs.add(self.dir)
        self.log_path = self.dir / self.log_name
        self.paused = False
        self._executor: _Executor | None = None

    # -- what a subclass says

    def argv(self) -> list[str]:
        """The command line of the server."""
        raise NotImplementedError

    def ports(self) -> list[int]:
        """The loopback ports the server binds (0 before the first start)."""
        raise NotImplementedError

    def choose_ports(self) -> None:
        """Pick fresh free ports, before the first start (and after losing a port to another process)."""
        raise NotImplementedError

    def ready(self) -> bool:
        """The health check: True once the server answers as it should. Polled while starting."""
        raise NotImplementedError

    def popen_kwargs(self) -> dict[str, Any]:
        """Extra arguments for ``subprocess.Popen`` (a cluster member runs with a group of its own)."""
        return {}

    def forget_data(self) -> None:
        """Remove what a failed first start left behind, before trying again on fresh ports."""

    # -- state

    @property
    def process(self) -> subprocess.Popen[str] | None:
        return self._executor.process if self._executor is not None else None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    # -- life cycle

    def start(self: ServerT) -> ServerT:
        """Start (fresh free ports the first time, the same ports later) and wait until ``ready()``.

        Returns the server. Raises ServerError with the log tail if it exits or is not ready in time.
        """
        if self.running:
            raise ServerError(f"{self.kind} is already running")
        first = not all(self.ports())
        for attempt in range(PORT_RETRIES if first else 1):
            if first:
                self.choose_ports()
            try:
                self._run()
                return self
            except ServerError:
                lost_port_race = first and "address already in use" in self.log_tail(30).lower()
                self.kill()
                if not lost_port_race or attempt == PORT_RETRIES - 1:
                    raise
                self.forget_data()
        raise AssertionError("unreachable")

    def _run(self) -> None:
        self.paused = False
        _live.add(self)
        try:
            with open(self.log_path, "a") as log:  # the server writes to its own copy of the file descriptor
                log.write(f"--- start {shlex.join(self.argv())}\n")
                log.flush()
                self._executor = _Executor(self, log)
                self._executor.start()
        except AlreadyRunning:
            self._note("address already in use: something else listens on one of our ports")
            raise ServerError(f"{self.kind}: something else already listens on one of {self.ports()}") from None
        except ProcessExitedWithError as exc:
            raise ServerError(
                f"{self.kind} exited with {exc.exit_code} while starting; log:\n{self.log_tail()}"
            ) from None
        except TimeoutExpired:
            raise ServerError(
                f"{self.kind} on ports {self.ports()} not ready after {START_TIMEOUT:g}s; log:\n{self.log_tail()}"
            ) from None

    def check_alive(self) -> None:
        """For ``ready()``: fail at once, with the log, if the process has exited."""
        process = self.process
        if process is None or process.poll() is not None:
            code = process.returncode if process is not None else None
            raise ServerError(f"{self.kind} exited with {code} while starting; log:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM and wait (SIGKILL after START_TIMEOUT). Data stays."""
        executor = self._executor
        if executor is None or not executor.running():
            return
        if self.paused:
            self._signal(signal.SIGCONT)  # a frozen process cannot act on SIGTERM
            self.paused = False
        try:
            executor.stop()
        except ProcessFinishedWithError as exc:
            self._note(f"stopped with exit code {exc.exit_code}")

    def kill(self) -> None:
        """SIGKILL, as a crash would. Data stays (what the server had written)."""
        if self._executor is not None:
            self._executor.kill()
        self.paused = False

    def restart(self: ServerT) -> ServerT:
        """Stop (if running) and start again on the same ports with the same data."""
        self.stop()
        return self.start()

    def pause(self) -> None:
        """SIGSTOP: the process stays, its ports accept connections, nothing answers."""
        if not self.running:
            raise ServerError(f"{self.kind} is not running")
        self._signal(signal.SIGSTOP)
        self.paused = True
        # a signal is delivered asynchronously: until every thread has stopped, the server may still answer
        wait_until(self._stopped, 10, f"{self.kind} to stop on SIGSTOP", interval=0.002)

    def _stopped(self) -> bool:
        """Whether every thread of the process is stopped (state T in /proc), where /proc tells."""
        assert self.pid is not None
        try:
            tasks = os.listdir(f"/proc/{self.pid}/task")
        except OSError:
            return True  # no /proc here (or the process is gone): nothing to wait for
        for tid in tasks:
            try:
                with open(f"/proc/{self.pid}/task/{tid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state not in ("T", "t"):
                return False
        return True

    def resume(self) -> None:
        """SIGCONT after pause()."""
        if self.running:
            self._signal(signal.SIGCONT)
        self.paused = False

    def close(self) -> None:
        """Stop and remove the temp dir (data, log, certificates)."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
        _dirs.discard(self.dir)

    def __enter__(self: ServerT) -> ServerT:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _signal(self, sig: int) -> None:
        # mirakuru started the server in a session of its own: signal its whole process group.
        assert self.pid is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, sig)

    # -- its output

    def log_tail(self, lines: int = 40) -> str:
        return tail(self.log_path, lines)

    def _note(self, line: str) -> None:
        with open(self.log_path, "a") as log:
            log.write(f"--- {line}\n")
