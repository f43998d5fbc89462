"""The etcd v3 backend against a real etcd 3.5, 3.6 and 3.7 started without the v2 API.

Every method of ``backends.base.Backend`` is exercised on a real server: the
queues, leases, records and watches, what each operation costs in requests,
and what it leaves behind on the server (keys, leases). The transport under
it (auth, TLS, servers that are not a v3 etcd, failures) is tested in
test_gateway.py. Requests are counted by wrapping ``transport.Pool.request``,
which every request of the backend goes through.
"""

from __future__ import annotations

import base64
import multiprocessing
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from celery_etcdlock import Mutex, connect
from celery_etcdlock.etcd import retry
from celery_etcdlock.etcd.base import Entry, Lease, LeaseExpired, WaitResult
from celery_etcdlock.etcd.etcd3 import Etcd3Backend, V3Lease
from celery_etcdlock.locks.connect import parse_url
from tests.support import EtcdServer, etcd_versions, free_port, wait_until

from .test_gateway import count_requests

V3_KINDS = etcd_versions.selected_kinds(["v3"], every=True)


@pytest.fixture(params=V3_KINDS, ids=[k.name for k in V3_KINDS])
def server(request: pytest.FixtureRequest) -> EtcdServer:
    """The session's server of each v3 etcd kind (3.5, 3.6, 3.7; conftest)."""
    server: EtcdServer = request.getfixturevalue("etcd_kind_servers")(request.param)
    return server


def make(url: str, **kwargs: Any) -> Etcd3Backend:
    return Etcd3Backend(parse_url(url, **kwargs))


@pytest.fixture
def prefix() -> str:
    return f"/t3-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def backend(server: EtcdServer, prefix: str) -> Iterator[Etcd3Backend]:
    b = make(server.url(prefix=prefix), retry_max_delay=10)
    yield b
    b.close()


@pytest.fixture
def requests_sent() -> Iterator[Counter[str]]:
    """Counts every HTTP request the test sends, by URL path."""
    with count_requests() as counts:
        yield counts


def join(backend: Etcd3Backend, queue: str, value: dict[str, Any], lease: Lease) -> Entry:
    """A new entry in ``queue`` (join_queue, the only way to make one; its snapshot is not needed here)."""
    entry, snapshot = backend.join_queue(queue, value, lease)
    assert snapshot.entries[-1] == entry
    return entry


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def server_leases(server: EtcdServer) -> set[str]:
    """Every lease the server knows (``POST /v3/lease/leases``)."""
    status, reply = server.v3("lease/leases", {})
    assert status == 200, reply
    return {lease["ID"] for lease in reply.get("leases", [])}


def raw_keys(server: EtcdServer, prefix: str) -> dict[str, dict[str, Any]]:
    """Every key under ``prefix`` as etcd stores it, read without our code."""
    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    status, reply = server.v3("kv/range", {"key": b64(prefix), "range_end": b64(end)})
    assert status == 200, reply
    return {base64.b64decode(kv["key"]).decode(): kv for kv in reply.get("kvs", [])}


def current_revision(server: EtcdServer) -> int:
    status, reply = server.v3("kv/range", {"key": b64("/nothing")})
    assert status == 200, reply
    return int(reply["header"]["revision"])


def wait_for(backend: Etcd3Backend, entry: Entry, after: int, timeout: float) -> threading.Thread:
    results: list[WaitResult] = []

    def run() -> None:
        results.append(backend.wait_gone(entry, after, timeout))

    thread = threading.Thread(target=run, daemon=True)
    thread.results = results  # type: ignore[attr-defined]
    thread.start()
    return thread


# -- construction -------------------------------------------------------------------------------


def test_constructor_and_close_do_no_network_io() -> None:
    port = free_port()  # nothing listens here: any request would fail
    b = make(f"etcd3://127.0.0.1:{port}")
    assert b.endpoints == (f"http://127.0.0.1:{port}",)
    assert b.entries_have_own_ttl is False
    b.after_fork()
    b.close()


# -- queues -------------------------------------------------------------------------------------


def test_queue_entries_in_creation_order_with_create_revision_tokens(
    backend: Etcd3Backend, server: EtcdServer, prefix: str
) -> None:
    lease = backend.grant(10)
    first = join(backend, "locks/q", {"mode": "write", "holder": "a"}, lease)
    second = join(backend, "locks/q", {"mode": "read", "holder": "b"}, lease)
    third = join(backend, "locks/q", {"mode": "write", "holder": "a"}, lease)  # same value, own key
    join(backend, "locks/q2", {"mode": "write"}, lease)  # a sibling queue is not part of it

    snapshot = backend.read_queue("locks/q")
    assert snapshot.entries == [first, second, third]
    assert first.token < second.token < third.token <= snapshot.revision
    assert len({first.key, second.key, third.key}) == 3
    assert first.key.startswith(f"locks/q/{lease.id}.")
    assert [e.mode for e in snapshot.entries] == ["write", "read", "write"]
    assert snapshot.entries[1].value == {"mode": "read", "holder": "b"}

    stored = raw_keys(server, prefix + "/")
    assert int(stored[f"{prefix}/{first.key}"]["create_revision"]) == first.token
    assert int(stored[f"{prefix}/{first.key}"]["lease"]) == int(lease.id, 16)
    assert base64.b64decode(stored[f"{prefix}/{first.key}"]["value"]).decode() == first.raw


def test_empty_queue_reads_with_the_current_revision(backend: Etcd3Backend, server: EtcdServer) -> None:
    before = current_revision(server)
    snapshot = backend.read_queue("locks/nothing", fresh=True)
    assert snapshot.entries == []
    assert snapshot.revision >= before


def test_keys_stay_under_the_prefix(server: EtcdServer, prefix: str) -> None:
    mine, other = make(server.url(prefix=prefix)), make(server.url(prefix=prefix + "-other"))
    entry = join(mine, "locks/x", {}, mine.grant(10))
    assert list(raw_keys(server, prefix + "/")) == [f"{prefix}/{entry.key}"]
    assert other.read_queue("locks/x").entries == []
    assert other.list_queues("locks") == {}


def test_create_with_a_dead_lease_raises_lease_expired(backend: Etcd3Backend) -> None:
    lease = backend.grant(10)
    stale = V3Lease(lease.lease_id, 10, 10)  # type: ignore[attr-defined]
    backend.revoke(lease, [])
    with pytest.raises(LeaseExpired):
        join(backend, "locks/q", {}, stale)  # the server says the lease is gone
    assert stale.expired
    with pytest.raises(LeaseExpired):
        join(backend, "locks/q", {}, stale)  # known locally now
    assert backend.read_queue("locks/q").entries == []


def test_revoke_deletes_the_entries_of_the_lease(backend: Etcd3Backend) -> None:
    lease = backend.grant(30)
    join(backend, "locks/q", {}, lease)
    join(backend, "locks/r", {}, lease)
    backend.revoke(lease, [])
    backend.revoke(lease, [])  # twice is quiet
    assert backend.list_queues("locks") == {}


def test_list_queues(backend: Etcd3Backend) -> None:
    lease = backend.grant(10)
    a1 = join(backend, "locks/a", {"n": 1}, lease)
    b1 = join(backend, "locks/b", {"n": 2}, lease)
    a2 = join(backend, "locks/a", {"n": 3}, lease)
    join(backend, "elections/a", {}, lease)
    backend.put_record("locks/a/deeper/not-an-entry", {}, expect=None)
    assert backend.list_queues("locks") == {"locks/a": [a1, a2], "locks/b": [b1]}
    assert backend.list_queues("nothing") == {}


def test_list_queues_gives_each_entry_its_lease_time_left(backend: Etcd3Backend, requests_sent: Counter[str]) -> None:
    short, long = backend.grant(5.5), backend.grant(60.5)  # etcd grants 5 s and 60 s
    entries = [join(backend, "locks/a", {}, short), join(backend, "locks/a", {}, long)]
    entries += [join(backend, "locks/b", {}, long), join(backend, "locks/c", {}, short)]
    requests_sent.clear()
    queues = backend.list_queues("locks")
    assert requests_sent == {"/v3/kv/range": 1, "/v3/kv/lease/timetolive": 2}  # one per lease, not per entry
    listed = [entry for queue in ("locks/a", "locks/b", "locks/c") for entry in queues[queue]]
    assert listed == entries
    ttls = [entry.ttl for entry in listed]
    assert all(ttl is not None for ttl in ttls), ttls
    assert 0 < ttls[0] <= 5 and 50 < ttls[1] <= 60 and ttls[2] == ttls[1] and ttls[3] == ttls[0], ttls


def test_delete_entry_is_guarded_by_create_revision(backend: Etcd3Backend, server: EtcdServer, prefix: str) -> None:
    lease = backend.grant(10)
    entry = join(backend, "locks/q", {"holder": "me"}, lease)
    assert backend.delete_entry(entry) is True
    assert backend.delete_entry(entry) is False  # gone already

    # the same key created again by someone else: a new create revision, not ours to delete
    status, reply = server.v3("kv/put", {"key": b64(f"{prefix}/{entry.key}"), "value": b64("{}")})
    assert status == 200, reply
    assert backend.delete_entry(entry) is False
    assert [e.key for e in backend.read_queue("locks/q").entries] == [entry.key]


# -- leases -------------------------------------------------------------------------------------


def test_grant_leaves_room_for_etcds_expiry_loop(backend: Etcd3Backend, server: EtcdServer) -> None:
    lease = backend.grant(3.7)
    assert isinstance(lease, V3Lease)
    # whole seconds, and 0.5 s below the ttl: expired leases are swept twice a second
    assert lease.server_ttl == 3 and lease.ttl == 3.7
    status, reply = server.v3("lease/timetolive", {"ID": str(lease.lease_id)})
    assert status == 200 and int(reply["grantedTTL"]) == 3, reply  # what etcd holds is what the clocks run on
    assert not lease.expired and int(lease.id, 16) == lease.lease_id


def test_keep_alive_renews_and_reports_a_dead_lease(backend: Etcd3Backend) -> None:
    lease = backend.grant(10)
    entries = [join(backend, "locks/q", {}, lease) for _ in range(3)]
    assert backend.keep_alive(lease, entries, timeout=5) == set()
    assert not lease.expired

    backend.revoke(V3Lease(lease.lease_id, 10, 10), [])  # behind our lease object's back
    assert backend.keep_alive(lease, entries, timeout=5) == {e.key for e in entries}
    assert lease.expired


def test_keep_alive_reports_entries_deleted_behind_its_back(backend: Etcd3Backend) -> None:
    lease = backend.grant(30)
    kept, released = join(backend, "locks/a", {}, lease), join(backend, "locks/b", {}, lease)
    backend.delete_entry(released)  # as `celery etcdlock release` does from another process
    assert backend.keep_alive(lease, [kept, released], timeout=5) == {released.key}
    assert not lease.expired


@pytest.mark.slow_but_newest
def test_a_renewal_of_500_entries_is_three_requests(backend: Etcd3Backend, requests_sent: Counter[str]) -> None:
    lease = backend.grant(30)
    entries = [join(backend, "locks/many", {"i": i}, lease) for i in range(500)]
    assert requests_sent["/v3/kv/txn"] == 500
    requests_sent.clear()
    assert backend.keep_alive(lease, entries, timeout=5) == set()
    # the keep-alive, the linearizable read that confirms it (same raft term), the listing of the lease's keys
    assert dict(requests_sent) == {"/v3/lease/keepalive": 1, "/v3/kv/range": 1, "/v3/kv/lease/timetolive": 1}


def test_keep_alive_makes_a_single_attempt_and_raises_transient() -> None:
    b = make(f"etcd3://127.0.0.1:{free_port()}")
    with pytest.raises(retry.Transient):
        b.keep_alive(V3Lease(1234, 10, 10), [], timeout=1)


def test_requests_per_operation(backend: Etcd3Backend, requests_sent: Counter[str]) -> None:
    def cost(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, dict[str, int]]:
        requests_sent.clear()
        result = fn(*args, **kwargs)
        return result, dict(requests_sent)

    lease, sent = cost(backend.grant, 10)
    assert sent == {"/v3/lease/grant": 1}
    (entry, _), sent = cost(backend.join_queue, "locks/q", {}, lease)
    assert sent == {"/v3/kv/txn": 1}  # create and read in one transaction
    snapshot, sent = cost(backend.read_queue, "locks/q")
    assert sent == {"/v3/kv/range": 1}
    _, sent = cost(backend.keep_alive, lease, [entry], 5)
    assert sent == {"/v3/lease/keepalive": 1, "/v3/kv/range": 1, "/v3/kv/lease/timetolive": 1}
    _, sent = cost(backend.list_queues, "locks")
    assert sent == {"/v3/kv/range": 1, "/v3/kv/lease/timetolive": 1}  # and one per lease of its entries
    _, sent = cost(backend.wait_gone, entry, snapshot.revision, 0.2)
    assert sent == {"/v3/watch": 1, "/v3/kv/range": 1}  # the watch, then the key read once it exists
    _, sent = cost(backend.delete_entry, entry)
    assert sent == {"/v3/kv/txn": 1}
    record, sent = cost(backend.put_record, "records/k/a", {"v": 1}, expect=None, fence=None)
    assert sent == {"/v3/kv/txn": 1}
    _, sent = cost(backend.get_record, "records/k/a")
    assert sent == {"/v3/kv/range": 1}
    expiring, sent = cost(backend.put_record, "records/k/b", {"v": 1}, expect=None, ttl=30)
    assert sent == {"/v3/lease/grant": 1, "/v3/kv/txn": 1}
    _, sent = cost(backend.get_record, "records/k/b")
    assert sent == {"/v3/kv/range": 1, "/v3/kv/lease/timetolive": 1}  # and what its lease has left
    _, sent = cost(backend.delete_record, "records/k/a", record)
    assert sent == {"/v3/kv/txn": 1}
    _, sent = cost(backend.delete_record, "records/k/b", expiring)
    assert sent == {"/v3/kv/txn": 1, "/v3/kv/lease/revoke": 1}  # and the record's own lease goes
    _, sent = cost(backend.revoke, lease, [])
    assert sent == {"/v3/kv/lease/revoke": 1}


# -- waiting ------------------------------------------------------------------------------------


def test_wait_gone_on_delete(backend: Etcd3Backend) -> None:
    lease = backend.grant(30)
    first = join(backend, "locks/q", {}, lease)
    join(backend, "locks/q", {}, lease)
    snapshot = backend.read_queue("locks/q")
    waiter = wait_for(backend, first, snapshot.revision, timeout=60)
    backend.delete_entry(first)
    waiter.join(70)
    assert waiter.results == [WaitResult.GONE]  # type: ignore[attr-defined]


def test_wait_gone_replays_a_delete_before_the_watch(backend: Etcd3Backend) -> None:
    entry = join(backend, "locks/q", {}, backend.grant(30))
    snapshot = backend.read_queue("locks/q")
    backend.delete_entry(entry)
    assert backend.wait_gone(entry, snapshot.revision, timeout=30) is WaitResult.GONE


@pytest.mark.slow_but_newest
def test_wait_gone_on_lease_expiry(backend: Etcd3Backend) -> None:
    entry = join(backend, "locks/q", {}, backend.grant(1))
    snapshot = backend.read_queue("locks/q")
    assert backend.wait_gone(entry, snapshot.revision, timeout=60) is WaitResult.GONE
    assert backend.read_queue("locks/q").entries == []


def test_wait_gone_times_out_when_nothing_happens(backend: Etcd3Backend) -> None:
    lease = backend.grant(30)
    entry = join(backend, "locks/q", {}, lease)
    other = join(backend, "locks/q", {}, lease)  # events on other keys do not wake it
    snapshot = backend.read_queue("locks/q")
    backend.delete_entry(other)
    started = time.monotonic()
    assert backend.wait_gone(entry, snapshot.revision, timeout=0.5) is WaitResult.TIMEOUT
    assert time.monotonic() - started >= 0.5
    assert backend.wait_gone(entry, snapshot.revision, timeout=0) is WaitResult.TIMEOUT


def test_wait_gone_does_not_depend_on_a_compacted_revision(backend: Etcd3Backend, server: EtcdServer) -> None:
    """wait_gone watches from now and then reads the key, so an old, compacted revision does not matter."""
    lease = backend.grant(30)
    entry = join(backend, "locks/q", {}, lease)
    before = backend.read_queue("locks/q").revision
    backend.put_record("records/k/x", {"n": 1}, expect=None)
    backend.put_record("records/k/y", {"n": 1}, expect=None)
    status, reply = server.v3("kv/compaction", {"revision": str(current_revision(server)), "physical": True})
    assert status == 200, reply
    assert backend.wait_gone(entry, before, timeout=0.5) is WaitResult.TIMEOUT  # still there
    backend.delete_entry(entry)
    assert backend.wait_gone(entry, before, timeout=30) is WaitResult.GONE  # deleted before the watch began


# -- records ------------------------------------------------------------------------------------


def test_record_compare_and_swap(backend: Etcd3Backend) -> None:
    assert backend.get_record("records/k/a") is None
    created = backend.put_record("records/k/a", {"n": 1}, expect=None)
    assert created is not None and created.value == {"n": 1} and created.ttl is None
    assert backend.get_record("records/k/a") == created
    assert backend.put_record("records/k/a", {"n": 2}, expect=None) is None  # exists already

    updated = backend.put_record("records/k/a", {"n": 2}, expect=created)
    assert updated is not None and updated.version > created.version
    assert backend.put_record("records/k/a", {"n": 3}, expect=created) is None  # stale version
    assert backend.get_record("records/k/a") == updated

    assert backend.delete_record("records/k/a", expect=created) is False
    assert backend.delete_record("records/k/a", expect=updated) is True
    assert backend.delete_record("records/k/a") is False
    assert backend.put_record("records/k/a", {"n": 4}, expect=updated) is None  # gone
    backend.put_record("records/k/a", {"n": 5}, expect=None)
    assert backend.delete_record("records/k/a") is True


def test_fenced_record_write_fails_once_the_fence_is_gone(backend: Etcd3Backend) -> None:
    lease = backend.grant(30)
    leader = join(backend, "elections/beat", {"holder": "a"}, lease)
    record = backend.put_record("records/beat/s", {"n": 1}, expect=None, fence=leader)
    assert record is not None
    record = backend.put_record("records/beat/s", {"n": 2}, expect=record, fence=leader)
    assert record is not None

    successor = join(backend, "elections/beat", {"holder": "b"}, lease)
    backend.delete_entry(leader)  # deposed
    assert backend.put_record("records/beat/s", {"n": 3}, expect=record, fence=leader) is None
    assert backend.get_record("records/beat/s") == record
    assert backend.put_record("records/beat/s", {"n": 3}, expect=record, fence=successor) is not None


@pytest.mark.slow
def test_records_with_a_ttl_leave_no_lease_behind(etcd_server_factory: Callable[..., EtcdServer]) -> None:
    """Each record with a ttl has a lease of its own: deleting or replacing the record revokes it.

    On a server of its own: on the shared one, other tests' leases come and go while this one counts.
    """
    server = etcd_server_factory("3.5", enable_v2=False)
    backend = make(server.url(prefix="/leases"), retry_max_delay=10)
    before = server_leases(server)
    for i in range(20):
        record = backend.put_record(f"records/markers/m{i}", {"task": i}, expect=None, ttl=60)
        assert record is not None
        assert backend.delete_record(f"records/markers/m{i}", expect=record)  # a dedupe marker's life
        record = backend.put_record(f"records/markers/n{i}", {"task": i}, expect=None, ttl=60)
        assert backend.put_record(f"records/markers/n{i}", {"task": i}, expect=None, ttl=60) is None  # taken
        replaced = backend.put_record(f"records/markers/n{i}", {"task": -i}, expect=record, ttl=60)
        assert replaced is not None
        assert backend.delete_record(f"records/markers/n{i}")  # unguarded
    assert server_leases(server) == before
    backend.close()


@pytest.mark.slow_but_newest
def test_record_with_ttl_expires(backend: Etcd3Backend) -> None:
    record = backend.put_record("records/markers/m", {"task": "t"}, expect=None, ttl=1)
    assert record is not None and record.ttl == 1
    found = backend.get_record("records/markers/m")
    assert found is not None and found.ttl is not None and 0 <= found.ttl <= 2  # etcd may raise a tiny TTL
    wait_until(lambda: backend.get_record("records/markers/m") is None, 60, "the record to expire")


# -- fork ---------------------------------------------------------------------------------------


def _child_reads(backend: Etcd3Backend, queue: str, conn: Any) -> None:
    backend.after_fork()
    conn.send([e.key for e in backend.read_queue(queue).entries])


def test_after_fork_the_child_uses_connections_of_its_own(backend: Etcd3Backend) -> None:
    entry = join(backend, "locks/q", {}, backend.grant(30))
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child_reads, args=(backend, "locks/q", child))
    proc.start()
    assert parent.poll(60), "the child did not answer"
    assert parent.recv() == [entry.key]
    proc.join(30)
    assert proc.exitcode == 0
    assert backend.read_queue("locks/q").entries == [entry]  # the parent's connections still work


# -- leases, seen through a Mutex ----------------------------------------------------------------


@pytest.mark.parametrize("api", ["v3"])
def test_a_lock_whose_lease_is_revoked_says_so(own_etcd):
    client = connect(own_etcd.url(prefix="/revoked"))
    try:
        lost = threading.Event()
        revoked = Mutex(client, "revoked", ttl=3, on_lost=lambda lock: lost.set())
        assert revoked.acquire(timeout=5)
        lease_id = str(revoked._held.lease.handle.lease_id)
        assert own_etcd.v3("kv/lease/revoke", {"ID": lease_id})[0] == 200
        assert lost.wait(10)
        assert revoked.lost_cause == "revoked" and "revoked" in (revoked.lost_reason or "")
        revoked.release()
    finally:
        client.close()
