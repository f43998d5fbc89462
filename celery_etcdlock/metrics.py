"""Prometheus metrics of the locks, the elections and the beat, kept from what the primitives report.

    pip install 'celery-etcdlock[metrics]'      # brings prometheus-client

    from celery_etcdlock import metrics
    metrics.enable()                            # on prometheus_client's default registry
    metrics.enable(registry=my_registry)        # or on another one (moves them there, values kept)
    metrics.disable()                           # stop, and unregister them

Celery workers and ``LeaderScheduler`` beats call ``enable()`` by themselves
when prometheus_client is installed (see settings.py: ``etcdlock_metrics``,
``etcdlock_metrics_registry``); a program that uses only the primitives calls
it itself. Until then nothing here imports prometheus_client, and nothing
listens to ``observe``: a process without the extra pays nothing.

Every metric is named ``celery_etcdlock_*`` (the list is in docs/observability.md).
Labels are chosen for cardinality and privacy: ``kind`` (``mutex``, ``semaphore``,
``read``, ``write``), ``lock`` (the lock's name, or for the lock of a task the
task's name: a task's lock name carries argument values, which must never become
labels), ``task`` (the task's name, "" outside a task), the election or beat
name, a beat entry, an etcd endpoint (``http://host:port``, never credentials).

Under Prometheus multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set before
prometheus_client is first imported: a prefork worker's pool processes hold the
locks) the gauges add up the live processes: ``locks_held`` sums them and
``leader`` takes their maximum.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import logging
import os
import re
import threading
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from . import observe

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

logger = logging.getLogger(__name__)

PREFIX = "celery_etcdlock_"

#: seconds: from an uncontended acquire (milliseconds) to a run that waited its whole lock_timeout (an hour)
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)

LOCK_LABELS = ("kind", "lock", "task")

# acquisitions{outcome}
ACQUIRED, TIMED_OUT, REFUSED, SKIPPED = "acquired", "timed_out", "refused", "skipped"

#: what a task run does when it finds its lock held, as an acquisition outcome ("wait" ends as acquired or timed_out)
_TASK_OUTCOMES = {"skip": SKIPPED, "raise": REFUSED, "retry": REFUSED, "reschedule": REFUSED}


def _endpoint_label(endpoint: str | None) -> str:
    """``scheme://host:port`` of ``endpoint``: whatever it carried, never a user or password."""
    try:
        parts = urlsplit(endpoint or "")
        host = parts.hostname
        port = parts.port
    except ValueError:
        return "unknown"
    if not host:
        return "unknown"
    host = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{host}" + (f":{port}" if port else "")


class _LockSeries:
    """The children of one lock's (or one task's) series, bound once: an event costs no label lookup."""

    __slots__ = ("acquired", "held", "hold", "labels", "metrics", "others", "wait")

    def __init__(self, metrics: _Metrics, labels: tuple[str, str, str]) -> None:
        self.metrics = metrics
        self.labels = labels
        self.acquired = metrics.acquisitions.labels(*labels, ACQUIRED)
        self.wait = metrics.wait.labels(*labels)
        self.hold = metrics.hold.labels(*labels)
        self.held = metrics.held.labels(*labels)
        self.others: dict[tuple[str, str], Any] = {}  # the rare ones, bound on first use

    def outcome(self, outcome: str) -> Any:
        child = self.others.get(("outcome", outcome))
        if child is None:
            child = self.others[("outcome", outcome)] = self.metrics.acquisitions.labels(*self.labels, outcome)
        return child

    def lost(self, cause: str) -> Any:
        child = self.others.get(("cause", cause))
        if child is None:
            child = self.others[("cause", cause)] = self.metrics.lost.labels(*self.labels, cause)
        return child


class _Metrics:
    """The metric objects, and what each kind of event does to them."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        def counter(name: str, documentation: str, labels: tuple[str, ...]) -> Any:
            return Counter(PREFIX + name, documentation, labels, registry=None)

        self.acquisitions = counter(
            "acquisitions",
            "Lock acquisitions by outcome: acquired, timed_out (waited and gave up), refused (found it held and did "
            "not wait), skipped (a task run skipped: on_conflict='skip')",
            (*LOCK_LABELS, "outcome"),
        )
        self.wait = Histogram(
            PREFIX + "wait_seconds", "Seconds an acquire waited for the lock it got", LOCK_LABELS,
            buckets=BUCKETS, registry=None,
        )  # fmt: skip
        self.hold = Histogram(
            PREFIX + "hold_seconds", "Seconds a lock was held, until released or lost", LOCK_LABELS,
            buckets=BUCKETS, registry=None,
        )  # fmt: skip
        self.held = Gauge(
            PREFIX + "locks_held", "Locks held now by this process (multiprocess: by the live processes)",
            LOCK_LABELS, multiprocess_mode="livesum", registry=None,
        )  # fmt: skip
        self.lost = counter(
            "locks_lost",
            "Locks lost while held, by cause: deleted (force-released), late (no renewal in time), revoked (lease "
            "revoked or expired on the server), closed (client closed)",
            (*LOCK_LABELS, "cause"),
        )
        self.task_conflicts = counter(
            "task_conflicts", "Task runs that found their lock held, by on_conflict mode", ("task", "on_conflict")
        )
        self.leader = Gauge(
            PREFIX + "leader", "1 while this process leads the election (multiprocess: while one live process does)",
            ("election",), multiprocess_mode="livemax", registry=None,
        )  # fmt: skip
        self.leadership_changes = counter(
            "leadership_changes",
            "Leadership changes of this process: elected, deposed (lost it), resigned",
            ("election", "change"),
        )
        self.beat_sent = counter("beat_runs_sent", "Periodic task runs sent by the beat leader", ("beat", "entry"))
        self.etcd_retries = counter("etcd_retries", "etcd requests that failed transiently and were retried",
                                    ("endpoint",))  # fmt: skip
        self.etcd_failures = counter(
            "etcd_failures", "etcd operations that gave up (the caller got BackendUnavailable)", ("endpoint",)
        )
        self.collectors = [
            self.acquisitions, self.wait, self.hold, self.held, self.lost, self.task_conflicts, self.leader,
            self.leadership_changes, self.beat_sent, self.etcd_retries, self.etcd_failures,
        ]  # fmt: skip
        self._series: dict[tuple[str, str, str], _LockSeries] = {}
        self._series_lock = threading.Lock()
        self._handlers = {
            observe.ACQUIRED: self._acquired,
            observe.RELEASED: self._released,
            observe.LOST: self._lost,
            observe.CONFLICT: self._conflict,
            observe.TIMED_OUT: self._timed_out,
            observe.TASK_CONFLICT: self._task_conflict,
            observe.ELECTED: self._elected,
            observe.DEPOSED: self._deposed,
            observe.RESIGNED: self._resigned,
            observe.STANDBY: self._standby,
            observe.BEAT_SENT: self._beat_sent,
            observe.RETRY: self._retry,
            observe.FAILED: self._failed,
        }

    def __call__(self, event: observe.Event) -> None:
        handler = self._handlers.get(event.kind)
        if handler is not None:
            handler(event)

    def _series_of(self, event: observe.Event) -> _LockSeries:
        task = event.data.get("task")
        labels = (event.lock_kind, task, task) if task else (event.lock_kind, event.name, "")
        series = self._series.get(labels)
        if series is None:
            with self._series_lock:
                series = self._series.get(labels)
                if series is None:
                    series = self._series[labels] = _LockSeries(self, labels)
        return series

    # -- locks --------------------------------------------------------------------------------

    def _acquired(self, event: observe.Event) -> None:
        series = self._series_of(event)
        series.acquired.inc()
        series.held.inc()
        if event.seconds is not None:
            series.wait.observe(event.seconds)

    def _released(self, event: observe.Event) -> None:
        series = self._series_of(event)
        series.held.dec()
        if event.seconds is not None:
            series.hold.observe(event.seconds)

    def _lost(self, event: observe.Event) -> None:
        series = self._series_of(event)
        series.held.dec()
        series.lost(event.cause or "unknown").inc()
        if event.seconds is not None:
            series.hold.observe(event.seconds)

    def _conflict(self, event: observe.Event) -> None:
        # a task's conflict is counted once, by what the task does about it (_task_conflict)
        if not event.blocking and not event.data.get("task"):
            self._series_of(event).outcome(REFUSED).inc()

    def _timed_out(self, event: observe.Event) -> None:
        self._series_of(event).outcome(TIMED_OUT).inc()

    def _task_conflict(self, event: observe.Event) -> None:
        on_conflict = str(event.data.get("on_conflict"))
        self.task_conflicts.labels(event.data.get("task") or "", on_conflict).inc()
        outcome = _TASK_OUTCOMES.get(on_conflict)
        if outcome is not None:
            self._series_of(event).outcome(outcome).inc()

    # -- elections and the beat ------------------------------------------------------------------

    def _elected(self, event: observe.Event) -> None:
        self.leader.labels(event.name).set(1)
        self.leadership_changes.labels(event.name, "elected").inc()

    def _deposed(self, event: observe.Event) -> None:
        self.leader.labels(event.name).set(0)
        self.leadership_changes.labels(event.name, "deposed").inc()

    def _resigned(self, event: observe.Event) -> None:
        self.leader.labels(event.name).set(0)
        self.leadership_changes.labels(event.name, "resigned").inc()

    def _standby(self, event: observe.Event) -> None:
        # the series appears at 0 (a standby beat is not "no beat"); never set(0): an elected report may have raced it
        self.leader.labels(event.name)

    def _beat_sent(self, event: observe.Event) -> None:
        self.beat_sent.labels(event.name, str(event.data.get("entry", ""))).inc()

    # -- etcd ------------------------------------------------------------------------------------

    def _retry(self, event: observe.Event) -> None:
        self.etcd_retries.labels(_endpoint_label(event.endpoint)).inc()

    def _failed(self, event: observe.Event) -> None:
        self.etcd_failures.labels(_endpoint_label(event.endpoint)).inc()


_metrics: _Metrics | None = None
_registry: CollectorRegistry | None = None
_enabling = threading.Lock()
_exit_hook = {"registered": False}


def enable(registry: CollectorRegistry | None = None) -> None:
    """Keep the metrics from now on, registered on ``registry`` (None: prometheus_client's ``REGISTRY``).

    Called again with another registry, it moves them there (their values kept); with
    the same one, it does nothing. ``ImportError`` if prometheus_client is not installed.
    """
    global _metrics, _registry
    try:
        import prometheus_client
    except ImportError as exc:
        raise ImportError(
            "celery_etcdlock metrics need prometheus_client: pip install 'celery-etcdlock[metrics]'"
        ) from exc
    target = prometheus_client.REGISTRY if registry is None else registry
    if not callable(getattr(target, "register", None)):
        raise TypeError(f"registry must be a prometheus_client CollectorRegistry, not {type(target).__name__}")
    with _enabling:
        if _metrics is not None and _registry is target:
            return
        _check_multiprocess_dir()
        metrics = _metrics or _Metrics()
        if _registry is not None:
            _unregister(metrics, _registry)
        try:
            for collector in metrics.collectors:
                target.register(collector)
        except ValueError as exc:  # another copy of these metrics is registered there already
            _unregister(metrics, target)
            if _registry is not None:  # a move that failed: they stay where they were
                for collector in metrics.collectors:
                    _registry.register(collector)
            raise ValueError(f"celery_etcdlock metrics cannot be registered: {exc}") from None
        _metrics, _registry = metrics, target
        observe.subscribe(metrics)
        if multiprocess_dir() is not None and not _exit_hook["registered"]:
            atexit.register(mark_this_process_dead)
            _exit_hook["registered"] = True


def disable() -> None:
    """Stop keeping the metrics and unregister them; their values are dropped."""
    global _metrics, _registry
    with _enabling:
        metrics, registry = _metrics, _registry
        _metrics = _registry = None
        if metrics is not None:
            observe.unsubscribe(metrics)
            if registry is not None:
                _unregister(metrics, registry)


def enabled() -> bool:
    return _metrics is not None


def _unregister(metrics: _Metrics, registry: CollectorRegistry) -> None:
    for collector in metrics.collectors:
        with contextlib.suppress(KeyError):
            registry.unregister(collector)


# -- Prometheus multiprocess mode ----------------------------------------------------------------


def multiprocess_dir() -> str | None:
    """The directory of Prometheus multiprocess mode, if this process is in it."""
    legacy = "prometheus_multiproc_dir"  # prometheus_client still reads the old lower-case name
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get(legacy) or None


def _check_multiprocess_dir() -> None:
    from prometheus_client import values

    directory = multiprocess_dir()
    in_mode = bool(getattr(values.ValueClass, "_multiprocess", False))
    if directory is not None and not in_mode:
        logger.warning(
            "PROMETHEUS_MULTIPROC_DIR is set, but was not when prometheus_client was imported: the metrics of "
            "this process are kept in memory only; set it before the process starts"
        )
    if directory is not None and in_mode and not os.path.isdir(directory):
        raise ValueError(
            f"PROMETHEUS_MULTIPROC_DIR={directory!r} is not a directory: create it before the process starts"
        )


_PID_OF_LIVE_FILE = re.compile(r"^gauge_live[a-z]+_(\d+)\.db$")


def mark_this_process_dead() -> None:
    """Multiprocess mode: this process is exiting, so its live gauges (locks held, leader) stop counting."""
    directory = multiprocess_dir()
    if _metrics is None or directory is None:
        return
    from prometheus_client import multiprocess

    with contextlib.suppress(OSError):
        multiprocess.mark_process_dead(os.getpid(), directory)


def forget_dead_processes() -> list[int]:
    """Multiprocess mode: drop the live gauges of processes that died without saying so (SIGKILL, time limit).

    A pid is dead if no process of this host has it; the directory must be this host's
    (or container's) own. Returns the pids forgotten.
    """
    directory = multiprocess_dir()
    if _metrics is None or directory is None:
        return []
    from prometheus_client import multiprocess

    dead = set()
    for path in glob.glob(os.path.join(directory, "gauge_live*_*.db")):
        match = _PID_OF_LIVE_FILE.match(os.path.basename(path))
        if match and not _alive(int(match.group(1))):
            dead.add(int(match.group(1)))
    for pid in dead:
        with contextlib.suppress(OSError):
            multiprocess.mark_process_dead(pid, directory)
    return sorted(dead)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True
