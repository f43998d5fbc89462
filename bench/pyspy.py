"""Sampling profiles of running processes with py-spy, read back as time per package and per function.

    recording = Recording(pid, "out.txt", rate=250)   # py-spy record on pid and its children, until stop()
    ...                                              # the workload
    recording.stop()
    profile = Profile.read("out.txt", rate=250)
    child = profile.where(lambda s: s.pid == child_pid)
    child.seconds(child.total())                     # CPU seconds sampled in that process
    child.top_self(10); child.top_cumulative(10)     # [(function, samples), ...]

py-spy samples every thread of the process ``rate`` times a second without
stopping it (``--nonblocking``) and leaves idle threads out, so a sample is
about 1/rate seconds of CPU. A function's *self* samples are those where it
was running; its *cumulative* ones those where it was anywhere on the stack
(counted once per sample, however often it recurses).
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

OURS = "celery_etcdlock"
_FRAME = re.compile(r"^(.*) \((.*):(\d+)\)$")
_PROCESS = re.compile(r"^process (\d+):")
_THREAD = re.compile(r"^thread \((?:0x)?[0-9a-fA-F]+\): ?(.*)$")


def py_spy() -> str:
    """The py-spy executable next to this Python, or on PATH; RuntimeError if there is none."""
    beside = Path(sys.executable).with_name("py-spy")
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if not found:
        raise RuntimeError("--profile needs py-spy: pip install py-spy (into the venv that runs the benchmark)")
    return found


class Recording:
    """``py-spy record`` of ``pid`` and its child processes, every thread, until ``stop()``."""

    def __init__(self, pid: int, path: str | Path, rate: int = 250) -> None:
        self.path = Path(path)
        self.process = subprocess.Popen(
            [py_spy(), "record", "--pid", str(pid), "--subprocesses", "--threads", "--function", "--nonblocking",
             "--rate", str(rate), "--format", "raw", "--output", str(self.path)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def stop(self) -> str:
        """End the recording (py-spy writes its file on SIGINT); what py-spy said."""
        self.process.send_signal(signal.SIGINT)
        try:
            output, _ = self.process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            output, _ = self.process.communicate()
        said = output.decode(errors="replace")
        if not self.path.exists():
            raise RuntimeError(f"py-spy wrote no profile:\n{said}")
        return said


@dataclass(frozen=True)
class Frame:
    function: str  # "Class.method" or "function"
    file: str  # as py-spy shows it: "celery/app/trace.py", "json/encoder.py", "/work/x/celery_etcdlock/queue.py"

    @property
    def package(self) -> str:
        """The top-level package or stdlib module the frame's code belongs to ("celery_etcdlock", "json")."""
        return package_of(self.file)

    def __str__(self) -> str:
        return f"{self.function} ({short_path(self.file)})"


@dataclass(frozen=True)
class Sample:
    pid: int | None  # the innermost process named on the stack
    thread: str  # the thread's name
    frames: tuple[Frame, ...]  # outermost first
    count: int

    @property
    def leaf(self) -> Frame | None:
        return self.frames[-1] if self.frames else None


def short_path(file: str) -> str:
    """``file`` from its package down: "celery_etcdlock/queue.py", "json/encoder.py"."""
    parts = file.replace("\\", "/").split("/")
    if OURS in parts:
        return "/".join(parts[parts.index(OURS) :])
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            return "/".join(parts[parts.index(marker) + 1 :])
    for i, part in enumerate(parts):
        if re.fullmatch(r"python3\.\d+", part):
            return "/".join(parts[i + 1 :])
    return "/".join(parts)


def package_of(file: str) -> str:
    head = short_path(file).split("/")[0]
    return head[:-3] if head.endswith(".py") else head


def parse_line(line: str) -> Sample | None:
    stack, _, count = line.rstrip("\n").rpartition(" ")
    if not stack or not count.isdigit():
        return None
    pid: int | None = None
    thread = ""
    frames = []
    for part in stack.split(";"):
        process = _PROCESS.match(part)
        if process:
            pid = int(process.group(1))
            continue
        named = _THREAD.match(part)
        if named:
            thread = named.group(1)
            continue
        frame = _FRAME.match(part)
        frames.append(Frame(frame.group(1), frame.group(2)) if frame else Frame(part, ""))
    return Sample(pid, thread, tuple(frames), int(count))


class Profile:
    """The samples of a recording; every count is in samples (``seconds()`` turns them into CPU seconds)."""

    def __init__(self, samples: Iterable[Sample], rate: int) -> None:
        self.samples = list(samples)
        self.rate = rate

    @classmethod
    def read(cls, path: str | Path, rate: int) -> Profile:
        with open(path) as lines:
            return cls((s for s in map(parse_line, lines) if s is not None), rate)

    def where(self, predicate: Callable[[Sample], bool]) -> Profile:
        return Profile((s for s in self.samples if predicate(s)), self.rate)

    def total(self) -> int:
        return sum(s.count for s in self.samples)

    def seconds(self, samples: int) -> float:
        return samples / self.rate

    def count(self, predicate: Callable[[Sample], bool]) -> int:
        return sum(s.count for s in self.samples if predicate(s))

    def self_by(self, key: Callable[[Frame], str]) -> Counter[str]:
        """Samples per ``key`` of the frame that was running."""
        counts: Counter[str] = Counter()
        for s in self.samples:
            if s.leaf is not None:
                counts[key(s.leaf)] += s.count
        return counts

    def cumulative_by(self, key: Callable[[Frame], str]) -> Counter[str]:
        """Samples per ``key`` anywhere on the stack, once per sample."""
        counts: Counter[str] = Counter()
        for s in self.samples:
            for k in {key(f) for f in s.frames}:
                counts[k] += s.count
        return counts

    def top_self(self, n: int) -> list[tuple[str, int]]:
        return self.self_by(str).most_common(n)

    def top_cumulative(self, n: int, package: str | None = None) -> list[tuple[str, int]]:
        """The functions (of ``package`` only, if given) most often on the stack."""
        counts = self.cumulative_by(lambda f: str(f) if package is None or f.package == package else "")
        counts.pop("", None)
        return counts.most_common(n)
