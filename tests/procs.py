"""Run Python code in a real OS subprocess and wait for the lines it prints, with deadlines.

    with Proc.start('''
        import os, sys
        from celery_etcdlock import connect, Mutex
        m = Mutex(connect(os.environ["URL"]), "job", ttl=2)
        m.acquire()
        print("acquired", m.token)
        sys.stdin.readline()          # hold until told
    ''', env={"URL": etcd_url}) as holder:
        token = int(holder.expect(r"acquired (\\d+)").group(1))
        holder.kill()                 # SIGKILL: a crash, no cleanup
        ...

The child is ``sys.executable -u`` with the repo root on PYTHONPATH, stdout and stderr
merged into ``lines``. ``expect()`` waits on a condition variable until a line matches or the
deadline passes (then it fails showing everything the child printed): never a sleep.
Leaving the ``with`` block (or the ``spawn`` fixture's teardown) always kills and reaps, and a
test run killed outright takes its children with it (``celery_etcdlock._children``).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path

from celery_etcdlock import _children

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TIMEOUT = 30.0  # generous: a loaded 2-core machine starts Python + celery slowly

_live: weakref.WeakSet[Proc] = weakref.WeakSet()


class ProcFailed(AssertionError):
    """expect()/wait() did not get what it waited for; the message has the child's output."""


class Proc:
    """A child Python process whose output is collected line by line by a reader thread."""

    def __init__(
        self, argv: list[str], env: Mapping[str, str] | None = None, cwd: str | Path | None = None, name: str = "proc"
    ) -> None:
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO_ROOT)] + ([full_env["PYTHONPATH"]] if full_env.get("PYTHONPATH") else [])
        )
        full_env["PYTHONUNBUFFERED"] = "1"
        full_env.update(env or {})
        self.name = name
        self.argv = argv
        self.lines: list[str] = []
        self._cursor = 0  # expect() searches lines from here on
        self._cond = threading.Condition()
        self._eof = False
        self.popen = _children.popen(  # dies with the test run, even a SIGKILLed one
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=str(cwd or REPO_ROOT),
            env=full_env,
            text=True,
            encoding="utf-8",
            errors="replace",
            bufsize=1,
        )
        self._reader = threading.Thread(target=self._read, name=f"procs-reader-{self.popen.pid}", daemon=True)
        self._reader.start()
        _live.add(self)

    # -- starting

    @classmethod
    def start(
        cls,
        code: str,
        *args: str,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        name: str = "proc",
    ) -> Proc:
        """Run ``code`` (dedented) as ``python -u -c code *args``."""
        return cls([sys.executable, "-u", "-c", textwrap.dedent(code), *args], env=env, cwd=cwd, name=name)

    @classmethod
    def module(
        cls,
        module: str,
        *args: str,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        name: str | None = None,
    ) -> Proc:
        """Run ``python -u -m module *args`` (e.g. ``Proc.module("celery", "-A", "app", "worker")``)."""
        return cls([sys.executable, "-u", "-m", module, *args], env=env, cwd=cwd, name=name or module)

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    # -- reading

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def output(self) -> str:
        with self._cond:
            return "\n".join(self.lines)

    def expect(self, pattern: str | re.Pattern[str], timeout: float = DEFAULT_TIMEOUT) -> re.Match[str]:
        """Wait for the next line (after the last expected one) that matches ``pattern`` (re.search).

        Returns the match; raises ProcFailed with the whole output if the deadline passes or the
        child's output ends first.
        """
        regex = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                while self._cursor < len(self.lines):
                    line = self.lines[self._cursor]
                    self._cursor += 1
                    found = regex.search(line)
                    if found:
                        return found
                if self._eof:
                    self.popen.wait()
                    self._fail(f"exited with {self.popen.returncode} before printing a line matching {regex.pattern!r}")
                left = deadline - time.monotonic()
                if left <= 0:
                    self._fail(f"printed no line matching {regex.pattern!r} within {timeout:g}s")
                self._cond.wait(left)

    def expect_all(self, patterns: Iterable[str], timeout: float = DEFAULT_TIMEOUT) -> list[re.Match[str]]:
        """expect() each pattern in order, all within one deadline."""
        deadline = time.monotonic() + timeout
        return [self.expect(p, max(0.0, deadline - time.monotonic())) for p in patterns]

    def matches(self, pattern: str) -> list[re.Match[str]]:
        """Every line so far (expected or not) that matches ``pattern``; does not wait."""
        regex = re.compile(pattern)
        with self._cond:
            return [m for m in map(regex.search, self.lines) if m]

    def wait(self, timeout: float = DEFAULT_TIMEOUT) -> int:
        """Wait for the child to exit and its output to be read; its exit code (negative: signal)."""
        try:
            code = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self._fail(f"did not exit within {timeout:g}s")
        self._reader.join(timeout)
        return code

    def expect_exit(self, code: int = 0, timeout: float = DEFAULT_TIMEOUT) -> None:
        """wait() and check the exit code."""
        got = self.wait(timeout)
        if got != code:
            self._fail(f"exited with {got}, expected {code}")

    def _fail(self, why: str) -> None:
        output = "\n".join(f"  | {line}" for line in self.lines) or "  | (no output)"
        raise ProcFailed(f"{self.name} (pid {self.pid}) {why}; its output:\n{output}")

    # -- writing

    def send(self, text: str) -> None:
        """Write ``text`` to the child's stdin (add the newline yourself) and flush."""
        assert self.popen.stdin is not None
        self.popen.stdin.write(text)
        self.popen.stdin.flush()

    # -- signals

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)

    def kill(self) -> int:
        """SIGKILL and reap: a crash, nothing in the child runs. Returns the exit code."""
        self.signal(signal.SIGKILL)
        return self._reap()

    def terminate(self, timeout: float = DEFAULT_TIMEOUT) -> int:
        """SIGTERM (and SIGCONT, in case it is stopped), wait; SIGKILL if it outlives ``timeout``."""
        self.signal(signal.SIGTERM)
        self.signal(signal.SIGCONT)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
        return self._reap()

    def interrupt(self, timeout: float = DEFAULT_TIMEOUT) -> int:
        """SIGINT (KeyboardInterrupt in the child), wait; SIGKILL if it outlives ``timeout``."""
        self.signal(signal.SIGINT)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
        return self._reap()

    def stop(self) -> None:
        """SIGSTOP: the child freezes (its threads too, renewals included) until cont()."""
        self.signal(signal.SIGSTOP)

    def cont(self) -> None:
        """SIGCONT after stop()."""
        self.signal(signal.SIGCONT)

    def _reap(self) -> int:
        code = self.popen.wait()
        self._reader.join(10)
        for stream in (self.popen.stdin, self.popen.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        return code

    def __enter__(self) -> Proc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def __repr__(self) -> str:
        state = "running" if self.alive else f"exited {self.popen.returncode}"
        return f"<Proc {self.name} pid={self.pid} {state}>"


def kill_all() -> None:
    """Kill and reap every Proc still alive in this process (the test session's safety net)."""
    for proc in list(_live):
        proc.kill()
