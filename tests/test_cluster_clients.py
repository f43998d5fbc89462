"""Clients of a real 3-member cluster whose first member is cut off from the other two.

A member cut off by a network partition still accepts connections, but never commits a
write or serves a linearizable read: it answers after etcd's own request timeout (5 s plus
two election timeouts) with "request timed out", "no leader" or "context deadline exceeded",
or not at all before the client's timeout. What it still serves at once is what it can
answer alone: a v2 GET without ``quorum=true``, from its stale copy of the keys, and watches
that never fire. These tests check that a client moves to a healthy member on each of
those, and never decides anything on the stale copy:

- a client with a request timeout longer than etcd's takes etcd's answer as "try another member";
- a non-blocking acquire does not believe a cut-off member that still shows an old holder;
- a waiter watching through the cut-off member is woken when the holder releases, not when
  its wait's safety net (twice the TTL) runs out.

Every test runs on one etcd 3.4 cluster (both APIs), member 0 cut off and member 1 leading.
The other reads the primitives make are safe without a linearizable read, and why, is in
docs/reliability.md ("Reads that decide").
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from celery_etcdlock import Mutex, connect
from celery_etcdlock.errors import BackendError
from celery_etcdlock.etcd import retry
from celery_etcdlock.etcd.base import server_ttl
from celery_etcdlock.tasks.dedupe import EnqueueMarkers
from tests.support import EtcdCluster, partition_unsupported, wait_until
from tests.support.cluster import ELECTION_MS

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

CUT, LEADER = 0, 1  # member 0 is cut off; member 1 leads the other two
ETCD_ANSWERS_AFTER = 5 + 2 * ELECTION_MS / 1000  # how long a cut-off member takes to say it cannot commit
BACKOFF = 2.1  # the retry policy's longest pause
SCHEMES = {"v2": "etcd", "v3": "etcd3"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[EtcdCluster]:
    reason = partition_unsupported()
    if reason:
        pytest.skip(reason)
    with EtcdCluster("3.4", enable_v2=True) as started:
        yield started
    assert started.leftover_chains() == []


@pytest.fixture
def cut_off(cluster: EtcdCluster) -> Iterator[EtcdCluster]:
    """The cluster with member 1 leading; the test cuts member 0 off (``cluster.partition(CUT)``); healed after."""
    cluster.heal()
    cluster.move_leader(LEADER)
    yield cluster
    cluster.heal()
    cluster.wait_for_leader()


def url(cluster: EtcdCluster, api: str, prefix: str, first: int = CUT, **options: Any) -> str:
    order = [first] + [i for i in range(3) if i != first]
    return cluster.url(order, scheme=SCHEMES[api], prefix=prefix, **options)


def unique() -> str:
    return f"/clients-{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize("api", list(SCHEMES))
def test_a_client_leaves_a_cut_off_member_on_its_answer_not_only_on_a_timeout(cut_off: EtcdCluster, api: str) -> None:
    """With ``?timeout=`` longer than etcd's own, the cut-off member answers first: the client must move on."""
    prefix = unique()
    cut_off.partition(CUT)
    client = connect(url(cut_off, api, prefix, timeout=ETCD_ANSWERS_AFTER + 2, retry_max_delay=20))
    started = time.monotonic()
    lock = Mutex(client, "moved", ttl=5)
    try:
        acquired = lock.acquire(timeout=30)
    finally:
        seconds = time.monotonic() - started
    assert acquired and lock.held
    # one request answered by etcd after its own timeout, then the next member at once
    assert seconds < 2 * ETCD_ANSWERS_AFTER + BACKOFF, f"took {seconds:.1f}s"
    lock.release()
    client.close()


@pytest.mark.parametrize("api", list(SCHEMES))
def test_a_cut_off_member_that_still_shows_an_old_holder_decides_nothing(cut_off: EtcdCluster, api: str) -> None:
    """A non-blocking acquire must not give up because a cut-off member still lists a holder long gone."""
    prefix = unique()
    healthy = connect(url(cut_off, api, prefix, first=LEADER))
    old = Mutex(healthy, "stale", ttl=30, data={"task_id": "the-old-run"})
    assert old.acquire(timeout=10)
    alone = connect(cut_off.member(CUT).url(scheme=SCHEMES[api], prefix=prefix))  # member 0 only
    wait_until(lambda: Mutex(alone, "stale", ttl=30).holders(), 10, "member 0 to have the holder's entry")
    cut_off.partition(CUT)
    old.release()  # committed by members 1 and 2; member 0 never hears of it
    if api == "v2":  # the stale copy is there to be read: a plain v2 GET on member 0 still shows the old holder
        assert [h["data"] for h in Mutex(alone, "stale", ttl=30).holders()] == [{"task_id": "the-old-run"}]
    alone.close()

    client = connect(url(cut_off, api, prefix, timeout=2))
    lock = Mutex(client, "stale", ttl=30)
    assert lock.acquire(blocking=False), f"gave up, the lock held by {lock.conflict and lock.conflict.described()}"
    lock.release()
    # nor does enqueue deduplication take the old holder for a run still going
    assert EnqueueMarkers(client).claim("stale", "a-new-run", "t", ttl=30) is None
    client.close()
    healthy.close()


@pytest.mark.parametrize("api", list(SCHEMES))
def test_a_waiter_watching_through_a_cut_off_member_wakes_when_the_lock_is_released(
    cut_off: EtcdCluster, api: str
) -> None:
    """The waiter's watch sits on the cut-off member, which never sends the release event.

    Its session notices the member is gone at its next renewal; the watch must then move too,
    rather than wait for its safety net (twice the TTL: 30 s here) to run out.
    """
    ttl = 15  # renewals every server_ttl/3 = 4.7 s, each given that long: the client gives up before etcd answers
    renewal = server_ttl(ttl) / 3
    prefix = unique()
    holder = Mutex(connect(url(cut_off, api, prefix, first=LEADER)), "woken", ttl=ttl)
    assert holder.acquire(timeout=10)
    waiter = Mutex(connect(url(cut_off, api, prefix, timeout=2)), "woken", ttl=ttl)
    waiting = threading.Event()
    outcome: dict[str, Any] = {}

    def wait() -> None:
        outcome["acquired"] = waiter.acquire(timeout=60, on_wait=lambda state: waiting.set())
        outcome["at"] = time.monotonic()

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    assert waiting.wait(10), "the waiter never queued"
    time.sleep(0.5)  # its watch is open on member 0
    cut_off.partition(CUT)
    released = time.monotonic()
    holder.release()
    thread.join(60)
    assert outcome.get("acquired") is True
    woken = outcome["at"] - released
    # its next renewal times out (up to one renewal period, then one renewal's wait), then a watch elsewhere
    assert woken < 2 * renewal + BACKOFF + 1, f"woken {woken:.1f}s after the release (safety net: {2 * ttl}s)"
    waiter.release()


def test_a_renewal_that_a_resumed_old_leader_answers_alone_does_not_count(cluster: EtcdCluster) -> None:
    """etcd-io/etcd#15247 (etcd before 3.5.13 / 3.4.31), seen from our client: see Etcd3Backend.keep_alive.

    A leader frozen past a lease's TTL, once resumed, answers a keep-alive "renewed" from its own
    lessor while the real leader lets the lease lapse (tests/test_servers.py shows it without our
    code). Our keep-alive, through that member alone, must either fail (the confirming read in the
    same raft term cannot succeed) or be a renewal the cluster really made.
    """
    cluster.heal()
    healthy, old = cluster.member(LEADER), cluster.member(CUT)
    refused = 0
    for _attempt in range(3):
        cluster.move_leader(CUT)
        client = connect(old.url(scheme="etcd3", prefix=f"/renewal-{uuid.uuid4().hex[:8]}", timeout=2))
        try:
            lease = client.backend.grant(3)  # etcd grants server_ttl(3) = 2 s
            lease_id = str(lease.lease_id)  # type: ignore[attr-defined]
            old.pause()
            try:
                cluster.wait_for_leader(other_than=CUT)
                until = time.monotonic() + 3  # past the TTL: the frozen leader's lessor deems the lease expired
                while time.monotonic() < until:  # meanwhile the real leader keeps it alive (an error: next time)
                    healthy.v3("lease/keepalive", {"ID": lease_id}, timeout=1)
                    time.sleep(0.25)
                time.sleep(0.6)  # its last real renewal is now well before the one asked below
            finally:
                old.resume()
            asked = time.monotonic()
            try:
                client.backend.keep_alive(lease, [], timeout=2)
            except (retry.Transient, BackendError):
                refused += 1
                continue
            if lease.expired:  # an honest "gone": nothing was counted as renewed
                continue
            # counted as renewed at `asked`: the cluster must keep the lease for the 2 s granted from then
            while time.monotonic() < asked + 1.9:
                status, reply = healthy.v3("kv/lease/timetolive", {"ID": lease_id}, timeout=2)
                # a member between leaders answers an error: only an answer counts
                assert status != 200 or int(reply.get("TTL", -1)) >= 0, "a renewal counted that the cluster never made"
                time.sleep(0.02)
        finally:
            client.close()
            cluster.wait_for_leader()
    assert refused, "the resumed old leader never answered alone in 3 tries: is this etcd 3.5.13+ / 3.4.31+?"
