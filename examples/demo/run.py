"""The demo: the shop on etcd, Redis, 3 workers and 2 beats; kill the leading beat and a busy worker.

    python -m examples.demo                    # about a minute (./scripts/demo sets things up first)
    python -m examples.demo --quick            # the short run CI does (SHOP_DEMO_QUICK=1 too)
    python -m examples.demo --etcd-members 3   # a 3-member etcd cluster, whose raft leader is killed too

It starts the stack (``examples.demo.stack``), shows the live view
(``examples.demo.view``), SIGKILLs the beat leader midway and then a worker in
the middle of a singleton task, shows the fail-over and the lock recovery,
stops everything and prints a summary: runs per task, doubles (0), fail-over
and recovery times, what the workers' and beats' Prometheus metrics say,
processes left behind (0). With 3 etcd members it also SIGKILLs the raft
leader of etcd (it comes back 10 s later, as systemd would restart it) and
shows that the locks and the beat kept going meanwhile. Exit status 0 when all
of that went as it should. Ctrl-C stops everything cleanly.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import metrics
from .stack import ETCD_RESTART_DELAY, LocalStack, StackError, children_of, kill


@dataclass(frozen=True)
class Plan:
    duration: float  # seconds from "ready" to the end
    kill_beat_at: float
    kill_worker_at: float
    frame_every: float  # how often a frame is printed when stdout is not a terminal
    beat_ttl: float
    kill_etcd_at: float  # with 3 etcd members: when the raft leader of etcd is killed (once the lock recovered)
    watch_after_etcd_kill: float  # the run goes on at least this long after that kill

    @classmethod
    def full(cls) -> Plan:
        return cls(
            duration=60,
            kill_beat_at=18,
            kill_worker_at=32,
            frame_every=10,
            beat_ttl=5,
            kill_etcd_at=44,
            watch_after_etcd_kill=16,
        )

    @classmethod
    def quick(cls) -> Plan:
        return cls(
            duration=34,
            kill_beat_at=7,
            kill_worker_at=15,
            frame_every=8,
            beat_ttl=3,
            kill_etcd_at=22,
            watch_after_etcd_kill=12,
        )


TARGETS = ("shop.nightly_report", "shop.sync_customer")  # singletons whose worker the demo kills mid-run
MIN_LEFT = 2.0  # kill only a run that has at least this long to go (seconds, by its expected length)
EXPECTED = {"shop.nightly_report": 6.0, "shop.sync_customer": 1.0}  # the shortest run of each


class Interrupted(Exception):
    """SIGTERM: stop like Ctrl-C does."""


def _raise_interrupted(signum: int, frame: Any) -> None:
    raise Interrupted


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m examples.demo", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        default=os.environ.get("SHOP_DEMO_QUICK") == "1",
        help="the short run (about 35 s after start-up) that CI does",
    )
    parser.add_argument("--duration", type=float, help="seconds to run once the stack is up")
    parser.add_argument(
        "--api",
        choices=("v2", "v3"),
        default=os.environ.get("SHOP_DEMO_API", "v3"),
        help="etcd API: v3 (etcd3://, the default) or v2 (etcd://)",
    )
    parser.add_argument("--etcd-members", type=int, default=1, choices=(1, 3), help="etcd cluster size")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (logs, Procfile) afterwards")
    parser.add_argument("--summary-json", type=Path, help="also write the summary to this file, as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = Plan.quick() if args.quick else Plan.full()
    if args.duration:
        plan = dataclasses.replace(plan, duration=args.duration)
    root = Path(tempfile.mkdtemp(prefix="shop-demo-"))
    try:
        stack = LocalStack(root, etcd_members=args.etcd_members, api=args.api, beat_ttl=plan.beat_ttl)
    except StackError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 2
    os.environ.update(stack.env)  # before examples.shop reads its settings
    signal.signal(signal.SIGTERM, _raise_interrupted)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with SIGINT ignored
    demo = Demo(stack, plan, quick=args.quick)
    ok = False
    try:
        ok = demo.run()
    except (KeyboardInterrupt, Interrupted):
        demo.interrupted = True
    except StackError as exc:
        demo.failure = str(exc)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        summary = demo.finish()
        signal.signal(signal.SIGINT, signal.default_int_handler)
    print(demo.summary_text(summary), flush=True)
    if args.summary_json:
        args.summary_json.write_text(json.dumps(summary, indent=2))
    if args.keep or (not ok and not demo.interrupted):
        print(f"logs and Procfile kept in {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    if demo.interrupted:
        return 130
    return 0 if ok and summary["ok"] else 1


class Demo:
    def __init__(self, stack: LocalStack, plan: Plan, quick: bool) -> None:
        from .view import Events, Observation, Observer

        self.stack = stack
        self.plan = plan
        self.quick = quick
        self.tty = sys.stdout.isatty()
        self.events = Events(time.time(), echo=not self.tty)
        self.Observer = Observer
        self.last: Observation | None = None
        self.died: dict[int, float] = {}  # pid -> when the demo killed it
        self.interrupted = False
        self.failure: str | None = None
        self.ready_at: float | None = None
        self.failover: dict[str, Any] | None = None
        self.recovery: dict[str, Any] | None = None
        self.etcd_kill: dict[str, Any] | None = None  # with 3 etcd members: the member killed, and what followed
        self.known_procs: set[int] = set()
        self.title = (
            f"celery_etcdlock demo{' (quick)' if quick else ''}: {len(stack.etcd_members)} etcd"
            f" ({stack.env['ETCDLOCK_URL'].split(':')[0]}://), redis, {len(stack.workers)} workers,"
            f" {len(stack.beats)} beats"
        )

    # -- the scenario -----------------------------------------------------------------------------

    def run(self) -> bool:
        env = self.stack.env
        print(
            f"{self.title}\nstarting the stack (Procfile and logs in {self.stack.root}) ...\n"
            f"to look at its locks from another terminal, in this directory:\n"
            f"  ETCDLOCK_URL={env['ETCDLOCK_URL']} SHOP_BROKER_URL={env['SHOP_BROKER_URL']} "
            f".venv/bin/celery -A examples.shop etcdlock locks --watch 1",
            flush=True,
        )
        self.stack.start()
        self.stack.wait_servers(60)
        observer = self.Observer()
        self._wait_ready(observer, 120)
        self.ready_at = self.last.time if self.last is not None else time.time()
        self.events.started = self.ready_at
        self.events.add("stack ready: every worker and beat is up")
        if self.last is not None:
            self.known_procs.update(self.last.procs)
            self.events.observe(self.last)
        end = self.ready_at + self.plan.duration
        next_frame = 0.0
        while time.time() < end:
            self.stack.check_running()
            observation = self._poll(observer)
            elapsed = observation.time - self.ready_at
            if self.failover is None and elapsed >= self.plan.kill_beat_at:
                self._kill_leader(observation)
            elif self.failover is not None and "new_leader" not in self.failover:
                self._check_failover(observation)
            if self.recovery is None and elapsed >= self.plan.kill_worker_at:
                self._kill_busy_worker(observation)
            elif self.recovery is not None and not self.recovered:
                self._check_recovery(observation)
            if len(self.stack.etcd_members) > 1:
                if self.etcd_kill is None and self._time_to_kill_etcd(elapsed):
                    self._kill_etcd_leader()
                    if self.etcd_kill is not None:
                        end = max(end, self.etcd_kill["at"] + self.plan.watch_after_etcd_kill)
                elif self.etcd_kill is not None and "new_leader" not in self.etcd_kill:
                    self._check_etcd_failover()
            if self.tty:
                self._draw(observation)
            elif time.monotonic() >= next_frame:
                next_frame = time.monotonic() + self.plan.frame_every
                self._draw(observation)
            time.sleep(0.25)
        return True

    def _wait_ready(self, observer: Any, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.stack.check_running()
            observation = self._poll(observer)
            roles = [p["role"] for p in observation.procs.values()]
            beat = observation.beat
            if (
                roles.count("worker") >= len(self.stack.workers)
                and roles.count("beat") >= len(self.stack.beats)
                and beat is not None
                and beat.leader is not None
                and beat.candidates
            ):
                return
            time.sleep(0.5)
        raise StackError(f"the workers and beats did not all come up within {timeout:.0f}s\n{self.stack.log_tail()}")

    def _poll(self, observer: Any) -> Any:
        observation = observer.poll()
        self.last = observation
        for pid, proc in sorted(observation.procs.items(), key=lambda item: item[1]["start"]):
            if pid not in self.known_procs:
                self.known_procs.add(pid)
                if self.ready_at is not None:
                    self.events.add(f"{proc['name'].split('@', 1)[0]} restarted, pid {pid}", proc["start"])
        if self.ready_at is not None:
            self.events.observe(observation)
        return observation

    def _kill_leader(self, observation: Any) -> None:
        beat = observation.beat
        if beat is None or beat.leader is None:
            return
        from .view import pid_of

        pid = pid_of(beat.leader.holder or "")
        if pid is None or pid not in observation.procs:
            return
        name = observation.name_of(beat.leader.holder)
        at = time.time()
        if not kill([pid]):
            return
        self.died[pid] = at
        self.failover = {"killed": name, "pid": pid, "at": at, "token_before": beat.leader.token}
        self.events.add(f"KILL -9 {name} (the beat leader, pid {pid})", at)

    def _check_failover(self, observation: Any) -> None:
        assert self.failover is not None
        beat = observation.beat
        if beat is None or beat.leader is None or beat.leader.token == self.failover["token_before"]:
            return
        name = observation.name_of(beat.leader.holder)
        # when the new leader was seen, or sent its first task if that came before the next poll
        first_send = min(
            (s["time"] for s in observation.sends if s["time"] > self.failover["at"] and s["beat"] == name),
            default=observation.time,
        )
        at = min(observation.time, first_send)
        seconds = at - self.failover["at"]
        self.failover.update(new_leader=name, seconds=round(seconds, 1), token_after=beat.leader.token)
        self.events.add(
            f"FAIL-OVER: {name} leads, {seconds:.1f}s after the kill (token {beat.leader.token} >"
            f" {self.failover['token_before']}; etcdlock_beat_ttl {self.plan.beat_ttl:g}s)",
            at,
        )

    def _kill_busy_worker(self, observation: Any) -> None:
        now = observation.time
        busy = [
            r for r in observation.runs
            if r.task in TARGETS and r.end is None and r.pid not in self.died and r.lock
            and now - r.start < EXPECTED[r.task] - MIN_LEFT
        ]  # fmt: skip
        if not busy:
            return
        run = sorted(busy, key=lambda r: TARGETS.index(r.task))[0]
        pool = children_of(run.ppid)
        at = time.time()
        killed = kill([run.ppid, *pool])
        if not killed:
            return
        for pid in killed:
            self.died[pid] = at
        worker = run.short_worker
        self.recovery = {"worker": worker, "task": run.task, "lock": run.lock, "token_before": run.token, "at": at}
        self.events.add(
            f"KILL -9 {worker} (pid {run.ppid} and its {len(pool)} pool processes) in the middle of"
            f" {run.short_task}, which holds {run.lock} with token {run.token}",
            at,
        )

    def _check_recovery(self, observation: Any) -> None:
        assert self.recovery is not None
        later = [
            r for r in observation.runs
            if r.lock == self.recovery["lock"] and r.token is not None and r.token > self.recovery["token_before"]
        ]  # fmt: skip
        if not later:
            return
        run = min(later, key=lambda r: r.start)
        seconds = run.start - self.recovery["at"]
        self.recovery.update(token_after=run.token, seconds=round(seconds, 1), new_worker=run.short_worker)
        self.events.add(
            f"LOCK RECOVERED: {run.short_worker} runs {run.short_task} with token {run.token} >"
            f" {self.recovery['token_before']}, {seconds:.1f}s after the kill (the dead worker's lock expired)",
            run.start,
        )

    @property
    def recovered(self) -> bool:
        """The killed worker's lock was taken again, with a higher token."""
        return self.recovery is not None and "token_after" in self.recovery

    def _time_to_kill_etcd(self, elapsed: float) -> bool:
        """Past kill_etcd_at, and the killed worker's lock has recovered (or is 10 s late).

        A new raft leader renews every lease it takes over, so a kill before the dead worker's lock
        expired would postpone that recovery past the end of a quick run.
        """
        if elapsed < self.plan.kill_etcd_at:
            return False
        return self.recovered or elapsed >= self.plan.kill_etcd_at + 10

    def _kill_etcd_leader(self) -> None:
        leader = self.stack.etcd_leader()
        pid = self.stack.etcd_pid(leader) if leader is not None else None
        if leader is None or pid is None:
            return
        at = time.time()
        if not kill([pid]):
            return
        self.etcd_kill = {"member": leader, "pid": pid, "at": at}
        self.events.add(
            f"KILL -9 {leader} (the raft leader of the 3 etcd members, pid {pid}); it is restarted"
            f" {ETCD_RESTART_DELAY} s later",
            at,
        )

    def _check_etcd_failover(self) -> None:
        assert self.etcd_kill is not None
        leader = self.stack.etcd_leader()
        if leader is None or leader == self.etcd_kill["member"]:
            return
        seconds = time.time() - self.etcd_kill["at"]
        self.etcd_kill.update(new_leader=leader, seconds=round(seconds, 1))
        self.events.add(f"ETCD: {leader} leads the 2 members left, {seconds:.1f}s after the kill")

    def _etcd_summary(self, observation: Any, stopped_at: float) -> dict[str, Any] | None:
        """What the lock service did after the etcd member was killed: runs, sends, and for how long."""
        if self.etcd_kill is None or observation is None:
            return self.etcd_kill
        at = self.etcd_kill["at"]
        return {
            **self.etcd_kill,
            "runs_after": len([r for r in observation.runs if r.start >= at]),
            "sends_after": len([s for s in observation.sends if s["time"] >= at]),
            "watched": round(stopped_at - at, 1),
        }

    def _draw(self, observation: Any) -> None:
        from .view import CLEAR, find_doubles, render

        doubles = find_doubles(observation.runs, observation.sends, self.died, observation.time, observation.locks)
        screen = render(observation, self.events, doubles, self.title, self.died, with_events=self.tty)
        if self.tty:
            sys.stdout.write(CLEAR + screen + "\n(Ctrl-C stops everything)\n")
        else:
            sys.stdout.write("\n".join(["", "-" * 100, screen, "-" * 100, ""]))
        sys.stdout.flush()

    # -- the end ------------------------------------------------------------------------------------

    def finish(self) -> dict[str, Any]:
        """A last look at the run log, then stop everything and check nothing is left."""
        from .view import find_doubles

        stopped_at = time.time()
        observation = None
        scraped = None
        if self.stack.honcho is not None:
            try:
                observation = self.Observer().poll()
            except Exception:  # the stack may be half-started; the summary says what it can
                observation = self.last
            names = self.stack.workers + self.stack.beats
            scraped = metrics.scrape({name: self.stack.metrics_url(name) for name in names})
        if self.tty and not self.interrupted:
            sys.stdout.write("\n")
        print("stopping every process ...", flush=True)
        self.stack.stop()
        left = self.stack.sweep()
        summary: dict[str, Any] = {
            "seconds": round(stopped_at - self.ready_at, 1) if self.ready_at else 0.0,
            "interrupted": self.interrupted,
            "failure": self.failure,
            "tasks": {},
            "sends": {},
            "failover": self.failover,
            "recovery": self.recovery,
            "etcd_kill": self._etcd_summary(observation, stopped_at),
            "processes_left": len(left),
            "metrics": metrics.summarise(scraped) if scraped else None,
        }
        doubles = None
        if observation is not None:
            for task in sorted({r.task for r in observation.runs} | set(observation.skips)):
                runs = [r for r in observation.runs if r.task == task]
                summary["tasks"][task] = {
                    "runs": len(runs),
                    "skipped": observation.skips.get(task, 0),
                    "workers": sorted({r.short_worker for r in runs}),
                }
            for send in observation.sends:
                summary["sends"][send["beat"]] = summary["sends"].get(send["beat"], 0) + 1
            doubles = find_doubles(observation.runs, observation.sends, self.died, stopped_at, observation.locks)
        summary["doubles"] = None if doubles is None else doubles.total
        summary["doubles_detail"] = (
            None
            if doubles is None
            else {
                "overlapping_runs": [[a.id, b.id] for a, b in doubles.overlaps],
                "tokens_out_of_order": [[a.id, b.id] for a, b in doubles.token_order],
                "beat_sends_twice": [[a, b] for a, b in doubles.double_sends],
            }
        )
        summary["problems"] = self._problems(summary, left)
        summary["ok"] = not summary["problems"]
        self._doubles_text = "-" if doubles is None else doubles.describe()
        return summary

    def _problems(self, summary: dict[str, Any], left: list[int]) -> list[str]:
        """What kept this run from being OK, each in a few words (empty: OK)."""
        checks = [
            (not self.failure, "the stack failed"),
            (summary["doubles"] == 0, "doubles seen"),
            (not left, "processes left behind"),
            (bool(self.failover and "new_leader" in self.failover), "no beat fail-over seen"),
            (self.recovered, "no lock recovery seen"),
            (len(summary["tasks"]) == 4 and all(t["runs"] > 0 for t in summary["tasks"].values()), "a task never ran"),
            (
                len(self.stack.etcd_members) == 1 or _kept_going(summary["etcd_kill"]),
                "no new raft leader, task run and beat send seen after the etcd kill",
            ),
        ]
        return [problem for passed, problem in checks if not passed]

    def summary_text(self, summary: dict[str, Any]) -> str:
        lines = ["", "=" * 100]
        state = "interrupted (Ctrl-C)" if self.interrupted else "failed" if self.failure else "done"
        lines.append(f"SUMMARY  {state} after {summary['seconds']:.0f}s   {self.title}")
        if self.failure:
            lines.append(f"  failure: {self.failure}")
        lines.append(f"  {'task':<22} {'runs':>5} {'skipped':>8}   workers")
        for task, counts in summary["tasks"].items():
            lines.append(
                f"  {task.removeprefix('shop.'):<22} {counts['runs']:>5} {counts['skipped']:>8}"
                f"   {', '.join(counts['workers'])}"
            )
        sends = summary["sends"]
        lines.append(
            f"  beat sends: {sum(sends.values())} ({', '.join(f'{b} {n}' for b, n in sorted(sends.items())) or 'none'})"
        )
        lines.append(f"  doubles: {self._doubles_text}")
        failover = summary["failover"]
        if failover and "new_leader" in failover:
            lines.append(
                f"  beat fail-over: {failover['killed']} killed -> {failover['new_leader']} leading after"
                f" {failover['seconds']:.1f}s (etcdlock_beat_ttl {self.plan.beat_ttl:g}s)"
            )
        else:
            lines.append("  beat fail-over: " + ("no new leader seen" if failover else "not reached"))
        recovery = summary["recovery"]
        if recovery and "token_after" in recovery:
            lines.append(
                f"  lock recovery: {recovery['worker']} killed mid {recovery['task'].removeprefix('shop.')} (token"
                f" {recovery['token_before']}) -> {recovery['new_worker']} ran it with token {recovery['token_after']}"
                f" {recovery['seconds']:.1f}s later"
            )
        else:
            lines.append("  lock recovery: " + ("not seen" if recovery else "not reached"))
        etcd_kill = summary["etcd_kill"]
        if len(self.stack.etcd_members) > 1:
            if etcd_kill and "new_leader" in etcd_kill:
                lines.append(
                    f"  etcd member killed: {etcd_kill['member']} (the raft leader) -> {etcd_kill['new_leader']} led"
                    f" after {etcd_kill['seconds']:.1f}s; in the {etcd_kill.get('watched', 0):.0f}s after the kill the"
                    f" lock service kept going: {etcd_kill.get('runs_after', 0)} task runs started,"
                    f" {etcd_kill.get('sends_after', 0)} beat sends"
                )
            else:
                lines.append("  etcd member killed: " + ("no new raft leader seen" if etcd_kill else "not reached"))
        if summary.get("metrics"):
            lines.extend(metrics.describe(summary["metrics"]))
        lines.append(f"  processes left behind: {summary['processes_left']}")
        if not self.interrupted:
            lines.append("  result: " + ("OK" if summary["ok"] else "NOT OK: " + "; ".join(summary["problems"])))
        lines.append("=" * 100)
        return "\n".join(lines)


def _kept_going(etcd_kill: dict[str, Any] | None) -> bool:
    """A new raft leader was seen, and tasks ran and the beat sent after the etcd member was killed."""
    return bool(
        etcd_kill and "new_leader" in etcd_kill and etcd_kill.get("runs_after", 0) > 0
        and etcd_kill.get("sends_after", 0) > 0
    )  # fmt: skip
