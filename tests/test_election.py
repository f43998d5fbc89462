"""Election against a real etcd, with real processes: one leader, fast fail-over, no split brain."""

from __future__ import annotations

import contextlib
import re
import threading
import time

import pytest

from celery_etcdlock import Election, InvalidUse, LeaderEvent, connect
from celery_etcdlock.keys import ELECTIONS, queue_key
from tests.agents import agent, walls
from tests.support import EtcdServer, wait_until


def test_started_twice_is_invalid_use(client):
    a = Election(client, "twice", identity="a", ttl=5)
    a.start()
    try:
        with pytest.raises(InvalidUse, match="already started"):
            a.start()
    finally:
        a.stop()


def test_stop_before_the_campaign_reaches_its_acquire_still_stops_it(client):
    a = Election(client, "late", identity="a", ttl=5)
    assert a.campaign(timeout=5)
    b = Election(client, "late", identity="b", ttl=5)
    real_acquire, entered, stopped = b._lock.acquire, threading.Event(), threading.Event()

    def late_acquire(*args, **kwargs):  # holds b's campaign just before its acquire, while stop() runs
        entered.set()
        stopped.wait(10)
        return real_acquire(*args, **kwargs)

    b._lock.acquire = late_acquire
    b.start()
    assert entered.wait(10)
    threads = list(b._threads)
    b.stop()  # its cancel() finds nothing to cancel yet
    stopped.set()
    wait_until(lambda: not any(t.is_alive() for t in threads), 10, "b's campaign thread to end")
    assert queued(client, "late") == 1  # b did not stay queued behind a, to lead one day
    a.resign()
    assert a.leader() is None and not b.is_leader


def test_bad_input(client):
    with pytest.raises(ValueError, match="identity"):
        Election(client, "x", identity="", ttl=5)
    with pytest.raises(ValueError, match="ttl"):
        Election(client, "x", identity="a", ttl=0)
    with pytest.raises(ValueError, match="name"):
        Election(client, "", identity="a", ttl=5)


def queued(client, name):
    """How many candidates are in the election's queue (the leader and those behind it)."""
    return len(client.backend.read_queue(queue_key(ELECTIONS, name)).entries)


@contextlib.contextmanager
def candidates(url, n, ttl, **extra):
    procs = [agent("elect", url=url, name="cluster", identity=f"node-{i}", ttl=ttl, **extra) for i in range(n)]
    try:
        yield procs
    except BaseException:
        for p in procs:  # what each candidate said, for the failure report (LEADING lines folded)
            print(f"--- {p!r}:", *_folded(p.lines), sep="\n")
        raise
    finally:
        for p in procs:
            p.kill()


def _folded(lines):
    folded, run = [], 0
    for line in [*lines, ""]:
        if line.startswith("LEADING"):
            run += 1
            continue
        if run:
            folded.append(f"... LEADING x{run}")
            run = 0
        if line:
            folded.append(line)
    return folded


def leader_of(procs):
    """The candidates whose latest own event says they lead (elected, and not deposed since)."""
    return [p for p in procs if _latest_own_event(p) == "elected"]


def _latest_own_event(proc) -> str | None:
    own = [line.split()[1] for line in list(proc.lines) if line.startswith(("EVENT elected", "EVENT deposed"))]
    return own[-1] if own else None


def test_exactly_one_leader_among_three_and_all_agree(etcd_url, client):
    with candidates(etcd_url, 3, ttl=3) as procs:
        wait_until(lambda: len(leader_of(procs)) == 1, 30)
        (leader,) = leader_of(procs)
        identity = f"node-{procs.index(leader)}"
        observer = Election(client, "cluster", identity="observer", ttl=3)
        assert observer.leader() == identity
        for p in procs:
            if p is not leader:
                p.expect(rf"EVENT changed leader={identity}", timeout=15)


@pytest.mark.slow_but_newest
def test_killed_leader_is_replaced_within_ttl(etcd_url, client):
    ttl = 2
    with candidates(etcd_url, 3, ttl=ttl) as procs:
        wait_until(lambda: len(leader_of(procs)) == 1, 30)
        (old,) = leader_of(procs)
        old.kill()
        killed_at = time.time()
        rest = [p for p in procs if p is not old]
        wait_until(lambda: len(leader_of(rest)) == 1, ttl + 10)
        (new,) = leader_of(rest)
        elected = [line for line in new.lines if "EVENT elected" in line][-1]
        assert walls(elected) - killed_at <= ttl + 1


@pytest.mark.slow_but_newest
def test_resign_hands_over_promptly(etcd_url):
    ttl = 10  # a handover that waited for expiry would take 10 s
    first = agent("elect", url=etcd_url, name="cluster", identity="first", ttl=ttl, resign_after=2.0)
    with first:
        first.expect("EVENT elected", timeout=30)
        with agent("elect", url=etcd_url, name="cluster", identity="second", ttl=ttl) as second:
            second.expect("EVENT changed leader=first", timeout=30)
            resigned = first.expect("RESIGNING", timeout=30)
            elected = second.expect("EVENT elected", timeout=ttl)
            assert walls(elected.string) - walls(resigned.string) < ttl / 2


@pytest.mark.slow_but_newest
def test_paused_leader_is_deposed_and_never_leads_beside_another(etcd_url):
    ttl = 1
    with candidates(etcd_url, 2, ttl=ttl) as procs:
        wait_until(lambda: len(leader_of(procs)) == 1, 30)
        (old,) = leader_of(procs)
        (other,) = [p for p in procs if p is not old]
        old.stop()
        other.expect("EVENT elected", timeout=ttl + 10)
        resumed_at = time.time()
        old.cont()
        old.expect("EVENT deposed", timeout=15)
        old.expect("EVENT changed leader=node-", timeout=15)
        assert not any("EVENT deposed" in line for line in other.lines)
        # the other node leads throughout: the resumed one must never report leading
        assert not [line for line in old.lines if line.startswith("LEADING") and walls(line) >= resumed_at]


def _watchers(server: EtcdServer) -> int:
    """etcd's count of open watchers (one per watched key of a stream), as bench_scale reads it."""
    found = re.search(r"^etcd_debugging_mvcc_watcher_total\s+(\S+)$", server.metrics(), re.M)
    if not found:
        raise AssertionError("etcd_debugging_mvcc_watcher_total not in /metrics")
    return int(float(found.group(1)))


def _steady_watchers(server: EtcdServer, expected: int, what: str, hold: float = 3.0) -> None:
    """The watcher count reaches ``expected`` and stays there for ``hold`` seconds (never more, never less)."""
    wait_until(lambda: _watchers(server) >= expected, 15, what)
    seen, until = set(), time.monotonic() + hold
    while time.monotonic() < until:
        seen.add(_watchers(server))
        time.sleep(0.05)
    assert seen == {expected}, f"{what}: etcd counted {sorted(seen)} watchers, expected {expected}"


@pytest.mark.parametrize("api", ["v3"])
def test_a_follower_holds_one_watch(own_etcd: EtcdServer) -> None:
    # ttl 30: a wait re-creates its watch every 2 ttl at most, so none is re-created in the windows below
    url = own_etcd.url(prefix="/one-watch")
    clients = [connect(url) for _ in range(3)]
    nodes = [Election(c, "w", identity=f"node-{i}", ttl=30) for i, c in enumerate(clients)]
    try:
        assert _watchers(own_etcd) == 0
        nodes[0].start()
        events = [nodes[0].events()]
        assert next(events[0]) == LeaderEvent("elected", "node-0")
        # the leader watches its own entry: how it is deposed at once when the key is deleted
        _steady_watchers(own_etcd, 1, "the leader's watch")
        nodes[1].start()
        events.append(nodes[1].events())
        assert next(events[1]) == LeaderEvent("changed", "node-0")
        wait_until(lambda: queued(clients[0], "w") == 2, 10, "node-1 to queue")
        _steady_watchers(own_etcd, 2, "the leader's and one follower's (right behind the leader)")
        nodes[2].start()
        events.append(nodes[2].events())
        assert next(events[2]) == LeaderEvent("changed", "node-0")
        wait_until(lambda: queued(clients[0], "w") == 3, 10, "node-2 to queue")
        _steady_watchers(own_etcd, 3, "a follower behind another follower")
        nodes[0].resign()  # node-1 leads at once; node-2 hears of it; node-0 queues again behind node-2
        assert next(events[1]) == LeaderEvent("elected", "node-1")
        assert next(events[2]) == LeaderEvent("changed", "node-1")
        assert next(events[0]) == LeaderEvent("changed", "node-1")
        wait_until(lambda: queued(clients[0], "w") == 3, 10, "node-0 to queue again")
        assert nodes[1].token is not None and nodes[0].leader() == "node-1"
        _steady_watchers(own_etcd, 3, "one leader and two followers, after a handover")
    finally:
        for node in nodes:
            node.stop()
        for c in clients:
            c.close()
