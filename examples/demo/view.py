"""The demo's live view: who leads beat, which lock is held where, tokens rising, doubles.

It reads only what a user could: etcd through ``celery_etcdlock.cli``'s
functions (the same as ``celery -A examples.shop etcdlock locks`` / ``leader``)
and the shop's run log in Redis (``examples.shop.runlog``). Run it against
any running shop, e.g. the docker-compose stack::

    python -m examples.demo.view          # settings from the environment, as the shop's

A *double* is what the locks exist to prevent, found from the run log:
two runs of one singleton key at the same time, a writer of ``search-index``
overlapping any other run of it, a later holder with a smaller fencing token,
or one beat schedule entry sent twice for one due time.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from celery_etcdlock.cli import ElectionState, LockState, list_elections, list_locks
from celery_etcdlock.settings import client_for
from examples.shop import app, runlog

CLEAR = "\x1b[H\x1b[2J"


@dataclass
class Run:
    id: str
    task: str
    key: str | None
    lock: str | None
    mode: str
    token: int | None
    worker: str
    pid: int
    ppid: int
    start: float
    end: float | None
    held_to_end: bool | None = None

    @classmethod
    def from_json(cls, text: str | bytes) -> Run:
        data = json.loads(text)
        return cls(**{name: data.get(name) for name in cls.__dataclass_fields__})

    @property
    def short_task(self) -> str:
        return self.task.removeprefix("shop.")

    @property
    def short_worker(self) -> str:
        return self.worker.split("@", 1)[0] if self.worker else "?"


@dataclass
class Observation:
    """One poll of etcd and the run log."""

    time: float
    elections: list[ElectionState] = field(default_factory=list)
    locks: list[LockState] = field(default_factory=list)
    runs: list[Run] = field(default_factory=list)
    skips: dict[str, int] = field(default_factory=dict)
    sends: list[dict[str, Any]] = field(default_factory=list)
    procs: dict[int, dict[str, Any]] = field(default_factory=dict)
    error: str | None = None

    @property
    def beat(self) -> ElectionState | None:
        for election in self.elections:
            if election.name.startswith("beat/"):
                return election
        return None

    def name_of(self, identity: str | None) -> str:
        """The demo's name ("beat-1") for an election identity ("host:pid")."""
        if not identity:
            return "-"
        pid = pid_of(identity)
        proc = self.procs.get(pid) if pid is not None else None
        return str(proc["name"]) if proc else identity


def pid_of(identity: str) -> int | None:
    match = re.search(r":(\d+)$", identity)
    return int(match.group(1)) if match else None


class Observer:
    """Polls the state of a running shop."""

    def __init__(self) -> None:
        self.client = client_for(app)
        self.redis = runlog.connection()

    def poll(self) -> Observation:
        observation = Observation(time.time())
        try:
            observation.elections = list_elections(self.client)
            observation.locks = list_locks(self.client)
        except Exception as exc:  # etcd down for a moment: show it, keep polling
            observation.error = f"etcd: {exc}"
        try:
            observation.runs = [Run.from_json(v) for v in self.redis.hvals(runlog.RUNS)]
            observation.skips = {_text(k): int(v) for k, v in self.redis.hgetall(runlog.SKIPS).items()}
            observation.sends = [json.loads(v) for v in self.redis.lrange(runlog.SENDS, 0, -1)]
            observation.procs = {int(k): json.loads(v) for k, v in self.redis.hgetall(runlog.PROCS).items()}
        except Exception as exc:
            observation.error = f"redis: {exc}"
        return observation


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


# -- doubles ------------------------------------------------------------------------------------


@dataclass
class Doubles:
    overlaps: list[tuple[Run, Run]] = field(default_factory=list)  # two runs that must not overlap did
    token_order: list[tuple[Run, Run]] = field(default_factory=list)  # a later holder got a smaller token
    double_sends: list[tuple[dict[str, Any], dict[str, Any]]] = field(default_factory=list)

    @property
    def total(self) -> int:
        return len(self.overlaps) + len(self.token_order) + len(self.double_sends)

    def describe(self) -> str:
        return (
            f"{self.total}  (overlapping runs {len(self.overlaps)}, tokens out of order {len(self.token_order)},"
            f" beat sends twice {len(self.double_sends)})"
        )


def run_end(run: Run, died: dict[int, float], now: float, holding: set[str]) -> float | None:
    """When a run's body ended: as recorded, else when its process was killed, else now if it
    still holds its lock. None (not judged) for a run that vanished without our knowing when.
    """
    if run.end is not None:
        return run.end
    if run.pid in died:
        return died[run.pid]
    if run.id in holding:
        return now
    return None


def schedule_intervals() -> dict[tuple[str, str], float]:
    """(task, repr(args)) -> seconds between runs, from the shop's beat schedule."""
    intervals = {}
    for entry in app.conf.beat_schedule.values():
        schedule = entry["schedule"]
        seconds = schedule.total_seconds() if hasattr(schedule, "total_seconds") else float(schedule)
        intervals[(entry["task"], repr(tuple(entry.get("args", ()))))] = seconds
    return intervals


def find_doubles(
    runs: Iterable[Run],
    sends: Iterable[dict[str, Any]],
    died: dict[int, float],
    now: float,
    locks: Iterable[LockState] = (),
) -> Doubles:
    """The doubles in a run log; ``died`` maps killed pids to when, ``locks`` are the locks held now."""
    holding = {h.task_id for lock in locks for h in lock.holders if h.task_id}
    doubles = Doubles()
    by_lock: dict[str, list[tuple[Run, float, float]]] = defaultdict(list)
    for run in runs:
        end = run_end(run, died, now, holding)
        if run.lock is not None and end is not None:
            by_lock[run.lock].append((run, run.start, end))
    for held in by_lock.values():
        held.sort(key=lambda item: item[1])
        for i, (a, _a_start, a_end) in enumerate(held):
            for b, b_start, _b_end in held[i + 1 :]:
                if b_start >= a_end:
                    # b began after a ended: whoever wrote, b's token must be larger
                    if "write" in (a.mode, b.mode) and None not in (a.token, b.token) and b.token <= a.token:  # type: ignore[operator]
                        doubles.token_order.append((a, b))
                    continue
                if "write" in (a.mode, b.mode):
                    doubles.overlaps.append((a, b))
    intervals = schedule_intervals()
    by_entry: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for send in sends:
        by_entry[(str(send.get("task")), str(send.get("args")))].append(send)
    for entry, entry_sends in by_entry.items():
        interval = intervals.get(entry)
        if interval is None:
            continue
        entry_sends.sort(key=lambda s: s["time"])
        for first, second in zip(entry_sends, entry_sends[1:], strict=False):
            if second["time"] - first["time"] < interval / 2:
                doubles.double_sends.append((first, second))
    return doubles


# -- events -------------------------------------------------------------------------------------


class Events:
    """What happened, with times relative to the start of the demo."""

    def __init__(self, started: float, echo: bool = False) -> None:
        self.started = started
        self.echo = echo  # print each event as it happens (when the screen is not redrawn)
        self._events: list[tuple[float, int, str]] = []
        self._leader: str | None = None

    def add(self, text: str, at: float | None = None) -> None:
        at = at if at is not None else time.time()
        self._events.append((at, len(self._events), text))
        if self.echo:
            print(self._line(at, text), flush=True)

    @property
    def lines(self) -> list[str]:
        """Every event so far, in the order they happened."""
        return [self._line(at, text) for at, _, text in sorted(self._events)]

    def _line(self, at: float, text: str) -> str:
        return f"{at - self.started:6.1f}s  {text}"

    def observe(self, observation: Observation) -> str | None:
        """Note a change of beat leader; returns the new leader's name when it changed."""
        beat = observation.beat
        leader = beat.leader.holder if beat is not None and beat.leader is not None else None
        if leader == self._leader:
            return None
        self._leader = leader
        if leader is None:
            self.add("no beat leader", observation.time)
            return None
        assert beat is not None and beat.leader is not None
        name = observation.name_of(leader)
        self.add(f"{name} leads beat (identity {leader}, token {beat.leader.token})", observation.time)
        return name


# -- rendering ----------------------------------------------------------------------------------


def render(
    observation: Observation,
    events: Events,
    doubles: Doubles,
    title: str,
    died: dict[int, float],
    with_events: bool = True,
) -> str:
    now = observation.time
    lines = [f"{title}   t={now - events.started:5.1f}s   {time.strftime('%H:%M:%S', time.localtime(now))}", ""]

    beat = observation.beat
    if beat is None or beat.leader is None:
        lines.append("BEAT     no leader yet")
    else:
        standby = ", ".join(observation.name_of(c.holder) for c in beat.candidates) or "none"
        lines.append(
            f"BEAT     leader {observation.name_of(beat.leader.holder)} (token {beat.leader.token})"
            f"   standby: {standby}"
        )
    sends = Counter(s["beat"] for s in observation.sends)
    lines.append("         sends so far: " + (", ".join(f"{b} {n}" for b, n in sorted(sends.items())) or "none"))

    workers = Counter(r.short_worker for r in observation.runs)
    lines.append("WORKERS  runs so far: " + (", ".join(f"{w} {n}" for w, n in sorted(workers.items())) or "none"))
    lines.append("")

    lines.append(f"{'LOCK HELD NOW':<38} {'MODE':<6} {'TOKEN':>6}  {'WORKER':<10} {'TASK':<22} WAITING")
    if not observation.locks:
        lines.append("  (none)")
    for lock in observation.locks:
        for i, holder in enumerate(lock.holders):
            worker = (holder.host or holder.holder or "?").split("@", 1)[0]
            task = (holder.task or "").removeprefix("shop.")
            alive = _holder_alive(observation, holder.task_id, died)
            lines.append(
                f"{lock.name if i == 0 else '':<38} {holder.mode:<6} {holder.token:>6}  {worker:<10}"
                f" {task + ('' if alive else ' (dead)'):<22} {len(lock.waiters) if i == 0 else ''}"
            )
    lines.append("")

    lines.append(f"{'TASK':<22} {'RUNS':>5} {'SKIPPED':>8} {'RUNNING':>8}   TOKENS (latest, rising per lock)")
    tasks = sorted({r.task for r in observation.runs} | set(observation.skips))
    for task in tasks:
        runs = [r for r in observation.runs if r.task == task]
        running = [r for r in runs if r.end is None and r.pid not in died]
        lines.append(
            f"{task.removeprefix('shop.'):<22} {len(runs):>5} {observation.skips.get(task, 0):>8} {len(running):>8}"
            f"   {_token_trail(runs)}"
        )
    lines.append("")
    lines.append("DOUBLES  " + doubles.describe())
    if observation.error:
        lines.append(f"(reading state: {observation.error})")
    if with_events:
        lines.append("")
        lines.append("EVENTS")
        lines.extend("  " + line for line in events.lines[-10:])
    return "\n".join(lines)


def _holder_alive(observation: Observation, task_id: str | None, died: dict[int, float]) -> bool:
    for run in observation.runs:
        if run.id == task_id:
            return run.pid not in died
    return True


def _token_trail(runs: list[Run]) -> str:
    by_lock: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        if run.lock is not None and run.token is not None:
            by_lock[run.lock].append(run)
    parts = []
    for _lock, held in sorted(by_lock.items()):
        if all(r.mode == "read" for r in held):  # readers share the lock: their order is arrival, not start
            trail = ", ".join(str(r.token) for r in sorted(held, key=lambda r: r.token or 0)[-3:])
        else:  # one holder after another: each token larger than the one before
            trail = " < ".join(str(r.token) for r in sorted(held, key=lambda r: r.start)[-3:])
        label = f"#{held[0].key} " if len(by_lock) > 1 else ""
        parts.append(label + trail)
    return "   ".join(parts)


def main() -> None:
    """Follow a running shop until Ctrl-C (no kills, nothing written)."""
    observer = Observer()
    events = Events(time.time(), echo=not sys.stdout.isatty())
    try:
        while True:
            observation = observer.poll()
            events.observe(observation)
            doubles = find_doubles(observation.runs, observation.sends, {}, observation.time, observation.locks)
            if sys.stdout.isatty():
                screen = render(observation, events, doubles, "celery_etcdlock shop", {})
                sys.stdout.write(CLEAR + screen + "\n")
                sys.stdout.flush()
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
