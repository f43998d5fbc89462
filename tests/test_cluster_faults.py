"""The fault suite: every workload at once on a real 3-member etcd cluster, while the cluster fails.

For each cluster kind (the v2 API of etcd 3.4 and 3.5, the v3 API of 3.4, 3.5, 3.6 and 3.7: CONFIGS)
one cluster and one set of workloads run for the whole module, and each test inflicts one
fault (the last ones several at once) while they run:

    workload     processes                                    progress is
    mutex        6 ``counter`` roles (tests/cluster_workloads)  an increment of the shared counter
    rwlock       3 ``rwmix`` roles                             a read or a write inside the lock
    election     3 ``candidate`` roles                         a candidate that believes it leads
    tasks        a prefork worker (tests/taskapp.cluster_task)  a singleton run that starts
    beat         2 LeaderScheduler beats and a worker           a periodic run sent

Every client is given all three members, each in its own order, so each member is the
first endpoint of some client. A fault keeps going until every workload, and every single
lock process, has made progress under it (so a client stuck on the member that failed is
seen), or the liveness bound passes; then the cluster is healed and the same is asked again.

Safety is checked after every fault, over everything recorded so far: no lost update, no
overlap, fencing tokens strictly increasing, no two candidates believing they lead at one
moment, no periodic run sent twice. Liveness: after the fault (once the cluster can commit
again) every workload makes progress within ``BOUND`` seconds, derived in docs/reliability.md.

The figures (recovery per fault and workload, operations, safety counters) are collected in
``REPORT``; ``scripts/reliability`` runs this module and writes docs/reliability.md from them.
"""

from __future__ import annotations

import bisect
import json
import os
import random
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from celery_etcdlock import connect
from celery_etcdlock.beat import STATE_KIND
from celery_etcdlock.etcd.base import server_ttl
from celery_etcdlock.locks.store import DocumentStore
from tests import taskapp
from tests.procs import Proc
from tests.support import EtcdCluster, RedisServer, etcd_versions, partition_unsupported, wait_until
from tests.support.cluster import ELECTION_MS
from tests.test_beat import Beats
from tests.test_tasks_worker import Worker

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]

# -- the parameters, and the liveness bound they give ------------------------------------------------

TTL = 3.0  # every lock's, candidate's and beat's TTL: etcd is asked for server_ttl(3) = 2 s
REQUEST_TIMEOUT = 2.0  # every client's ?timeout=: how long it waits for a member before trying the next
ELECTION = 2 * ELECTION_MS / 1000  # raft elects within [1, 2) election timeouts of losing its leader
BACKOFF = 2.1  # the retry policy's longest pause between two attempts (2 s, plus up to 0.1 s of jitter)
BEAT_INTERVAL = 1.0
#: how soon every workload moves again once the cluster can commit (docs/reliability.md derives it):
#: one request timeout to leave a member that does not answer, one election, one TTL for an entry
#: whose holder lost it to expire, one backoff of the retry policy, and the beat's interval
BOUND = REQUEST_TIMEOUT + ELECTION + TTL + BACKOFF + BEAT_INTERVAL
#: a fault lasts at least this long, longer than a request timeout: a client stuck on the member hit must move
MIN_FAULT = REQUEST_TIMEOUT + 1.0
#: a task skipped more than this long after the holder it names released the lock decided on a stale read:
#: the read that decided was sent after the release (a read that long has failed and been retried)
STALE_AFTER = REQUEST_TIMEOUT + BACKOFF
#: a partition lasts long enough for a stale read to be told from a slow one
PARTITION = STALE_AFTER + 2.0
#: while a quorum is lost: a holder believes it holds for at most server_ttl(TTL) after its last renewal,
#: which a leader that lost its followers may still grant until it steps down (one election timeout)
CLOSED_AFTER = server_ttl(TTL) + ELECTION + 0.5
QUORUM_LOSS = CLOSED_AFTER + 3.0  # how long two members stay down

WORKLOADS = ("mutex", "rwlock", "election", "tasks", "beat")
#: the safety counter of overlaps that etcd itself causes (see Workloads._unexplained)
STALE_LEADER_OVERLAPS = "overlaps from a live lease a resumed old leader revoked (etcd#15247)"

#: every fault hits member VICTIM: as the raft leader (moved there first) or as a follower (moved away)
VICTIM = 0
#: the order in which each client lists the members (VICTIM first for 2 counters, 1 rwmix, 1 candidate,
#: the task worker and 1 beat: each fault hits clients that talk to the member hit, and others)
ORDERS = {
    "counter": [(0, 1, 2), (0, 2, 1), (1, 2, 0), (1, 0, 2), (2, 0, 1), (2, 1, 0)],
    "rwmix": [(0, 1, 2), (1, 2, 0), (2, 0, 1)],
    "candidate": [(0, 2, 1), (1, 0, 2), (2, 1, 0)],
    "tasks": [(0, 1, 2)],
    "beat": [(0, 2, 1), (1, 2, 0)],
}

#: ``crash``: members are killed with SIGKILL; else stopped with SIGTERM. etcd 3.5.0 to 3.5.2 can skip an
#: entry on a member killed by SIGKILL, whose copy of the data then differs from the others' for good
#: (etcd-io/etcd#13766, fixed in 3.5.3; EtcdCluster.diverged() tells); the 3.5 under test is the newest
#: (scripts/etcd-build), so every kind is killed for real.
CONFIGS = {
    "etcd3.4-v2": {"version": "3.4", "enable_v2": True, "scheme": "etcd", "crash": True},
    "etcd3.4-v3": {"version": "3.4", "enable_v2": True, "scheme": "etcd3", "crash": True},
    "etcd3.5-v2": {"version": "3.5", "enable_v2": True, "scheme": "etcd", "crash": True},
    "etcd3.5-v3": {"version": "3.5", "enable_v2": False, "scheme": "etcd3", "crash": True},
    "etcd3.6-v3": {"version": "3.6", "enable_v2": False, "scheme": "etcd3", "crash": True},
    "etcd3.7-v3": {"version": "3.7", "enable_v2": False, "scheme": "etcd3", "crash": True},
}
#: Where each test runs. scripts/reliability (ETCDLOCK_FAULT_KINDS=all) runs every test on every kind;
#: the default suite, to stay inside CI's time, runs every test on Debian's 3.4 and the tests marked
#: ``fault_smoke`` on the newest 3.5 and 3.7. ETCDLOCK_FAULT_KINDS=etcd3.6-v3,... names kinds to run in full.
FULL_BY_DEFAULT = ("etcd3.4-v2", "etcd3.4-v3")
SMOKE_BY_DEFAULT = ("etcd3.5-v3", "etcd3.7-v3")


def _kinds_for(smoke: bool) -> list[str]:
    chosen = os.environ.get("ETCDLOCK_FAULT_KINDS", "").strip()
    if chosen == "all":
        labels = list(CONFIGS)
    elif chosen:
        labels = [label.strip() for label in chosen.split(",") if label.strip()]
        unknown = [label for label in labels if label not in CONFIGS]
        if unknown:
            raise pytest.UsageError(f"ETCDLOCK_FAULT_KINDS: unknown {unknown}; known: all, {', '.join(CONFIGS)}")
    else:
        labels = [*FULL_BY_DEFAULT, *(SMOKE_BY_DEFAULT if smoke else ())]

    # ETCDLOCK_TEST_ETCD=3.4,3.7 narrows these too
    return [label for label in labels if etcd_versions.version_wanted(label[-2:], CONFIGS[label]["version"])]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "harness" in metafunc.fixturenames:
        smoke = metafunc.definition.get_closest_marker("fault_smoke") is not None
        metafunc.parametrize("harness", _kinds_for(smoke), indirect=True, scope="module")


#: what the suite measured, per cluster kind: written out by scripts/reliability (ETCDLOCK_RELIABILITY_JSON)
REPORT: dict[str, dict[str, Any]] = {}


# -- reading what the workloads recorded ----------------------------------------------------------------


class JsonLines:
    """The complete JSON lines appended to a file so far, read incrementally."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lines: list[dict[str, Any]] = []
        self._offset = 0
        self._partial = b""

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return self.lines
        self._offset += len(chunk)
        data = self._partial + chunk
        *complete, self._partial = data.split(b"\n")
        self.lines.extend(json.loads(line) for line in complete if line.strip())
        return self.lines


def election_times(line: dict[str, Any]) -> list[float]:
    """Moments at which a candidate's line says it believed it led."""
    return [line[k] for k in ("start", "last", "end") if k in line]


def leaderships(lines: list[dict[str, Any]]) -> list[tuple[float, float, int, int]]:
    """Each leadership a candidate recorded: (start, end, token, pid); one still going ends at its last report."""
    spans: dict[tuple[int, int], list[float]] = {}
    for line in lines:
        if line["event"] in ("lead", "leading", "end"):
            span = spans.setdefault((line["pid"], line["token"]), [line["start"], line["start"]])
            span[1] = max(span[1], line.get("end", line.get("last", line["start"])))
    return sorted((start, end, token, pid) for (pid, token), (start, end) in spans.items() if end > start)


@dataclass
class Safety:
    """The safety counters over everything recorded so far; ``violations`` must stay empty."""

    counts: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)

    def check(self, what: str, bad: list[Any], limit: int = 5) -> None:
        self.counts[what] = len(bad)
        if bad:
            self.violations.append(f"{what}: {len(bad)}, e.g. {bad[:limit]}")


# -- the workloads ------------------------------------------------------------------------------------------


class Workloads:
    """Every workload process of one cluster kind, and what they recorded."""

    def __init__(self, cluster: EtcdCluster, scheme: str, root: Path, redis_url: str) -> None:
        self.cluster = cluster
        self.scheme = scheme
        self.root = root
        self.redis_url = redis_url
        self.prefix = f"/faults-{uuid.uuid4().hex[:8]}"
        self.counter_file = root / "counter"
        self.counter_file.write_text("0")
        self.rw_state = root / "rw-state"
        self.procs: dict[str, Proc] = {}  # log file name -> lock workload process
        self.logs: dict[str, JsonLines] = {}
        self.tag = uuid.uuid4().hex[:10]
        self.task_events: list[dict[str, Any]] = []
        self.task_lock_events: list[dict[str, Any]] = []
        self.no_quorum: list[tuple[float, float]] = []  # when the cluster could not commit (faults record it)
        self.resumed_leaders: list[float] = []  # when a frozen raft leader was resumed (faults record it)
        self.beat_runs: list[dict[str, Any]] = []
        self.worker: Worker | None = None
        self.beats: Beats | None = None
        self._producing = threading.Event()
        self._producer: threading.Thread | None = None
        self._stopped = False

    def url(self, order: tuple[int, ...]) -> str:
        return self.cluster.url(list(order), scheme=self.scheme, prefix=self.prefix, timeout=REQUEST_TIMEOUT)

    # -- life

    def start(self) -> None:
        seed = random.Random(1)
        for role in ("counter", "rwmix", "candidate"):
            for i, order in enumerate(ORDERS[role]):
                log = self.root / f"{role}-{i}.jsonl"
                args = {
                    "url": self.url(order), "log": str(log), "ttl": TTL, "seed": seed.randrange(1 << 30),
                    "name": {"counter": "counter", "rwmix": "rw", "candidate": "leader"}[role],
                    "counter": str(self.counter_file), "state": str(self.rw_state), "identity": f"cand-{i}",
                }  # fmt: skip
                self.procs[log.name] = Proc.module("tests.cluster_workloads", role, json.dumps(args), name=log.stem)
                self.logs[log.name] = JsonLines(log)
        # the Celery parts: a prefork worker of singleton tasks, fed by a thread here; two beats and their worker
        tasks_url = self.url(ORDERS["tasks"][0])
        taskapp.configure(tasks_url, self.redis_url)
        self.worker = Worker(tasks_url, self.redis_url)
        first, second = (self.url(order) for order in ORDERS["beat"])
        self.beats = Beats(self.root, first, self.redis_url, ttl=TTL, schedule="every")
        self.beats.start_beat()
        self.beats.env["ETCDLOCK_URL"] = second
        self.beats.start_beat()
        self.beats.start_worker()
        self._producer = threading.Thread(target=self._produce, name="cluster-task-producer", daemon=True)
        self._producer.start()

    def _produce(self) -> None:
        while not self._producing.wait(0.2):
            try:
                taskapp.cluster_task.apply_async((self.tag, 0.3))
            except Exception as exc:  # Redis is not under test; never let the producer die
                print(f"producer: {exc!r}")

    def stop(self) -> dict[str, int | None]:
        """SIGTERM every process (they finish their step); the lock roles' exit codes (None: had to be killed).

        The worker stops its pool children too. Safe to call twice: the second call stops nothing.
        """
        self._producing.set()
        codes: dict[str, int | None] = {}
        for proc in self.procs.values():
            proc.signal(signal.SIGTERM)
        for name, proc in self.procs.items():
            try:
                codes[name] = proc.wait(60)
            except AssertionError:
                codes[name] = None
                proc.signal(signal.SIGUSR1)  # the role's threads' stacks, into its output
                time.sleep(1)  # no event to wait for: faulthandler writes and the reader thread collects
                print(f"==== {name} did not stop; its output:\n" + "\n".join(proc.lines[-300:]))
                proc.kill()
        if not self._stopped:
            self._stopped = True
            if self.worker is not None:
                self.worker.stop()
            if self.beats is not None:
                self.beats.close()
        return codes

    def crashed(self) -> list[str]:
        """Every workload process that is no longer running, or recorded a crash."""
        dead = [name for name, proc in self.procs.items() if not proc.alive]
        dead += [f"{name}: {line['error']}" for name, log in self.logs.items() for line in log.read()
                 if line["event"] == "crash"]  # fmt: skip
        if self.worker is not None and not self.worker.proc.alive:
            dead.append("celery worker")
        if self.beats is not None:
            dead += [f"beat {who}" for who, proc in self.beats.beats.items() if proc.poll() is not None]
            dead += [f"beat worker {proc.pid}" for proc in self.beats.others if proc.poll() is not None]
        return dead

    # -- what they recorded

    def lines(self, prefix: str) -> list[dict[str, Any]]:
        return [line for name, log in self.logs.items() if name.startswith(prefix) for line in log.read()]

    def tasks(self) -> list[dict[str, Any]]:
        store = taskapp.store()
        new = store.lrange(f"events:{self.tag}", len(self.task_events), -1)
        self.task_events.extend(json.loads(x) for x in new)
        return self.task_events

    def task_lock(self) -> list[dict[str, Any]]:
        """The skips and releases of the tasks' lock (tests/taskapp.py records them)."""
        key = f"lockevents:{taskapp.cluster_task.lock_name_for((self.tag,))}"
        new = taskapp.store().lrange(key, len(self.task_lock_events), -1)
        self.task_lock_events.extend(json.loads(x) for x in new)
        return self.task_lock_events

    def beat_sends(self) -> list[dict[str, Any]]:
        assert self.beats is not None
        new = self.beats.redis.lrange(self.beats.runs_key, len(self.beat_runs), -1)
        self.beat_runs.extend(json.loads(x) for x in new)
        return sorted((r for r in self.beat_runs if r["entry"] == "every"), key=lambda r: r["sent_at"])

    def progress(self) -> dict[str, list[float]]:
        """For each workload, and each lock process (``mutex:counter-0.jsonl``...), when it made progress."""
        times: dict[str, list[float]] = {w: [] for w in WORKLOADS}
        for name, log in self.logs.items():
            lines = log.read()
            if name.startswith("candidate"):
                times["election"] += [t for line in lines for t in election_times(line)]
                continue
            workload = "mutex" if name.startswith("counter") else "rwlock"
            own = [line["t_in"] for line in lines if line["event"] in ("inc", "read", "write")]
            times[workload] += own
            times[f"{workload}:{name.removesuffix('.jsonl')}"] = own
        times["tasks"] = [e["wall"] for e in self.tasks() if e["event"] == "start"]
        times["beat"] = [r["sent_at"] for r in self.beat_sends()]
        return {name: sorted(ts) for name, ts in times.items()}

    def errors(self) -> int:
        return sum(1 for log in self.logs.values() for line in log.read() if line["event"] == "error")

    # -- safety

    def safety(self) -> Safety:
        safety = Safety()
        self._mutex_safety(safety)
        self._rwlock_safety(safety)
        self._election_safety(safety)
        self._task_safety(safety)
        self._beat_safety(safety)
        return safety

    def _mutex_safety(self, safety: Safety) -> None:
        incs = sorted(self.lines("counter"), key=lambda line: line.get("value", -1))
        incs = [line for line in incs if line["event"] == "inc"]
        values = [line["value"] for line in incs]
        safety.counts["increments"] = len(incs)
        # every value read exactly once: a value read twice is an update lost, one never read a torn counter
        safety.check("mutex lost updates", [v for v, n in _counted(values).items() if n > 1])
        safety.check("mutex values skipped", sorted(set(range(len(values))) - set(values)))
        safety.check("mutex overlaps seen inside", [line for line in incs if line["overlap"]])
        held = sorted((line for line in incs if line["held_out"]), key=lambda line: line["t_in"])
        tokens = {(x["t_in"], x["pid"]): x["token"] for x in held}
        overlaps = self._unexplained(safety, _overlaps([(x["t_in"], x["t_out"], x["pid"]) for x in held]), tokens)
        safety.check("mutex overlapping holds", overlaps)
        safety.counts["mutex holds lost inside"] = len(incs) - len(held)
        safety.check(
            "mutex tokens not increasing",
            [(a["token"], b["token"]) for a, b in zip(incs, incs[1:], strict=False) if b["token"] <= a["token"]],
        )

    def _rwlock_safety(self, safety: Safety) -> None:
        ops = [line for line in self.lines("rwmix") if line["event"] in ("read", "write")]
        writes = sorted((line for line in ops if line["event"] == "write"), key=lambda line: line["write"])
        safety.counts["rw reads"] = len(ops) - len(writes)
        safety.counts["rw writes"] = len(writes)
        safety.check("rw conflicts seen inside", [line for line in ops if line["conflict"]])
        numbers = [w["write"] for w in writes]
        safety.check("rw writes counted twice", [n for n, count in _counted(numbers).items() if count > 1])
        safety.check(
            "rw write tokens not increasing",
            [(a["token"], b["token"]) for a, b in zip(writes, writes[1:], strict=False) if b["token"] <= a["token"]],
        )

    def _election_safety(self, safety: Safety) -> None:
        spans = leaderships(self.lines("candidate"))
        safety.counts["leaderships"] = len(spans)
        tokens = {(s, pid): token for s, _, token, pid in spans}
        overlaps = self._unexplained(safety, _overlaps([(s, e, pid) for s, e, _, pid in spans]), tokens)
        safety.check("two candidates leading at once", overlaps)
        safety.check(
            "leader tokens not increasing",
            [(a[2], b[2]) for a, b in zip(spans, spans[1:], strict=False) if b[2] <= a[2]],
        )

    def _task_safety(self, safety: Safety) -> None:
        runs: dict[str, dict[str, Any]] = {}
        for event in self.tasks():
            run = runs.setdefault(event["task_id"], {"pid": event["pid"]})
            run[event["event"]] = event
        started = sorted((r for r in runs.values() if "start" in r), key=lambda r: r["start"]["wall"])
        safety.counts["task runs"] = len(started)
        kept = [r for r in started if "end" in r and r["end"]["held"]]
        safety.counts["task runs that lost their lock"] = len([r for r in started if "end" in r]) - len(kept)
        spans = [(r["start"]["wall"], r["end"]["wall"], r["start"]["task_id"]) for r in kept]
        safety.check("task runs overlapping", _overlaps(spans))
        tokens = [r["start"]["token"] for r in started]
        events = self.task_lock()
        released = {e["token"]: e["wall"] for e in events if e["event"] == "released"}
        skips = [e for e in events if e["event"] == "skip"]
        safety.counts["task skips"] = len(skips)
        stale = []
        for skip in skips:
            gone = [released.get(token) for token in skip["tokens"]]
            if skip["tokens"] and None not in gone:
                since = max(g for g in gone if g is not None)
                if skip["wall"] - since > STALE_AFTER and not self._without_quorum(since, skip["wall"]):
                    stale.append({"skip": skip, "released": round(skip["wall"] - since, 2)})
        safety.check("tasks skipped on a stale read", stale)
        safety.check("task tokens not increasing", [(a, b) for a, b in zip(tokens, tokens[1:], strict=False) if b <= a])

    def _beat_safety(self, safety: Safety) -> None:
        # The leader records every run in etcd before it sends it: a compare-and-swap on the state's version,
        # fenced by its election key, that counts the run. So a run sent twice is a send more than the runs
        # recorded. Two sends closer than an interval are not that by themselves: a run whose recording was
        # slow (its member failing) goes out late, and the next one, due an interval after the first was
        # recorded, on time; they are counted apart.
        assert self.beats is not None
        sends = self.beat_sends()
        published = [p[2] for p in self.beats.published() if p[0] == "every"]
        recorded = self.beat_runs_recorded()
        safety.counts["beat runs"] = len(sends)
        safety.counts["beat messages published"] = len(published)
        safety.counts["beat runs recorded in etcd"] = recorded
        safety.counts["beat runs sent late (within half an interval of the next)"] = sum(
            b["sent_at"] - a["sent_at"] < BEAT_INTERVAL / 2 for a, b in zip(sends, sends[1:], strict=False)
        )
        safety.check("beat runs sent twice", [(len(sends), recorded)] if len(sends) > recorded else [])
        safety.check("beat messages published twice", [(len(published), recorded)] if len(published) > recorded else [])

    def beat_runs_recorded(self) -> int:
        """How many runs of the ``every`` entry the beats' state in etcd counts (its ``total_run_count``)."""
        client = connect(self.url((0, 1, 2)), retry_max_delay=30)
        try:
            record = DocumentStore(client, STATE_KIND).get("beatapp")  # tests.beatapp's beat name
        finally:
            client.close()
        entries = record.value.get("entries", {}) if record is not None else {}
        return int(entries.get("every", {}).get("total_run_count", 0))

    def _unexplained(
        self, safety: Safety, overlaps: list[tuple[Any, Any]], tokens: dict[tuple[float, int], int]
    ) -> list[tuple[Any, Any]]:
        """The overlaps etcd's own bug does not explain; those it does are counted apart.

        etcd before 3.5.13 / 3.4.31 (etcd-io/etcd#15247; docs/reliability.md): a raft leader frozen
        past a lease's TTL, once resumed, has its lessor revoke leases it saw no keep-alive for,
        and raft forwards the revocation to the real leader: the keys of a holder that renews on
        time are deleted behind its back, and it learns so at its next renewal or from a watch,
        while the next waiter, woken by the delete, may hold already. (The other face, a lone
        renewal by the old leader, the client refuses: Etcd3Backend.keep_alive.) Such an overlap
        has a signature: the earlier holder learnt from etcd that its lease or its key
        was gone (cause "revoked" or "deleted": nobody deletes keys here), not from its own
        deadline ("late"); the later one took over within a TTL after a frozen leader resumed;
        and the overlap is shorter than the TTL. Anything else is a violation.
        """
        ttl = server_ttl(TTL)
        ended_by_etcd = {(line["pid"], line["token"]) for line in self.lines("") if line["event"] == "lost"
                         and line["cause"] in ("revoked", "deleted")}  # fmt: skip
        unexplained = []
        for earlier, later in overlaps:
            start, end, pid = earlier
            explained = (
                (pid, tokens[(start, pid)]) in ended_by_etcd
                and any(resumed <= later[0] <= resumed + ttl + 1 for resumed in self.resumed_leaders)
                and end - later[0] <= ttl
            )
            if explained:
                safety.counts[STALE_LEADER_OVERLAPS] = safety.counts.get(STALE_LEADER_OVERLAPS, 0) + 1
            else:
                unexplained.append((earlier, later))
        safety.counts.setdefault(STALE_LEADER_OVERLAPS, 0)
        return unexplained

    def _without_quorum(self, start: float, end: float) -> bool:
        """Whether the cluster lost its quorum at some moment between ``start`` and ``end``."""
        return any(lost < end and start < back for lost, back in self.no_quorum)


def _counted(values: list[Any]) -> dict[Any, int]:
    counts: dict[Any, int] = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    return counts


def _overlaps(spans: list[tuple[float, float, Any]]) -> list[tuple[Any, Any]]:
    """Pairs of spans (start, end, owner) of different owners that overlap in time."""
    spans = sorted(spans)
    found = []
    latest: tuple[float, float, Any] | None = None  # the span that ends last among those started so far
    for span in spans:
        if latest is not None and span[0] < latest[1] and span[2] != latest[2]:
            found.append((latest, span))
        if latest is None or span[1] > latest[1]:
            latest = span
    return found


# -- faults ------------------------------------------------------------------------------------------------


class Harness:
    """One cluster kind: the cluster, the workloads, and what each fault did to them."""

    def __init__(self, label: str, cluster: EtcdCluster, workloads: Workloads, crash: bool = True) -> None:
        self.label = label
        self.cluster = cluster
        self.workloads = workloads
        self.crash = crash  # members are killed with SIGKILL (else stopped with SIGTERM: see CONFIGS)
        self.report = REPORT.setdefault(label, {"faults": {}, "safety": {}, "bound": BOUND})
        self.report["kill"] = "SIGKILL" if crash else "SIGTERM"
        version = subprocess.run([cluster.members[0].binary, "--version"], capture_output=True, text=True).stdout
        self.report["etcd"] = version.split("etcd Version: ", 1)[-1].split()[0] if "etcd Version: " in version else "?"

    def healthy(self) -> None:
        """Every member up and unfrozen, no partition, a leader, and all with the same data: where each fault starts."""
        self.cluster.heal()
        self.cluster.restore()
        wait_until(lambda: all(m.ready() for m in self.cluster.members), 60, "every member healthy")
        diverged = self.cluster.diverged()
        assert diverged is None, f"{self.label}: etcd itself lost data (etcd-io/etcd#13766?): {diverged}"

    def progress_after(self, since: float, timeout: float, what: str) -> dict[str, float]:
        """Wait until every workload and every lock process moved after ``since``; each one's delay."""
        found: dict[str, float] = {}
        deadline = time.monotonic() + timeout
        while True:
            progress = self.workloads.progress()
            for name, times in progress.items():
                i = bisect.bisect_right(times, since)
                if name not in found and i < len(times):
                    found[name] = times[i] - since
            missing = [name for name in progress if name not in found]
            if not missing:
                return found
            if time.monotonic() >= deadline:
                crashed = self.workloads.crashed()
                raise AssertionError(
                    f"{self.label}: after {what}, no progress within {timeout:g}s by {', '.join(missing)}"
                    f" (progress of the others: {_rounded(found)}; processes down: {crashed or 'none'})"
                )
            time.sleep(0.1)

    def run_fault(self, name: str, steps: Callable[[Fault], None]) -> Fault:
        self.healthy()
        self.progress_after(time.time(), BOUND, f"the healthy cluster before {name}")
        fault = Fault(self, name)
        steps(fault)
        fault.finish()
        self.healthy()  # etcd's own consistency first: a member that lost data voids what the clients did
        self.check_safety()
        return fault

    def check_safety(self) -> None:
        safety = self.workloads.safety()
        self.report["safety"] = dict(safety.counts, errors_survived=self.workloads.errors())
        self.report["resumed_leaders"] = self.workloads.resumed_leaders
        crashed = self.workloads.crashed()
        assert not crashed, f"{self.label}: workload processes died: {crashed}"
        assert not safety.violations, f"{self.label}: safety violated:\n  " + "\n  ".join(safety.violations)


class Fault:
    """One fault test: its phases, each a moment from which every workload must move again."""

    def __init__(self, harness: Harness, name: str) -> None:
        self.harness = harness
        self.name = name
        self.started = time.time()
        self.phases: list[dict[str, Any]] = []
        self.closed: list[tuple[float, float]] = []  # windows in which nothing may progress

    @property
    def cluster(self) -> EtcdCluster:
        return self.harness.cluster

    def kill(self, index: int) -> None:
        """SIGKILL member ``index`` (SIGTERM where SIGKILL would make etcd lose data: see CONFIGS)."""
        if self.harness.crash:
            self.cluster.member(index).kill()
        else:
            self.cluster.member(index).stop()

    def expect_progress(self, phase: str, since: float, hold: float = 0.0) -> None:
        """Every workload moves after ``since`` within BOUND; and at least ``hold`` seconds pass."""
        delays = self.harness.progress_after(since, BOUND, phase)
        wait_until(lambda: time.time() >= since + hold, hold + 1, f"{hold:g}s of {phase}")
        workloads = {w: round(delays[w], 2) for w in WORKLOADS}
        clients = {k: v for k, v in delays.items() if ":" in k}
        self.phases.append(
            {"phase": phase, "at": since, "recovery": workloads,
             "slowest_client": round(max(clients.values(), default=0.0), 2)}
        )  # fmt: skip

    def resume_frozen_leader(self, index: int) -> float:
        """SIGCONT member ``index``, frozen while it led; when (see Workloads._unexplained)."""
        resumed = time.time()
        self.harness.workloads.resumed_leaders.append(resumed)
        self.cluster.member(index).resume()
        return resumed

    def expect_closed(self, since: float, until: float) -> None:
        """Nothing progresses between ``since`` and ``until`` (a lost quorum: fail closed)."""
        wait_until(lambda: time.time() >= until, until - time.time() + 1, "the end of the closed window")
        self.closed.append((since, until))
        moved = {
            name: [round(t - since, 2) for t in times if since <= t <= until]
            for name, times in self.harness.workloads.progress().items()
            if ":" not in name
        }
        moved = {name: ts for name, ts in moved.items() if ts}
        assert not moved, f"{self.harness.label}: {self.name}: progress without a quorum: {moved}"

    def finish(self) -> None:
        ended = time.time()
        progress = self.harness.workloads.progress()
        ops, gaps = {}, {}
        for workload in WORKLOADS:
            inside = [t for t in progress[workload] if self.started <= t <= ended]
            ops[workload] = len(inside)
            points = [self.started, *inside, ended]
            gaps[workload] = round(max(b - a for a, b in zip(points, points[1:], strict=False)), 2)
        self.harness.report["faults"][self.name] = {
            "seconds": round(ended - self.started, 1),
            "phases": self.phases,
            "ops": ops,
            "longest_pause": gaps,
            "closed": [round(b - a, 1) for a, b in self.closed],
            "started": self.started,
        }
        if not self.closed:  # the cluster kept a quorum: no workload may stall for longer than the bound
            stalled = {w: g for w, g in gaps.items() if g > BOUND}
            assert not stalled, f"{self.harness.label}: {self.name}: stalled longer than {BOUND:g}s: {stalled}"


def _rounded(values: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 2) for k, v in values.items()}


def skip_unless_partition_works() -> None:
    reason = partition_unsupported()
    if reason:
        pytest.skip(reason)


# -- fixtures ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_for_faults() -> Iterator[str]:
    redis = RedisServer().start()
    yield redis.url()
    redis.close()


@pytest.fixture(scope="module")
def harness(request: pytest.FixtureRequest, redis_for_faults: str, tmp_path_factory: pytest.TempPathFactory):
    """One cluster kind of CONFIGS (pytest_generate_tests picks which) and its workloads, for the module."""
    label = request.param
    config = CONFIGS[label]
    etcd_versions.require(config["version"])
    cluster = EtcdCluster(config["version"], enable_v2=config["enable_v2"])
    workloads = None
    try:
        cluster.start()
        workloads = Workloads(cluster, config["scheme"], tmp_path_factory.mktemp(label), redis_for_faults)
        workloads.start()
        harness = Harness(label, cluster, workloads, crash=config["crash"])
        harness.progress_after(time.time(), 120, "the start of every workload")
        yield harness
    finally:
        if workloads is not None:
            workloads.stop()
        cluster.close()
        left = cluster.leftover_chains()
        _write_report()
        assert not left, f"iptables chains left behind: {left}"


_STARTED = time.monotonic()


def _write_report() -> None:
    path = os.environ.get("ETCDLOCK_RELIABILITY_JSON")
    if path:
        meta = {"date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(),
                "minutes": round((time.monotonic() - _STARTED) / 60, 1)}  # fmt: skip
        Path(path).write_text(json.dumps({**REPORT, "_meta": meta}, indent=2, sort_keys=True))


# -- the faults, one at a time ----------------------------------------------------------------------------


@pytest.mark.fault_smoke
def test_kill_the_raft_leader_then_restart_it(harness: Harness) -> None:
    def steps(fault: Fault) -> None:
        fault.cluster.move_leader(VICTIM)
        killed = time.time()
        fault.kill(VICTIM)
        fault.cluster.wait_for_leader(other_than=VICTIM)
        fault.expect_progress("leader killed", killed, hold=MIN_FAULT)
        restarted = time.time()
        fault.cluster.member(VICTIM).restart()
        fault.expect_progress("restarted", restarted)

    harness.run_fault("kill the leader, restart it", steps)


@pytest.mark.fault_smoke
def test_sigstop_the_raft_leader_past_the_election_timeout(harness: Harness) -> None:
    def steps(fault: Fault) -> None:
        fault.cluster.move_leader(VICTIM)
        paused = time.time()
        fault.cluster.member(VICTIM).pause()
        fault.cluster.wait_for_leader(other_than=VICTIM)  # longer than the election timeout, by definition
        fault.expect_progress("leader frozen", paused, hold=MIN_FAULT)
        resumed = fault.resume_frozen_leader(VICTIM)
        fault.expect_progress("resumed", resumed)

    harness.run_fault("SIGSTOP the leader", steps)


def test_sigstop_a_follower(harness: Harness) -> None:
    def steps(fault: Fault) -> None:
        fault.cluster.move_leader(VICTIM + 1)
        paused = time.time()
        fault.cluster.member(VICTIM).pause()
        fault.expect_progress("follower frozen", paused, hold=MIN_FAULT)
        resumed = time.time()
        fault.cluster.member(VICTIM).resume()
        fault.expect_progress("resumed", resumed)

    harness.run_fault("SIGSTOP a follower", steps)


@pytest.mark.parametrize("role", ["leader", "follower"])
def test_partition_one_member_from_the_other_two(harness: Harness, role: str) -> None:
    skip_unless_partition_works()

    def steps(fault: Fault) -> None:
        fault.cluster.move_leader(VICTIM if role == "leader" else VICTIM + 1)
        cut = time.time()
        fault.cluster.partition(VICTIM)
        fault.cluster.wait_for_leader(other_than=VICTIM)
        fault.expect_progress(f"{role} cut off", cut, hold=PARTITION)
        healed = time.time()
        fault.cluster.heal()
        fault.expect_progress("healed", healed)

    harness.run_fault(f"partition the {role}", steps)


def test_rolling_restart_of_all_three(harness: Harness) -> None:
    def steps(fault: Fault) -> None:
        started = time.time()
        fault.cluster.rolling_restart()
        fault.expect_progress("rolling restart", started)

    harness.run_fault("rolling restart", steps)


def test_losing_quorum_fails_closed_then_recovers_on_its_own(harness: Harness) -> None:
    def steps(fault: Fault) -> None:
        fault.cluster.move_leader(VICTIM)
        lost = time.time()
        fault.cluster.stop_quorum(keep=VICTIM, crash=fault.harness.crash)  # the leader stays, alone
        fault.expect_closed(lost + CLOSED_AFTER, lost + QUORUM_LOSS)
        restored = time.time()
        fault.cluster.restore()
        fault.harness.workloads.no_quorum.append((lost, time.time()))
        fault.expect_progress("quorum back", restored)

    harness.run_fault("lose quorum, restore it", steps)


# -- faults combined ------------------------------------------------------------------------------------


def test_leader_killed_then_the_new_leader_frozen(harness: Harness) -> None:
    """Two leader changes in a row: kill the leader; freeze its successor; bring both back."""

    def steps(fault: Fault) -> None:
        fault.cluster.move_leader(VICTIM)
        killed = time.time()
        fault.kill(VICTIM)
        second = fault.cluster.wait_for_leader(other_than=VICTIM)
        fault.cluster.member(VICTIM).restart()  # back as a follower: the frozen leader's successor needs it
        frozen = time.time()
        fault.cluster.member(second).pause()
        fault.cluster.wait_for_leader(other_than=second)
        fault.expect_progress("leader killed, its successor frozen", killed, hold=frozen - killed + MIN_FAULT)
        resumed = fault.resume_frozen_leader(second)
        fault.expect_progress("resumed", resumed)

    harness.run_fault("kill the leader, freeze the next", steps)


def test_partitioned_leader_while_a_majority_member_freezes(harness: Harness) -> None:
    """The leader is cut off; while it is, a member of the majority freezes (no quorum anywhere); then both heal."""
    skip_unless_partition_works()

    def steps(fault: Fault) -> None:
        fault.cluster.move_leader(VICTIM)
        fault.cluster.partition(VICTIM)
        new_leader = fault.cluster.wait_for_leader(other_than=VICTIM)
        frozen = time.time()
        fault.cluster.member(new_leader).pause()
        fault.expect_closed(frozen + CLOSED_AFTER, frozen + QUORUM_LOSS)
        resumed = fault.resume_frozen_leader(new_leader)
        fault.harness.workloads.no_quorum.append((frozen, time.time()))
        fault.expect_progress("majority member resumed (leader still cut off)", resumed, hold=MIN_FAULT)
        healed = time.time()
        fault.cluster.heal()
        fault.expect_progress("healed", healed)

    harness.run_fault("partition the leader, freeze a majority member", steps)


# -- the end of the run -------------------------------------------------------------------------------------


@pytest.mark.fault_smoke
def test_every_process_survived_and_every_update_counted(harness: Harness) -> None:
    harness.healthy()
    harness.check_safety()  # every process still running
    codes = harness.workloads.stop()
    assert all(code == 0 for code in codes.values()), f"workload exit codes: {codes}"
    safety = harness.workloads.safety()  # everything, up to the last step of each process
    harness.report["safety"] = dict(safety.counts, errors_survived=harness.workloads.errors())
    assert not safety.violations, f"{harness.label}: safety violated:\n  " + "\n  ".join(safety.violations)
    increments = safety.counts["increments"]
    assert increments > 0
    assert int(harness.workloads.counter_file.read_text()) == increments, "the counter lost updates"
