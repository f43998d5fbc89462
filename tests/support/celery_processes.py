"""Real ``celery beat`` and ``celery worker`` processes of a test app, each with its output in a file.

    procs = CeleryProcesses(tmp_path, "tests.beatapp", env)
    beat = procs.start(["beat", "-S", "celery_etcdlock.beat:LeaderScheduler"], "beat")
    procs.output(beat)     # what it logged so far
    procs.close()          # every process, resumed if frozen, stopped (killed after 15 s)
    print(procs.dump())    # the tail of every log: pytest shows it when the test failed

They die with the test run, even one killed by SIGKILL (``_children.popen``).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from celery_etcdlock import _children

ROOT = Path(__file__).resolve().parents[2]
CELERY = str(Path(sys.executable).with_name("celery"))


class CeleryProcesses:
    """The celery processes a test starts from one app module, and their logs."""

    def __init__(self, tmp: Path, app: str, env: dict[str, str]) -> None:
        self.tmp = tmp
        self.app = app
        self.env = env  # for every process started from now on
        self._logs: dict[subprocess.Popen[bytes], Path] = {}

    def start(self, args: list[str], name: str, **env: str) -> subprocess.Popen[bytes]:
        """``celery -A <app> <args>``, its output in ``<tmp>/<name>-<n>.log``."""
        log = self.tmp / f"{name}-{len(self._logs)}.log"
        with open(log, "wb") as out:
            proc = _children.popen(
                [CELERY, "-A", self.app, *args],
                cwd=ROOT,
                env={**self.env, **env},
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        self._logs[proc] = log
        return proc

    def output(self, proc: subprocess.Popen[bytes]) -> str:
        return self._logs[proc].read_text(errors="replace")

    def close(self) -> None:
        for proc in self._logs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)  # a frozen process cannot act on SIGTERM
                proc.terminate()
        for proc in self._logs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def dump(self) -> str:
        return "\n".join(
            f"==== {log.stem} (pid {proc.pid})\n{log.read_text(errors='replace')[-4000:]}"
            for proc, log in self._logs.items()
        )
