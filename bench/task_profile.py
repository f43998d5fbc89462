"""Where a worker child's time goes per task run: py-spy samples and cProfile call counts, as report tables.

    print(render_samples({"singleton_task etcd3://": Sampled(profile, child_pids, tasks, kernel_child_ms)}))
    print(render_calls({"singleton_task etcd3://": (stats, runs)}))

From py-spy's samples of the pool children during a batch: the children's
time by package, what our frames (celery_etcdlock/*) were running or calling
into, our functions by cumulative time, and the suspects of issue 17. py-spy
counts a thread as busy while it sits in some socket calls, and as busy when it
is runnable but waiting for a CPU on a saturated machine, so its samples are
read as shares, not CPU time: samples whose innermost frame is a socket send or
receive, a pipe to the pool's parent, or a condition wait are set apart ("in
socket calls and waits"), and the rest is shared out over the children's CPU
time as the kernel counted it (``≈ ms/run``).

From cProfile in the pool children of a worker started for it (``bench.taskapp``,
BENCH_CPROFILE_DIR): how many times each suspect runs per task run, exactly.
"""

from __future__ import annotations

import pstats
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.common import markdown_table
from bench.pyspy import OURS, Frame, Profile, Sample

RENEWER = "etcdlock-renewer"
TRANSPORT = {"urllib3", "http", "socket", "ssl", "selectors"}
TRANSPORT_MODULE = "etcd/transport.py"  # our HTTP client: counted as the transport, not as our own code
# innermost frames that are (mostly) a blocking socket or pipe call, or a wait: not the process's own CPU
# (Connection._fill and Pool._exchange are our transport's recv and sendall)
WAITS = {
    "SocketIO.readinto", "HTTPConnection.send", "AbstractConnection.send_packed_command",
    "SocketBuffer._read_from_socket", "Connection._send", "Connection._recv", "_epoll.poll", "Condition.wait",
    "Event.wait", "Connection._fill", "Pool._exchange",
}  # fmt: skip


def waiting(sample: Sample) -> bool:
    return sample.leaf is not None and sample.leaf.function in WAITS


def _ours(frame: Frame) -> bool:
    return frame.package == OURS


def _transport(frame: Frame) -> bool:
    return frame.package in TRANSPORT or _in(TRANSPORT_MODULE)(frame)


def _in(file_suffix: str) -> Callable[[Frame], bool]:
    return lambda frame: frame.file.replace("\\", "/").endswith(f"{OURS}/{file_suffix}")


def _fn(file_suffix: str, name: str) -> Callable[[Frame], bool]:
    """Our function ``name`` in ``file_suffix`` (py-spy names a method after the class of its ``self``)."""
    in_file = _in(file_suffix)
    return lambda frame: in_file(frame) and frame.function.rpartition(".")[2] == name


def _on_stack(test: Callable[[Frame], bool]) -> Callable[[Sample], bool]:
    return lambda sample: any(test(f) for f in sample.frames)


def _entered_from_ours(package: str) -> Callable[[Sample], bool]:
    """Samples in ``package`` below one of our frames (directly, or through requests)."""

    def test(sample: Sample) -> bool:
        seen_ours = False
        for frame in sample.frames:
            if _ours(frame):
                seen_ours = True
            elif seen_ours and frame.package == package:
                return True
        return False

    return test


def under_ours(sample: Sample) -> str | None:
    """What a sample below our frames was doing: our own code, or the package our deepest frame called.

    requests is split into its own code, the JSON it encodes and decodes, and
    the urllib3/http.client/socket work under it (the transport proper). Our
    own transport (etcd/transport.py) counts as the transport.
    """
    deepest = max((i for i, f in enumerate(sample.frames) if _ours(f) and not _transport(f)), default=None)
    if deepest is None:
        return None
    below = sample.frames[deepest + 1 :]
    if not below:
        return "celery_etcdlock (own code)"
    callee = below[0].package
    if callee == "requests":
        packages = {f.package for f in below}
        if packages & TRANSPORT:
            return "requests -> urllib3/http.client/socket"
        if "json" in packages:
            return "requests -> json"
        return "requests (own code)"
    if _in(TRANSPORT_MODULE)(below[0]):
        return "transport.py/socket/ssl (our HTTP client)"
    if callee in TRANSPORT:
        return "urllib3/http.client/socket"
    return callee


def _requests_above_urllib3(sample: Sample) -> bool:
    where = under_ours(sample) or ""
    return where.startswith("requests") and "urllib3" not in where


# The suspects of issue 17, and what else the profile showed, as the samples that show each.
SUSPECTS: list[tuple[str, Callable[[Sample], bool]]] = [
    ("settings read (settings.py: Settings.from_app, client_for)", _on_stack(_in("settings.py"))),
    ("log calls from our code (logging; lines formatted and written when enabled)", _entered_from_ours("logging")),
    (
        "a new lock object per call (Mutex/QueueLock.__init__)",
        _on_stack(lambda f: _fn("locks/mutex.py", "__init__")(f) or _fn("locks/queue.py", "__init__")(f)),
    ),
    ("session lookup (Client.session)", _on_stack(_fn("locks/client.py", "session"))),
    ("holder string per use (QueueLock.holder: gethostname, getpid)", _on_stack(_fn("locks/queue.py", "holder"))),
    (
        "waking the renewer (Session._schedule, on the task's thread)",
        lambda s: not s.thread.startswith(RENEWER) and _on_stack(_fn("locks/session.py", "_schedule"))(s),
    ),
    ("the renewer thread itself (wake-ups, next_due, v2 tidy-up)", lambda s: s.thread.startswith(RENEWER)),
    ("requests above urllib3 (v3: sessions, adapters, hooks, its JSON)", _requests_above_urllib3),
    ("JSON encode/decode under our code (ours and requests')", _entered_from_ours("json")),
    ("base64 under our code", _entered_from_ours("base64")),
    ("lock name from the arguments (tasks/options.py: signature bind, json.dumps)", _on_stack(_in("tasks/options.py"))),
    ("runtime Protocol isinstance checks (typing; requests 2.34's own)", _entered_from_ours("typing")),
    ("HTTP response headers parsed by http.client (email.feedparser)", _entered_from_ours("email")),
    ("events and signals (observe.py, signals.py)", _on_stack(lambda f: _in("observe.py")(f) or _in("signals.py")(f))),
]


@dataclass
class Sampled:
    """One variant's py-spy recording: its samples, the pool's pids, the tasks it ran, the kernel's CPU count."""

    profile: Profile
    children: list[int]
    tasks: int
    kernel_child_ms: float  # CPU ms per run of the pool children, from /proc/<pid>/stat over the same batch

    @property
    def child(self) -> Profile:
        return self.profile.where(lambda s: s.pid in self.children)

    @property
    def busy(self) -> Profile:
        """The children's samples, without those in socket calls and waits."""
        return self.child.where(lambda s: not waiting(s))

    def ms(self, samples: int) -> float:
        """``samples`` of the children's busy ones, as CPU ms per run (shared out over the kernel's count)."""
        busy = self.busy.total()
        return self.kernel_child_ms * samples / busy if busy else float("nan")

    def share(self, samples: int) -> str:
        busy = self.busy.total()
        return f"{100 * samples / busy:.1f} %" if busy else "-"


def render_samples(recordings: dict[str, Sampled], top: int = 12) -> str:
    """The py-spy tables for every variant's recording (variant label -> recording)."""
    out = ["#### Pool children: samples, and the CPU the kernel counted\n"]
    rows = []
    for label, r in recordings.items():
        child, busy = r.child, r.busy
        rows.append(
            [
                label,
                r.tasks,
                child.total(),
                child.total() - busy.total(),
                busy.total(),
                r.kernel_child_ms,
                r.share(busy.count(lambda s: under_ours(s) is not None)),
                r.share(busy.count(lambda s: s.thread.startswith(RENEWER))),
            ]
        )
    out.append(
        markdown_table(
            [
                "variant",
                "tasks",
                "samples",
                "in socket calls and waits",
                "busy samples",
                "CPU ms/run (kernel)",
                "under celery_etcdlock",
                "renewer thread",
            ],
            rows,
        )
    )
    out.append("")
    by_package = {label: r.busy.self_by(lambda f: f.package) for label, r in recordings.items()}
    totals: dict[str, int] = {}
    for counts in by_package.values():
        for package, n in counts.items():
            totals[package] = totals.get(package, 0) + n
    shown = sorted(totals, key=lambda package: -totals[package])[:top]
    out.append("#### Pool children's busy samples by package (self time): ≈ ms per run\n")
    rows = [[package] + [r.ms(by_package[label][package]) for label, r in recordings.items()] for package in shown]
    rows.append(
        ["(everything else)"]
        + [r.ms(sum(n for q, n in by_package[label].items() if q not in shown)) for label, r in recordings.items()]
    )
    out.append(markdown_table(["package", *recordings], rows))
    out.append("")
    for label, r in recordings.items():
        ours = r.busy.where(lambda s: under_ours(s) is not None)
        if ours.total() > 0.1 * r.busy.total():  # not a plain task's worker, where only a v2 tidy-up shows
            out += _ours_sections(label, r, ours, top)
    return "\n".join(out)


def _ours_sections(label: str, r: Sampled, ours: Profile, top: int) -> list[str]:
    def row(name: str, samples: int) -> list[Any]:
        return [name, r.ms(samples), r.share(samples)]

    callees: dict[str, int] = {}
    for s in ours.samples:
        kind = under_ours(s) or ""
        callees[kind] = callees.get(kind, 0) + s.count
    headers = ["", "≈ ms/run", "share of the children's busy samples"]
    return [
        f"#### {label}: ≈ {r.ms(ours.total()):.2f} ms per run under celery_etcdlock "
        f"({r.share(ours.total())} of the children's busy samples)\n",
        "What our frames were running or calling into:\n",
        markdown_table(["running", *headers[1:]], [row(k, n) for k, n in sorted(callees.items(), key=lambda c: -c[1])]),
        "",
        "The suspects (a sample may count under several):\n",
        markdown_table(["suspect", *headers[1:]], [row(name, ours.count(test)) for name, test in SUSPECTS]),
        "",
        f"Our functions by cumulative time (top {top}):\n",
        markdown_table(["function", *headers[1:]], [row(f, n) for f, n in ours.top_cumulative(top, OURS)]),
        "",
        f"Every function under our frames by self time (top {top}):\n",
        markdown_table(["function", *headers[1:]], [row(f, n) for f, n in ours.top_self(top)]),
        "",
    ]


# The functions whose calls per run say whether a suspect is real: (what, file suffix, function name, callers
# to count: None for every call, else only the calls from files whose path contains this).
CALLS: list[tuple[str, str, str, str | None]] = [
    ("Settings.from_app", "celery_etcdlock/settings.py", "from_app", None),
    ("client_for", "celery_etcdlock/settings.py", "client_for", None),
    ("check_ttl", "celery_etcdlock/options.py", "check_ttl", None),
    ("check_seconds", "celery_etcdlock/options.py", "check_seconds", None),
    ("Logger.info from celery_etcdlock", "logging/__init__.py", "info", f"{OURS}/"),
    ("Logger.debug from celery_etcdlock", "logging/__init__.py", "debug", f"{OURS}/"),
    ("StreamHandler.emit (every log line written)", "logging/__init__.py", "emit", None),
    ("QueueLock.__init__ (a lock object)", "celery_etcdlock/queue.py", "__init__", None),
    ("Client.session", "celery_etcdlock/client.py", "session", None),
    ("QueueLock.holder", "celery_etcdlock/queue.py", "holder", None),
    ("socket.gethostname", "~", "<built-in method _socket.gethostname>", None),
    ("Session._schedule (wakes the renewer if due sooner)", "celery_etcdlock/session.py", "_schedule", None),
    ("Session.next_due", "celery_etcdlock/session.py", "next_due", None),
    ("Condition.notify from Session._schedule (a renewer woken)", "threading.py", "notify", f"{OURS}/session.py"),
    ("requests Session.request", "requests/sessions.py", "request", None),
    ("urllib3 HTTPConnectionPool.urlopen", "urllib3/connectionpool.py", "urlopen", None),
    ("transport Pool.request (every HTTP request of ours)", "celery_etcdlock/etcd/transport.py", "request", None),
    ("transport Connection.read_head (one per answer)", "celery_etcdlock/etcd/transport.py", "read_head", None),
    ("json.dumps", "json/__init__.py", "dumps", None),
    ("json.loads", "json/__init__.py", "loads", None),
    ("base64.b64encode", "base64.py", "b64encode", None),
    ("base64.b64decode", "base64.py", "b64decode", None),
    ("inspect.Signature.bind (lock name)", "inspect.py", "bind", None),
    ("observe.listening (events)", "celery_etcdlock/observe.py", "listening", None),
    ("typing._get_protocol_attrs (Protocol isinstance)", "typing.py", "_get_protocol_attrs", None),
]


def calls_per_run(stats: pstats.Stats, runs: int) -> list[list[Any]]:
    """[what, calls per run, cProfile's cumulative ms per run] for each of ``CALLS``."""
    table: dict[tuple[str, int, str], Any] = stats.stats  # type: ignore[attr-defined]
    rows = []
    for what, file_suffix, name, caller_in in CALLS:
        calls, cumulative = 0, 0.0
        for (file, _, function), (_, total_calls, _, cum, callers) in table.items():
            if function != name or not file.replace("\\", "/").endswith(file_suffix):
                continue
            if caller_in is None:
                calls += total_calls
                cumulative += cum
            else:
                for (caller_file, _, _), (_, n, _, caller_cum) in callers.items():
                    if caller_in in caller_file:
                        calls += n
                        cumulative += caller_cum
        rows.append([what, calls / runs, 1000 * cumulative / runs])
    return rows


def render_calls(profiles: dict[str, tuple[pstats.Stats, int]]) -> str:
    """Calls per run of each of ``CALLS`` (variant label -> (its children's stats, runs))."""
    columns = {label: calls_per_run(stats, runs) for label, (stats, runs) in profiles.items()}
    rows = []
    for i, (what, *_) in enumerate(CALLS):
        rows.append([what] + [f"{columns[label][i][1]:.2f}" for label in profiles])
    return "\n".join(
        [
            "#### Calls per run (cProfile in the pool children, exact counts)\n",
            markdown_table(["function", *profiles], rows),
            "",
        ]
    )
