"""The contract: how the primitives and the backend interface behave, on memory://, etcd:// and etcd3://.

Every test here runs on each backend, through the ``any_client`` fixture:

- ``[memory]``: the in-process backend (``memory://``, a namespace of the test's own);
- ``[v2-3.4]``, ``[v2-3.5]``: the v2 keys API (``etcd://``) of etcd 3.4 and 3.5 (--enable-v2);
- ``[v3-3.5]``, ``[v3-3.6]``, ``[v3-3.7]``: the v3 API (``etcd3://``) of each release line.

(``ETCDLOCK_TEST_ETCD=3.4,3.7`` narrows the etcd kinds.)

So memory:// cannot drift from etcd: whatever a user's test proves on it, etcd
does too. The tests are in-process (threads, several clients) because
memory:// lives in one process; crashes, pauses and server faults need real
processes and a real server, and stay in the per-primitive modules.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from celery_etcdlock import Client, Election, InvalidUse, LeaderEvent, LimitMismatch, Mutex, NotHeld, RWLock, connect
from celery_etcdlock.etcd.base import Entry, LeaseExpired, WaitResult
from celery_etcdlock.etcd.retry import Transient
from celery_etcdlock.keys import ELECTIONS, LOCKS, SEMAPHORES, encode_name, queue_key
from celery_etcdlock.locks.semaphore import Semaphore
from tests.support import etcd_versions, wait_until

# memory:// and every etcd test kind (v2-3.4 ... v3-3.7) that ETCDLOCK_TEST_ETCD selects
BACKENDS = ("memory", *(k.name for k in etcd_versions.selected_kinds(["v2", "v3"], every=True)))
V3_BACKENDS = [b for b in BACKENDS if not b.startswith("v2")]


@pytest.fixture(params=BACKENDS)
def any_client(request: pytest.FixtureRequest) -> Iterator[Client]:
    """A client with keys of this test's own, on memory://, or etcd:// or etcd3:// of an etcd kind."""
    name = f"contract-{uuid.uuid4().hex[:10]}"
    if request.param == "memory":
        url = f"memory://{name}"
    else:
        server = request.getfixturevalue("etcd_kind_servers")(etcd_versions.KINDS[request.param])
        url = server.url(prefix=f"/{name}")
    client = connect(url)
    yield client
    client.close()


@pytest.fixture
def another_client(any_client: Client) -> Iterator[Client]:
    """A second client on the same keys, as another process would have."""
    client = connect(any_client.options.url)
    yield client
    client.close()


def queued(client: Client, namespace: str = LOCKS) -> int:
    return sum(map(len, client.backend.list_queues(namespace).values()))


def start(target: Callable[[], Any]) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def renewals_fail(client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on every renewal of ``client`` fails, as if its server had stopped answering it."""

    def keep_alive(lease: Any, entries: list[Entry], timeout: float) -> set[str]:
        raise Transient("test", "no answer")

    monkeypatch.setattr(client.backend, "keep_alive", keep_alive)


# -- mutex ------------------------------------------------------------------------------------------


def test_acquire_release_and_token(any_client: Client) -> None:
    lock = Mutex(any_client, "reports/daily", ttl=5)
    assert not lock.held and lock.token is None
    assert lock.acquire()
    assert lock.held and isinstance(lock.token, int)
    first = lock.token
    assert lock.holders() == [{"holder": lock.holder, "token": first, "mode": "write", "data": {}}]
    lock.release()
    assert not lock.held
    assert lock.holders() == []
    with Mutex(any_client, "reports/daily", ttl=5) as again:
        assert again.token is not None and again.token > first


def test_a_second_lock_waits_and_times_out(any_client: Client) -> None:
    with Mutex(any_client, "x", ttl=5):
        other = Mutex(any_client, "x", ttl=5)
        assert other.acquire(blocking=False) is False
        assert other.acquire(timeout=0.3) is False
        assert not other.held
    assert other.acquire(timeout=5)
    other.release()


def test_a_timed_out_waiter_leaves_no_entry(any_client: Client) -> None:
    holder = Mutex(any_client, "x", ttl=5)
    holder.acquire()
    assert not Mutex(any_client, "x", ttl=5).acquire(timeout=0.2)
    assert [len(entries) for entries in any_client.backend.list_queues(LOCKS).values()] == [1]
    holder.release()


def test_release_errors_and_no_reentry(any_client: Client) -> None:
    lock = Mutex(any_client, "x", ttl=5)
    with pytest.raises(NotHeld):
        lock.release()
    with lock, pytest.raises(InvalidUse, match="not reentrant"):
        lock.acquire()
    with pytest.raises(NotHeld):
        lock.release()


def test_threads_exclude_each_other_and_tokens_grow(any_client: Client) -> None:
    inside, overlaps, turns = 0, [], []

    def work() -> None:
        nonlocal inside
        lock = Mutex(any_client, "shared", ttl=5)
        for _ in range(5):
            with lock:
                inside += 1
                overlaps.append(inside)
                turns.append(lock.token)
                time.sleep(0.002)
                inside -= 1

    threads = [start(work) for _ in range(4)]
    for thread in threads:
        thread.join(60)
    assert len(turns) == 20
    assert max(overlaps) == 1
    assert turns == sorted(turns) and len(set(turns)) == 20


def test_waiters_are_served_in_arrival_order(any_client: Client) -> None:
    holder = Mutex(any_client, "fifo", ttl=5)
    holder.acquire()
    order: list[int] = []
    threads = []
    for i in range(5):
        lock = Mutex(any_client, "fifo", ttl=5)

        def wait(i: int = i, lock: Mutex = lock) -> None:
            with lock:
                order.append(i)

        threads.append(start(wait))
        wait_until(lambda i=i: queued(any_client) == i + 2, 10, f"waiter {i} to queue")  # one at a time
    holder.release()
    for thread in threads:
        thread.join(30)
    assert order == [0, 1, 2, 3, 4]


def test_names_map_to_their_own_keys(any_client: Client) -> None:
    names = ["a/b", "a", "..", "../..", "a b", "é/ü", "~2F", "a~2Fb"]
    locks = [Mutex(any_client, n, ttl=5) for n in names]
    for lock in locks:
        assert lock.acquire(blocking=False), lock.name
    queues = any_client.backend.list_queues(LOCKS)
    assert sorted(queues) == sorted(f"{LOCKS}/{encode_name(n)}" for n in names)
    for key in queues:
        assert re.fullmatch(r"locks/[A-Za-z0-9_~-]+", key), key
    for lock in locks:
        lock.release()


def test_closing_a_client_frees_its_locks_at_once(any_client: Client, another_client: Client) -> None:
    held = Mutex(another_client, "x", ttl=30)
    assert held.acquire(timeout=5)
    another_client.close()
    assert not held.held
    assert Mutex(any_client, "x", ttl=30).acquire(timeout=10), "waited for the 30 s TTL instead"


def test_release_never_deletes_another_holders_lock(any_client: Client) -> None:
    first = Mutex(any_client, "x", ttl=5)
    first.acquire()
    for entries in any_client.backend.list_queues(LOCKS).values():  # an operator force-releases it
        for entry in entries:
            assert any_client.backend.delete_entry(entry)
    second = Mutex(any_client, "x", ttl=5)
    assert second.acquire(timeout=5)
    first.release()
    assert second.held
    assert second.holders()[0]["token"] == second.token
    second.release()


def test_a_lock_whose_key_is_deleted_is_lost_and_on_lost_may_release_it(any_client: Client) -> None:
    released, causes = threading.Event(), []

    def on_lost(lock: Mutex) -> None:
        causes.append(lock.lost_cause)
        lock.release()  # on_lost runs outside the session's locks: this must not deadlock
        released.set()

    lock = Mutex(any_client, "callback", ttl=1, on_lost=on_lost)
    lock.acquire()
    for entries in any_client.backend.list_queues(LOCKS).values():
        for entry in entries:
            any_client.backend.delete_entry(entry)
    assert released.wait(10), "the next renewal did not notice the deleted key"
    assert not lock.held and causes == ["deleted"]


def test_on_lost_runs_on_the_renewer_thread_for_a_loss_another_thread_saw(any_client: Client) -> None:
    told: list[str] = []
    lock = Mutex(any_client, "told", ttl=5, on_lost=lambda lock: told.append(threading.current_thread().name))
    lock.acquire()
    lock.forfeit("its key was seen deleted")
    assert not lock.held
    wait_until(lambda: told, 10, "on_lost")
    assert told == ["etcdlock-renewer-5s"]
    lock.release()


@pytest.mark.slow_but_newest
def test_locks_taken_at_once_by_many_threads_all_stay_exclusive(any_client: Client, another_client: Client) -> None:
    ttl, names = 2, [f"burst-{i}" for i in range(6)]
    barrier = threading.Barrier(len(names), timeout=20)
    held: dict[str, Mutex] = {}

    def take(name: str) -> None:
        lock = Mutex(any_client, name, ttl=ttl)
        barrier.wait()
        lock.acquire()
        held[name] = lock

    for thread in [start(lambda n=n: take(n)) for n in names]:
        thread.join(30)
    assert sorted(held) == names
    results: dict[str, bool] = {}

    def contend(name: str) -> None:
        results[name] = Mutex(another_client, name, ttl=ttl).acquire(timeout=2 * ttl)

    for thread in [start(lambda n=n: contend(n)) for n in names]:
        thread.join(30)
    assert results == {n: False for n in names}, "a lock was taken while its holder still held it"
    assert all(lock.held for lock in held.values())
    for lock in held.values():
        lock.release()


# not v2: its entries have TTLs of their own, and one nobody refreshes expires by itself
@pytest.mark.parametrize("any_client", V3_BACKENDS, indirect=True)
def test_a_key_left_on_a_live_lease_is_cleaned_up(any_client: Client) -> None:
    keeper = Mutex(any_client, "keeper", ttl=2)
    keeper.acquire()  # keeps the session's lease alive throughout
    session = any_client.session(2.0)
    lease = next(lease.handle for lease in session._leases if lease.skeys)
    any_client.backend.join_queue(f"{LOCKS}/{encode_name('orphaned')}", {"mode": "write"}, lease)
    late = Mutex(any_client, "orphaned", ttl=2)
    assert late.acquire(timeout=10), "the stray entry kept blocking the queue"
    late.release()
    assert keeper.held
    keeper.release()


def test_cancel_makes_a_waiting_acquire_give_up(any_client: Client) -> None:
    holder = Mutex(any_client, "cancel", ttl=5)
    holder.acquire()
    waiter = Mutex(any_client, "cancel", ttl=5)
    outcome: list[bool] = []
    thread = start(lambda: outcome.append(waiter.acquire(timeout=60)))
    wait_until(lambda: queued(any_client) == 2, 10, "the waiter to queue")
    waiter.cancel()
    wait_until(lambda: queued(any_client) == 1, 5, "the cancelled entry to go")  # before the waiter notices
    holder.release()
    thread.join(30)
    assert outcome == [False] and not waiter.held


def test_a_skip_always_means_someone_held_the_lock(any_client: Client) -> None:
    """Racing non-blocking probes around a release: whenever a probe started after the release, one acquired."""
    for round_ in range(30):
        holder = Mutex(any_client, "race", ttl=10)
        assert holder.acquire(timeout=5)
        barrier = threading.Barrier(7)
        results: list[tuple[float, bool, Mutex]] = []
        results_lock = threading.Lock()

        def probe(i: int, barrier: threading.Barrier = barrier, results: list = results, guard=results_lock) -> None:
            lock = Mutex(any_client, "race", ttl=10)
            barrier.wait()
            for _ in range(i * 150):  # spread the probes around the release without sleeping
                pass
            began = time.monotonic()
            took = lock.acquire(blocking=False)
            with guard:
                results.append((began, took, lock))

        threads = [start(lambda i=i: probe(i)) for i in range(6)]
        barrier.wait()
        holder.release()
        released_at = time.monotonic()
        for thread in threads:
            thread.join(30)
        winners = [lock for _, took, lock in results if took]
        assert len(winners) <= 1, f"round {round_}: {len(winners)} probes hold the lock at once"
        assert winners or not [b for b, _, _ in results if b > released_at], f"round {round_}: all skipped"
        for lock in winners:
            lock.release()
        assert any_client.backend.read_queue(f"{LOCKS}/race").entries == [], "a probe left an entry behind"


# -- TTLs ---------------------------------------------------------------------------------------------


@pytest.mark.slow_but_newest
def test_a_holder_that_cannot_renew_steps_down_before_another_takes_over(
    any_client: Client, another_client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    ttl = 2
    lost_at: list[float] = []
    holder = Mutex(another_client, "expiring", ttl=ttl, on_lost=lambda lock: lost_at.append(time.monotonic()))
    assert holder.acquire(timeout=5)
    renewals_fail(another_client, monkeypatch)
    stopped = time.monotonic()
    contender = Mutex(any_client, "expiring", ttl=ttl)
    assert contender.acquire(timeout=ttl + 3), "the lock of a holder that stopped renewing was not freed"
    acquired_at = time.monotonic()
    assert lost_at and lost_at[0] < acquired_at, "the old holder still believed it held the lock"
    assert not holder.held and holder.lost_cause == "late"
    assert acquired_at - stopped <= ttl + 1.5
    contender.release()


@pytest.mark.slow_but_newest
def test_a_waiter_may_wait_far_longer_than_its_ttl(any_client: Client) -> None:
    ttl = 1
    rw = RWLock(any_client, "patience", ttl=ttl)
    acquired = threading.Event()
    writer = rw.write()
    with rw.read():
        thread = start(lambda: writer.acquire(timeout=60) and acquired.set())
        wait_until(lambda: queued(any_client) == 2, 10, "the writer to queue")
        assert not acquired.wait(4 * ttl)  # its entry, renewed like a held one, must stay queued
        assert queued(any_client) == 2
    assert acquired.wait(10)
    thread.join(10)
    writer.release()


@pytest.mark.slow_but_newest
def test_an_entry_that_is_not_kept_alive_expires_and_its_waiter_wakes(any_client: Client) -> None:
    backend = any_client.backend
    entry, snapshot = backend.join_queue("locks/q", {"mode": "write"}, backend.grant(1.5))  # server TTL 1 s
    started = time.monotonic()
    assert backend.wait_gone(entry, snapshot.revision, timeout=30) is WaitResult.GONE
    assert time.monotonic() - started <= 4  # etcd 3.5 raises a 1 s lease to its minimum, 2 s, then expires it late
    assert backend.read_queue("locks/q").entries == []


# -- the backend interface ----------------------------------------------------------------------------


def test_entries_in_creation_order_with_growing_tokens(any_client: Client) -> None:
    backend = any_client.backend
    lease = backend.grant(30)
    entries = [backend.join_queue("locks/q", {"mode": "write", "i": i}, lease)[0] for i in range(3)]
    snapshot = backend.read_queue("locks/q")
    assert snapshot.entries == entries
    assert [e.value["i"] for e in snapshot.entries] == [0, 1, 2]
    assert [e.token for e in entries] == sorted({e.token for e in entries})
    assert snapshot.revision >= entries[-1].token
    assert backend.delete_entry(entries[0]) is True
    assert backend.delete_entry(entries[0]) is False  # guarded: only the entry we created, once
    assert backend.read_queue("locks/q").entries == entries[1:]
    backend.revoke(lease, entries[1:])
    assert backend.read_queue("locks/q").entries == []


def test_list_queues_gives_each_queue_its_entries_and_their_time_left(any_client: Client) -> None:
    backend = any_client.backend
    lease = backend.grant(30)
    a1 = backend.join_queue("locks/a", {"n": 1}, lease)[0]
    b1 = backend.join_queue("locks/b", {"n": 2}, lease)[0]
    a2 = backend.join_queue("locks/a", {"n": 3}, lease)[0]
    backend.join_queue("elections/a", {}, lease)
    backend.put_record("locks/a/deeper/not-an-entry", {}, expect=None)
    queues = backend.list_queues("locks")
    assert queues == {"locks/a": [a1, a2], "locks/b": [b1]}
    ttls = [entry.ttl for entries in queues.values() for entry in entries]
    assert all(ttl is not None and 0 < ttl <= 30 for ttl in ttls), ttls
    assert backend.list_queues("nothing") == {}
    backend.revoke(lease, [a1, b1, a2])


def test_join_if_empty_creates_only_in_an_empty_queue(any_client: Client) -> None:
    backend = any_client.backend
    lease = backend.grant(30)
    first, snapshot = backend.join_queue_if_empty("locks/q", {"mode": "write"}, lease)
    assert first is not None and snapshot.entries == [first]
    second, snapshot = backend.join_queue_if_empty("locks/q", {"mode": "write"}, lease)
    assert second is None and snapshot.entries == [first]
    backend.revoke(lease, [first])


def test_wait_gone(any_client: Client) -> None:
    backend = any_client.backend
    lease = backend.grant(30)
    first, _ = backend.join_queue("locks/q", {}, lease)
    other, snapshot = backend.join_queue("locks/q", {}, lease)
    backend.delete_entry(other)  # a change to another key does not wake a wait for this one
    assert backend.wait_gone(first, snapshot.revision, timeout=0.5) is WaitResult.TIMEOUT
    assert backend.wait_gone(first, snapshot.revision, timeout=0) is WaitResult.TIMEOUT
    results: list[WaitResult] = []
    waiting = start(lambda: results.append(backend.wait_gone(first, snapshot.revision, timeout=60)))
    time.sleep(0.2)  # let the wait begin (if it has not yet, it finds the key gone: the same answer)
    backend.delete_entry(first)
    waiting.join(30)
    assert results == [WaitResult.GONE]
    assert backend.wait_gone(first, snapshot.revision, timeout=30) is WaitResult.GONE  # deleted before the wait
    assert backend.wait_any_gone([first, other], snapshot.revision, timeout=30) is WaitResult.GONE


def test_keep_alive_reports_entries_deleted_behind_its_back(any_client: Client) -> None:
    backend = any_client.backend
    lease = backend.grant(30)
    kept, _ = backend.join_queue("locks/q", {}, lease)
    deleted, _ = backend.join_queue("locks/r", {}, lease)
    backend.delete_entry(deleted)
    assert backend.keep_alive(lease, [kept, deleted], timeout=5) == {deleted.key}
    backend.revoke(lease, [kept])


# not v2: it has no shared leases, each entry has a TTL of its own
@pytest.mark.parametrize("any_client", V3_BACKENDS, indirect=True)
def test_a_dead_lease_takes_no_entry(any_client: Client) -> None:
    backend = any_client.backend
    lease = backend.grant(30)
    backend.revoke(lease, [])
    assert lease.expired
    with pytest.raises(LeaseExpired):
        backend.join_queue("locks/q", {}, lease)
    assert backend.keep_alive(lease, [], timeout=5) == set()
    assert backend.read_queue("locks/q").entries == []


# -- records (compare-and-swap) -------------------------------------------------------------------------


def test_records_are_written_by_compare_and_swap(any_client: Client) -> None:
    backend = any_client.backend
    assert backend.get_record("records/k/a") is None
    created = backend.put_record("records/k/a", {"n": 1}, expect=None)
    assert created is not None and created.value == {"n": 1} and created.ttl is None
    assert backend.get_record("records/k/a") == created
    assert backend.put_record("records/k/a", {"n": 2}, expect=None) is None  # exists already
    updated = backend.put_record("records/k/a", {"n": 2}, expect=created)
    assert updated is not None and updated.version > created.version
    assert backend.put_record("records/k/a", {"n": 3}, expect=created) is None  # a stale version
    assert backend.get_record("records/k/a") == updated
    assert backend.delete_record("records/k/a", expect=created) is False
    assert backend.delete_record("records/k/a", expect=updated) is True
    assert backend.delete_record("records/k/a") is False
    assert backend.put_record("records/k/a", {"n": 4}, expect=updated) is None  # gone
    assert backend.put_record("records/k/a", {"n": 5}, expect=None) is not None
    assert backend.delete_record("records/k/a") is True


# not v2: it cannot compare another key in a write, so its callers make the record its own fence
@pytest.mark.parametrize("any_client", V3_BACKENDS, indirect=True)
def test_a_fenced_write_fails_once_the_fence_is_gone(any_client: Client) -> None:
    backend = any_client.backend
    lease = backend.grant(30)
    leader, _ = backend.join_queue("elections/beat", {"holder": "a"}, lease)
    record = backend.put_record("records/beat/s", {"n": 1}, expect=None, fence=leader)
    assert record is not None
    successor, _ = backend.join_queue("elections/beat", {"holder": "b"}, lease)
    backend.delete_entry(leader)  # deposed
    assert backend.put_record("records/beat/s", {"n": 2}, expect=record, fence=leader) is None
    assert backend.get_record("records/beat/s") == record
    assert backend.put_record("records/beat/s", {"n": 2}, expect=record, fence=successor) is not None
    backend.revoke(lease, [successor])


@pytest.mark.slow_but_newest
def test_a_record_with_a_ttl_expires(any_client: Client) -> None:
    backend = any_client.backend
    record = backend.put_record("records/markers/m", {"task": "t"}, expect=None, ttl=1)
    assert record is not None and record.ttl == 1
    found = backend.get_record("records/markers/m")
    assert found is not None and found.ttl is not None and 0 <= found.ttl <= 2
    assert backend.get_record("records/markers/other") is None
    wait_until(lambda: backend.get_record("records/markers/m") is None, 10, "the record to expire")


# -- read-write lock ---------------------------------------------------------------------------------


def test_readers_share_and_a_writer_excludes_everyone(any_client: Client) -> None:
    rw = RWLock(any_client, "index", ttl=5)
    readers = [rw.read() for _ in range(3)]
    for reader in readers:
        assert reader.acquire(timeout=5)
    assert len(readers[0].holders()) == 3
    assert not rw.write().acquire(timeout=0.2)
    for reader in readers:
        reader.release()
    with rw.write() as writer:
        assert writer.held
        assert not rw.read().acquire(timeout=0.2)
        assert not rw.write().acquire(timeout=0.2)
        assert not Mutex(any_client, "index", ttl=5).acquire(blocking=False)  # a Mutex is the write side


def test_a_reader_after_a_queued_writer_waits_for_it(any_client: Client) -> None:
    rw = RWLock(any_client, "fair", ttl=5)
    first_reader = rw.read()
    first_reader.acquire()
    order: list[str] = []
    writer, late_reader = rw.write(), rw.read()

    def run(lock: Any, label: str) -> None:
        with lock:
            order.append(label)

    tw = start(lambda: run(writer, "writer"))
    wait_until(lambda: queued(any_client) == 2, 10, "the writer to queue")
    tr = start(lambda: run(late_reader, "late reader"))
    wait_until(lambda: queued(any_client) == 3, 10, "the late reader to queue")
    assert not late_reader.held  # readers hold now, but this one must not leapfrog the writer
    first_reader.release()
    tw.join(20)
    tr.join(20)
    assert order == ["writer", "late reader"]


def test_readers_behind_a_writer_proceed_together(any_client: Client) -> None:
    rw = RWLock(any_client, "batch", ttl=5)
    writer = rw.write()
    writer.acquire()
    all_in = threading.Barrier(3, timeout=20)
    results: list[int | None] = []

    def read(lock: Any) -> None:
        with lock:
            all_in.wait()  # fails unless all three hold at once
            results.append(lock.token)

    threads = [start(lambda r=r: read(r)) for r in [rw.read() for _ in range(3)]]
    wait_until(lambda: queued(any_client) == 4, 10, "the readers to queue")
    writer.release()
    for thread in threads:
        thread.join(30)
    assert len(results) == 3


# -- semaphore -----------------------------------------------------------------------------------------


def test_semaphore_holders_tokens_and_a_free_slot(any_client: Client) -> None:
    slots = [Semaphore(any_client, "s", limit=3, ttl=5) for _ in range(4)]
    for slot in slots[:3]:
        assert slot.acquire(blocking=False)
    tokens = [slot.token for slot in slots[:3]]
    assert tokens == sorted(tokens) and len(set(tokens)) == 3
    assert not slots[3].acquire(blocking=False)
    assert slots[3].conflict is not None and [h["token"] for h in slots[3].conflict.described()] == tokens
    assert [h["token"] for h in slots[0].holders()] == tokens
    slots[1].release()  # the middle one: a slot is free although the oldest holder stays
    assert slots[3].acquire(blocking=False)
    assert slots[3].token is not None and slots[3].token > max(tokens)
    for slot in (slots[0], slots[2], slots[3]):
        slot.release()
    assert any_client.backend.list_queues(SEMAPHORES) == {}


def test_semaphore_lets_at_most_limit_threads_in(any_client: Client) -> None:
    limit, inside, most, runs, guard = 2, 0, 0, 0, threading.Lock()

    def work() -> None:
        nonlocal inside, most, runs
        slot = Semaphore(any_client, "pool", limit=limit, ttl=5)
        for _ in range(4):
            with slot:
                with guard:
                    inside += 1
                    most, runs = max(most, inside), runs + 1
                time.sleep(0.005)  # work inside the slot: lets the others pile up behind the limit
                with guard:
                    inside -= 1

    for thread in [start(work) for _ in range(5)]:
        thread.join(60)
    assert runs == 20
    assert most <= limit, f"{most} threads were inside a semaphore of {limit}"


def test_a_semaphore_waiter_takes_whichever_slot_frees_first(any_client: Client) -> None:
    long, short = Semaphore(any_client, "w", limit=2, ttl=5), Semaphore(any_client, "w", limit=2, ttl=5)
    assert long.acquire(timeout=5) and short.acquire(timeout=5)
    waiter = Semaphore(any_client, "w", limit=2, ttl=5)
    taken = threading.Event()
    thread = start(lambda: waiter.acquire(timeout=30) and taken.set())
    wait_until(lambda: queued(any_client, SEMAPHORES) == 3, 10, "the waiter to queue")
    short.release()
    assert taken.wait(10), "the waiter slept while a slot was free"
    assert long.held and waiter.held
    thread.join(10)
    long.release()
    waiter.release()


def test_semaphore_waiters_are_served_in_arrival_order(any_client: Client) -> None:
    holders = [Semaphore(any_client, "fifo", limit=2, ttl=5) for _ in range(2)]
    for holder in holders:
        assert holder.acquire(timeout=5)
    waiters = [Semaphore(any_client, "fifo", limit=2, ttl=5) for _ in range(4)]
    took = [threading.Event() for _ in waiters]
    threads = []
    for i, waiter in enumerate(waiters):
        threads.append(start(lambda w=waiter, e=took[i]: w.acquire(timeout=60) and e.set()))
        wait_until(lambda n=i: queued(any_client, SEMAPHORES) == 3 + n, 10, f"waiter {i} to queue")
    leaving = [*holders, *waiters]
    for i in range(len(waiters)):
        leaving[i].release()  # frees one slot: the i-th waiter, and no later one, takes it
        assert took[i].wait(10), f"waiter {i} was not let in"
        assert not any(event.is_set() for event in took[i + 1 :]), f"a waiter behind {i} overtook it"
    for thread in threads:
        thread.join(10)
    for waiter in waiters[-2:]:
        waiter.release()


def test_a_different_semaphore_limit_is_refused(any_client: Client) -> None:
    three = Semaphore(any_client, "limited", limit=3, ttl=5)
    assert three.acquire(timeout=5)
    four = Semaphore(any_client, "limited", limit=4, ttl=5)
    for attempt in (lambda: four.acquire(blocking=False), lambda: four.acquire(timeout=5)):
        with pytest.raises(LimitMismatch, match="has limit 3 .*not 4") as raised:
            attempt()
        assert isinstance(raised.value, ValueError) and (raised.value.limit, raised.value.asked) == (3, 4)
    assert queued(any_client, SEMAPHORES) == 1  # the refused one left nothing
    three.release()
    assert four.acquire(blocking=False)
    four.release()


# -- election --------------------------------------------------------------------------------------------


def election_queue(client: Client, name: str) -> int:
    return len(client.backend.read_queue(queue_key(ELECTIONS, name)).entries)


def test_campaign_resign_and_leader(any_client: Client) -> None:
    a = Election(any_client, "svc", identity="a", ttl=5)
    b = Election(any_client, "svc", identity="b", ttl=5)
    assert a.leader() is None
    assert a.campaign(timeout=5)
    assert a.is_leader and a.token is not None
    first = a.token
    assert b.leader() == "a"
    assert not b.campaign(timeout=0.3)
    a.resign()
    assert not a.is_leader and a.token is None
    assert b.campaign(timeout=5)
    assert b.token is not None and b.token > first
    assert a.leader() == b.leader() == "b"
    b.resign()


def test_election_events(any_client: Client) -> None:
    a = Election(any_client, "ev", identity="a", ttl=5)
    b = Election(any_client, "ev", identity="b", ttl=5)
    a.start()
    events_a = a.events()
    assert next(events_a) == LeaderEvent("elected", "a")
    b.start()
    events_b = b.events()
    assert next(events_b) == LeaderEvent("changed", "a")
    wait_until(lambda: election_queue(any_client, "ev") == 2, 10, "b to queue")
    a.stop()  # resigns: b leads at once
    assert list(events_a) == []
    assert next(events_b) == LeaderEvent("elected", "b")
    b.stop()
    assert list(events_b) == []


def test_a_resigned_leader_campaigns_again(any_client: Client) -> None:
    a = Election(any_client, "again", identity="a", ttl=5)
    b = Election(any_client, "again", identity="b", ttl=5)
    a.start()
    events = a.events()
    assert next(events) == LeaderEvent("elected", "a")
    b.start()
    wait_until(lambda: election_queue(any_client, "again") == 2, 10, "b to queue")
    a.resign()
    assert next(events) == LeaderEvent("changed", "b")
    wait_until(lambda: election_queue(any_client, "again") == 2, 10, "a to queue again")
    b.stop()
    assert next(events) == LeaderEvent("elected", "a")
    a.stop()


def test_a_leader_whose_key_is_deleted_is_deposed_at_once(any_client: Client) -> None:
    a = Election(any_client, "forced", identity="a", ttl=30)  # a renewal would notice only after 10 s
    a.start()
    events = a.events()
    assert next(events) == LeaderEvent("elected", "a")
    for entries in any_client.backend.list_queues(ELECTIONS).values():
        for entry in entries:
            any_client.backend.delete_entry(entry)
    assert next(events) == LeaderEvent("deposed", None)
    following = next(events)
    if following == LeaderEvent("changed", None):  # the observer may see the empty queue in between
        following = next(events)
    assert following == LeaderEvent("elected", "a")
    a.stop()


def test_a_leader_that_cannot_renew_is_deposed_before_another_is_elected(
    any_client: Client, another_client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    ttl = 2
    old = Election(another_client, "cluster", identity="old", ttl=ttl)
    new = Election(any_client, "cluster", identity="new", ttl=ttl)
    deposed_at: list[float] = []
    tell_old = old._lock.on_lost
    assert tell_old is not None
    old._lock.on_lost = lambda lock: (deposed_at.append(time.monotonic()), tell_old(lock))
    old.start()
    old_events = old.events()
    assert next(old_events) == LeaderEvent("elected", "old")
    renewals_fail(another_client, monkeypatch)
    assert new.campaign(timeout=ttl + 3), "the silent leader was not replaced"
    elected_at = time.monotonic()
    assert deposed_at and deposed_at[0] < elected_at, "the old leader still led when the new one was elected"
    assert not old.is_leader
    assert next(old_events) == LeaderEvent("deposed", None)
    assert new.leader() == "new"
    new.resign()
    monkeypatch.undo()
    old.stop()


def queue_order(client: Client, name: str) -> list[str | None]:
    """The identities of an election's candidates, in queue order (the leader first)."""
    return [
        e.value.get("data", {}).get("identity") for e in client.backend.read_queue(queue_key(ELECTIONS, name)).entries
    ]


def test_election_followers_lead_in_queue_order_and_a_waiting_resigner_queues_again_at_once(any_client: Client) -> None:
    # ttl 30: a waiting campaign that noticed its resign() only at its safety-net timeout would queue again after 60 s
    a, b, c = (Election(any_client, "order", identity=i, ttl=30) for i in "abc")
    try:
        a.start()
        events_a = a.events()
        assert next(events_a) == LeaderEvent("elected", "a")
        first = a.token
        for node in (b, c):
            node.start()
            wait_until(lambda node=node: queue_order(any_client, "order")[-1] == node.identity, 10, "it to queue")
        b.resign()  # b waits behind a, c behind b: b leaves and queues again, behind c
        wait_until(lambda: queue_order(any_client, "order") == ["a", "c", "b"], 10, "b to queue again, behind c")
        a.stop()  # c, not b, leads next: it queued first
        events_c = c.events()
        assert next(events_c) == LeaderEvent("changed", "a")
        assert next(events_c) == LeaderEvent("elected", "c")
        assert c.is_leader and not b.is_leader and b.leader() == "c"
        assert first is not None and c.token is not None and c.token > first
        second = c.token
        c.stop()
        wait_until(lambda: b.is_leader, 10, "b to lead")
        assert b.token is not None and b.token > second
    finally:
        for node in (a, b, c):
            node.stop()


def test_one_leader_among_many_threads(any_client: Client) -> None:
    elections = [Election(any_client, "many", identity=f"node-{i}", ttl=5) for i in range(4)]
    for election in elections:
        election.start()
    try:
        wait_until(lambda: sum(e.is_leader for e in elections) == 1, 20, "one leader")
        (leader,) = [e for e in elections if e.is_leader]
        assert all(e.leader() == leader.identity for e in elections)
    finally:
        for election in elections:
            election.stop()


# -- records under a prefix: listed and watched (runtime beat entries) -------------------------------


def test_read_records_lists_a_prefix_at_one_revision(any_client: Client) -> None:
    backend = any_client.backend
    assert backend.read_records("records/listed").records == {}
    a = backend.put_record("records/listed/a", {"n": 1}, expect=None)
    b = backend.put_record("records/listed/deeper/b", {"n": 2}, expect=None)
    backend.put_record("records/listed-not/c", {"n": 3}, expect=None)  # a sibling prefix, not under it
    assert a is not None and b is not None
    found = backend.read_records("records/listed")
    assert {key: r.value for key, r in found.records.items()} == {
        "records/listed/a": {"n": 1},
        "records/listed/deeper/b": {"n": 2},
    }
    assert found.records["records/listed/a"].version == a.version
    assert found.revision >= b.version
    # a compare-and-swap on a listed version works, as on one read by get_record
    assert backend.put_record("records/listed/a", {"n": 4}, expect=found.records["records/listed/a"]) is not None


def test_watch_records_reports_puts_and_deletes_after_a_revision(any_client: Client) -> None:
    backend = any_client.backend
    start_revision = backend.read_records("records/watched").revision
    assert backend.watch_records("records/watched", start_revision, 0.2) == WaitResult.TIMEOUT
    # changes made before the watch starts are reported: it watches from the revision of the read
    put = backend.put_record("records/watched/x", {"v": 1}, expect=None)
    backend.put_record("records/elsewhere/y", {"v": 1}, expect=None)
    assert put is not None
    changes = backend.watch_records("records/watched", start_revision, 10)
    assert isinstance(changes, list)
    assert [(c.key, c.record.value if c.record else None) for c in changes] == [("records/watched/x", {"v": 1})]
    assert changes[0].revision == put.version
    got: list[Any] = []
    waiter = start(lambda: got.append(backend.watch_records("records/watched", changes[-1].revision, 10)))
    assert backend.delete_record("records/watched/x")
    waiter.join(15)
    [deleted] = got[0]
    assert deleted.key == "records/watched/x" and deleted.record is None and deleted.revision > put.version
