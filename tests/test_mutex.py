"""Mutex against a real etcd: exclusion, tokens, crashes, pauses, outages, FIFO."""

from __future__ import annotations

import re
import threading
import time

import pytest

from celery_etcdlock import Election, LockLost, Mutex, NotHeld, RWLock, connect
from celery_etcdlock.keys import LOCKS
from tests.agents import agent, walls
from tests.support import wait_until


@pytest.mark.parametrize("make", [Mutex, RWLock, lambda c, name: Election(c, name, identity="a")])
def test_something_else_than_a_client_is_named(make):
    with pytest.raises(TypeError, match="client must be a celery_etcdlock Client .from connect"):
        make("etcd://127.0.0.1:2379", "x")  # a URL where the client belongs


@pytest.mark.slow_but_newest
def test_a_hung_renewal_of_one_session_does_not_delay_another_sessions(client, monkeypatch):
    from celery_etcdlock.etcd.retry import Transient

    long = Mutex(client, "long", ttl=9)  # renewed every 8/3 s
    assert long.acquire(timeout=5)
    hung_lease, hanging, unhang = long._held.lease.handle, threading.Event(), threading.Event()
    short_renewals = []
    real_keep_alive = client.backend.keep_alive

    def keep_alive(lease, entries, timeout):
        if lease is hung_lease:  # a black-holed connection: nothing comes back until the timeout
            hanging.set()
            unhang.wait(timeout)
            raise Transient("black hole", "read timed out")
        gone = real_keep_alive(lease, entries, timeout)
        if hanging.is_set():
            short_renewals.append(lease)
        return gone

    monkeypatch.setattr(client.backend, "keep_alive", keep_alive)
    lost = []
    short = Mutex(client, "short", ttl=2, on_lost=lost.append)  # renewed every 1/3 s, lost 0.9 s after a miss
    assert short.acquire(timeout=5)
    try:
        assert hanging.wait(15)
        wait_until(lambda: len(short_renewals) >= 4 or lost, 15, "4 renewals of the short lock during the hang")
        assert short.held and not lost
    finally:
        unhang.set()
        short.release()
        long.release()


def test_a_renewer_that_could_not_start_is_started_by_the_next_acquire(etcd_url, monkeypatch):
    from celery_etcdlock.locks import session as sessions

    class FailsOnce(threading.Thread):
        failed = False

        def start(self):
            if not FailsOnce.failed:
                FailsOnce.failed = True
                raise RuntimeError("can't start new thread")
            super().start()

    monkeypatch.setattr(sessions.threading, "Thread", FailsOnce)
    client = connect(etcd_url)
    renewals = []
    real_keep_alive = client.backend.keep_alive
    monkeypatch.setattr(client.backend, "keep_alive", lambda *a, **kw: renewals.append(1) or real_keep_alive(*a, **kw))
    try:
        first = Mutex(client, "r", ttl=2)
        with pytest.raises(RuntimeError, match="start new thread"):
            first.acquire()
        second = Mutex(client, "r", ttl=2)
        assert second.acquire(timeout=5)  # the first one's entry is not in its way
        wait_until(lambda: len(renewals) >= 3, 10, "3 renewals")
        assert second.held
        second.release()
    finally:
        client.close()


def test_a_lock_released_after_its_client_closed_starts_no_renewer(etcd_url):
    client = connect(etcd_url)
    lock = Mutex(client, "closing", ttl=3)
    lock.acquire()
    session = lock._session
    client.close()
    lock.release()  # quiet: it was lost when the client closed
    assert session._tidy == {}
    wait_until(lambda: session._renewer is None, 10, "the closed session's renewer to end")


@pytest.mark.parametrize("ttl", [0, -1, "3", None, float("nan"), True])
def test_bad_ttl(client, ttl):
    with pytest.raises((ValueError, TypeError), match="ttl"):
        Mutex(client, "x", ttl=ttl)


@pytest.mark.parametrize("name", ["", None, 3])
def test_bad_name(client, name):
    with pytest.raises((ValueError, TypeError), match="name"):
        Mutex(client, name, ttl=5)


@pytest.mark.parametrize("ttl", [1e11, 7.4e9, 604801])
def test_ttls_above_the_maximum_are_refused(client, ttl):
    with pytest.raises(ValueError, match="ttl must be at most 604800 seconds"):
        Mutex(client, "x", ttl=ttl)


@pytest.mark.parametrize(
    ("timeout", "error"),
    [(-1, ValueError), (float("nan"), ValueError), (float("inf"), ValueError), ("5", TypeError), (True, TypeError)],
)
def test_bad_timeout(client, timeout, error):
    lock = Mutex(client, "x", ttl=5)
    with pytest.raises(error, match="timeout"):
        lock.acquire(timeout=timeout)
    assert client.backend.list_queues(LOCKS) == {}  # refused before anything was written


@pytest.mark.slow_but_newest
def test_live_holder_keeps_the_lock_for_three_ttls(etcd_url, client):
    ttl = 1
    with agent("hold", url=etcd_url, name="long", ttl=ttl) as holder:
        holder.expect("HELD", timeout=15)
        contender = Mutex(client, "long", ttl=ttl)
        assert contender.acquire(timeout=3 * ttl) is False
        assert holder.expect(r"held=True", timeout=5)
        assert not any("LOST" in line for line in holder.lines)


def test_killed_holder_frees_the_lock_within_ttl(etcd_url, client):
    ttl = 2
    with agent("hold", url=etcd_url, name="crash", ttl=ttl) as holder:
        holder.expect("HELD", timeout=15)
        holder.kill()
        contender = Mutex(client, "crash", ttl=ttl)
        assert contender.acquire(timeout=ttl + 1), "the dead holder's lock was not freed within ttl + 1 s"
        contender.release()


@pytest.mark.slow
def test_mutual_exclusion_across_processes(etcd_url, tmp_path):
    counter, tokens = tmp_path / "counter", tmp_path / "tokens"
    counter.write_text("0")
    tokens.write_text("")
    procs, rounds = 6, 15
    runners = [
        agent("counter", url=etcd_url, name="rmw", ttl=5, rounds=rounds, counter=str(counter), tokens=str(tokens))
        for _ in range(procs)
    ]
    try:
        for runner in runners:
            runner.expect("DONE", timeout=120)
    finally:
        for runner in runners:
            runner.kill()
    assert int(counter.read_text()) == procs * rounds, "lost updates: the lock let two holders in"
    logged = [int(t) for t in tokens.read_text().split()]
    assert len(logged) == procs * rounds
    assert all(a < b for a, b in zip(logged, logged[1:], strict=False)), "tokens are not strictly increasing"


def test_paused_holder_never_believes_it_holds(etcd_url, client):
    ttl = 1
    with agent("hold", url=etcd_url, name="paused", ttl=ttl, every=0.01) as holder:
        holder.expect("HELD", timeout=15)
        holder.stop()
        contender = Mutex(client, "paused", ttl=ttl)
        assert contender.acquire(timeout=ttl + 3)
        resumed_at = time.time()
        holder.cont()
        holder.expect("LOST", timeout=10)
        holder.expect(r"held=False", timeout=10)
        after = [line for line in holder.lines if "held=" in line and walls(line) >= resumed_at]
        assert after and all("held=False" in line for line in after), after
        assert contender.held
        contender.release()


@pytest.mark.slow
def test_etcd_outage_marks_the_lock_lost_before_anyone_can_acquire(own_etcd):
    url = own_etcd.url()
    ttl = 2
    with agent("hold", url=url, name="outage", ttl=ttl, every=0.05) as holder:
        holder.expect("HELD", timeout=15)
        own_etcd.pause()
        try:
            lost = holder.expect("LOST", timeout=ttl + 5)
        finally:
            own_etcd.resume()
        lost_at = walls(lost.string)
        client = connect(url)
        contender = Mutex(client, "outage", ttl=ttl)
        assert contender.acquire(timeout=ttl + 5)
        acquired_at = time.time()
        assert lost_at < acquired_at
        assert all("held=False" in line for line in holder.lines if "held=" in line and walls(line) > lost_at)
        contender.release()


def test_lock_lost_in_a_with_block_raises_on_exit(own_etcd):
    client = connect(own_etcd.url(), retry_max_delay=0.5)
    lost = threading.Event()
    lock = Mutex(client, "block", ttl=1, on_lost=lambda lk: lost.set())
    with pytest.raises(LockLost), lock:
        own_etcd.pause()
        try:
            assert lost.wait(10), "on_lost was not called"
            assert not lock.held
        finally:
            own_etcd.resume()
    with pytest.raises(NotHeld):
        lock.release()


@pytest.mark.slow
def test_survives_etcd_restart(own_etcd):
    url = own_etcd.url()
    with agent("churn", url=url, name="restart", ttl=2, seconds=6) as churner:
        churner.expect("CYCLE", timeout=15)
        own_etcd.restart()
        done = churner.expect(r"DONE cycles=(\d+)", timeout=60)
        assert int(done.group(1)) > 0
    client = connect(url)
    lock = Mutex(client, "restart", ttl=2)
    assert lock.acquire(timeout=10)
    lock.release()


def _requests_served(server) -> int:
    """Requests the server has served so far: gRPC calls (v3, the gateway's included) or v2 HTTP requests."""
    metric = "grpc_server_started_total" if server.api == "v3" else "etcd_http_received_total"
    return sum(int(float(v)) for v in re.findall(rf"^{metric}{{[^}}]*}} (\S+)$", server.metrics(), re.M))


def test_a_skip_costs_one_request_and_names_the_holder_it_saw(own_etcd):
    holding, probing = connect(own_etcd.url(prefix="/skip")), connect(own_etcd.url(prefix="/skip"))
    try:
        holder = Mutex(holding, "busy", ttl=30, data={"task_id": "t-1"})
        assert holder.acquire(timeout=5)
        probe = Mutex(probing, "busy", ttl=30)
        assert not probe.acquire(blocking=False)  # the first one also grants the session's lease (v3)
        before = _requests_served(own_etcd)
        assert not probe.acquire(blocking=False)
        assert _requests_served(own_etcd) - before == 1
        assert probe.conflict is not None
        assert probe.conflict.described() == [
            {"holder": holder.holder, "token": holder.token, "mode": "write", "data": {"task_id": "t-1"}}
        ]
        assert [e.token for e in probing.backend.read_queue(f"{LOCKS}/busy").entries] == [holder.token]
        holder.release()
        assert probe.acquire(blocking=False) and probe.conflict is None
        probe.release()
    finally:
        holding.close()
        probing.close()


def test_a_free_lock_taken_without_waiting_costs_the_fewest_requests(own_etcd):
    client = connect(own_etcd.url(prefix="/free"))
    try:
        warm = Mutex(client, "warm", ttl=30)
        assert warm.acquire(blocking=False)  # the session's lease is granted now (v3), not in the count below
        lock = Mutex(client, "free", ttl=30)
        before = _requests_served(own_etcd)
        assert lock.acquire(blocking=False)
        # v3: one transaction. v2: a look at the queue, then the create; no read after it, since nothing
        # was written between the two
        assert _requests_served(own_etcd) - before == (2 if own_etcd.api == "v2" else 1)
        assert [e.token for e in client.backend.read_queue(lock.queue).entries] == [lock.token]
        lock.release()
        warm.release()
    finally:
        client.close()


def test_a_lost_lock_says_why(own_etcd):
    from celery_etcdlock.cli import force_release

    client = connect(own_etcd.url(prefix="/why"))
    try:
        lost = threading.Event()
        deleted = Mutex(client, "deleted", ttl=3, on_lost=lambda lock: lost.set())
        assert deleted.acquire(timeout=5)
        assert force_release(client, "deleted") == [deleted.token]
        assert lost.wait(10)
        assert deleted.lost_cause == "deleted" and "deleted" in (deleted.lost_reason or "")
        with pytest.raises(LockLost, match="was deleted") as raised:
            deleted.__exit__(None, None, None)
        assert raised.value.cause == "deleted"

        lost.clear()
        late = Mutex(client, "late", ttl=2, on_lost=lambda lock: lost.set())
        assert late.acquire(timeout=5)
        own_etcd.pause()
        try:
            assert lost.wait(10)
        finally:
            own_etcd.resume()
        assert late.lost_cause == "late" and "no renewal succeeded" in (late.lost_reason or "")
        late.release()
    finally:
        client.close()


def test_deadlines_run_on_a_clock_that_counts_suspended_time(client):
    """etcd's clock runs on while a host or VM is suspended; the holder's deadline must too (CLOCK_BOOTTIME)."""
    import sys

    from celery_etcdlock import clock
    from celery_etcdlock.etcd import retry
    from celery_etcdlock.locks import session

    if sys.platform.startswith("linux"):
        assert clock.SUSPEND_AWARE
        assert abs(clock.now() - time.clock_gettime(time.CLOCK_BOOTTIME)) < 1
    assert session.clock is clock and retry.clock is clock  # the session's deadlines and the renewals' budget
    lock = Mutex(client, "suspend", ttl=5)
    assert lock.acquire(timeout=5)
    assert clock.now() < lock._held.lease.deadline <= clock.now() + 5
    lock.release()


def test_a_lock_lost_just_before_its_release_is_reported_lost_once(client, monkeypatch):
    """Released after its deadline passed but before the renewer said so: one LOST report, no RELEASED."""
    from celery_etcdlock import observe
    from celery_etcdlock.etcd.retry import Transient

    seen: list[observe.Event] = []
    observe.subscribe(seen.append)
    hanging, unhang = threading.Event(), threading.Event()
    real_keep_alive = client.backend.keep_alive

    def keep_alive(lease, entries, timeout):  # a black-holed renewal: the renewer is stuck in it
        if entries:
            hanging.set()
            unhang.wait(30)
            raise Transient("black hole", "read timed out")
        return real_keep_alive(lease, entries, timeout)

    monkeypatch.setattr(client.backend, "keep_alive", keep_alive)
    try:
        lock = Mutex(client, "late", ttl=2)
        assert lock.acquire(timeout=5)
        assert hanging.wait(10)
        wait_until(lambda: not lock.held, 10, "the local deadline to pass")
        lock.release()  # before the renewer could say it was lost: the release must say so
        unhang.set()
        wait_until(lambda: not client.session(2.0)._leases, 15, "the renewer to drop the lease")
    finally:
        unhang.set()
        observe.unsubscribe(seen.append)
    kinds = [e.kind for e in seen if e.name == "late" and e.kind in (observe.LOST, observe.RELEASED)]
    assert kinds == [observe.LOST], kinds
