"""The etcd v3 backend against a real etcd 3.5 started without the v2 API.

Every method of ``backends.base.Backend`` is exercised on real servers: an
etcd 3.5, one with auth, one with TLS, one without the JSON gateway, a redis
and a plain HTTP server (for the "this is not a v3 etcd" errors), and dead
ports (for fail-over and ``BackendUnavailable``). Request counts come from
wrapping ``requests.Session.send``, which every request of the backend goes
through.
"""

from __future__ import annotations

import base64
import http.server
import multiprocessing
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import requests

from celery_etcdlock import retry
from celery_etcdlock.backends.base import Entry, LeaseExpired, WaitResult
from celery_etcdlock.backends.etcd3 import Etcd3Backend, V3Lease
from celery_etcdlock.connect import parse_url
from celery_etcdlock.errors import AuthenticationFailed, BackendError, BackendUnavailable, UnsupportedServer

from .servers import APP_USER, EtcdServer, RedisServer, free_port, wait_until


class _Etcd(EtcdServer):
    """EtcdServer with extra command-line flags."""

    def __init__(self, *args: Any, extra: tuple[str, ...] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.extra = list(extra)

    def _command(self) -> list[str]:
        return super()._command() + self.extra


@pytest.fixture
def server(etcd3_server: EtcdServer) -> EtcdServer:
    """The session's etcd 3.5 without v2 (conftest)."""
    return etcd3_server


@pytest.fixture(scope="module")
def auth_server() -> Iterator[EtcdServer]:
    with EtcdServer("3.5", enable_v2=False, auth=True) as etcd:
        yield etcd


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
def requests_sent(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Counts every HTTP request any requests.Session sends, by URL path."""
    counts: Counter[str] = Counter()
    real_send = requests.Session.send

    def send(self: requests.Session, request: requests.PreparedRequest, **kwargs: Any) -> requests.Response:
        counts[requests.utils.urlparse(request.url).path] += 1
        return real_send(self, request, **kwargs)

    monkeypatch.setattr(requests.Session, "send", send)
    return counts


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


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
    first = backend.create_entry("locks/q", {"mode": "write", "holder": "a"}, lease)
    second = backend.create_entry("locks/q", {"mode": "read", "holder": "b"}, lease)
    third = backend.create_entry("locks/q", {"mode": "write", "holder": "a"}, lease)  # same value, own key
    backend.create_entry("locks/q2", {"mode": "write"}, lease)  # a sibling queue is not part of it

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
    entry = mine.create_entry("locks/x", {}, mine.grant(10))
    assert list(raw_keys(server, prefix + "/")) == [f"{prefix}/{entry.key}"]
    assert other.read_queue("locks/x").entries == []
    assert other.list_queues("locks") == {}


def test_create_with_a_dead_lease_raises_lease_expired(backend: Etcd3Backend) -> None:
    lease = backend.grant(10)
    stale = V3Lease(lease.lease_id, 10, 10)  # type: ignore[attr-defined]
    backend.revoke(lease, [])
    with pytest.raises(LeaseExpired):
        backend.create_entry("locks/q", {}, stale)  # the server says the lease is gone
    assert stale.expired
    with pytest.raises(LeaseExpired):
        backend.create_entry("locks/q", {}, stale)  # known locally now
    assert backend.read_queue("locks/q").entries == []


def test_revoke_deletes_the_entries_of_the_lease(backend: Etcd3Backend) -> None:
    lease = backend.grant(30)
    backend.create_entry("locks/q", {}, lease)
    backend.create_entry("locks/r", {}, lease)
    backend.revoke(lease, [])
    backend.revoke(lease, [])  # twice is quiet
    assert backend.list_queues("locks") == {}


def test_list_queues(backend: Etcd3Backend) -> None:
    lease = backend.grant(10)
    a1 = backend.create_entry("locks/a", {"n": 1}, lease)
    b1 = backend.create_entry("locks/b", {"n": 2}, lease)
    a2 = backend.create_entry("locks/a", {"n": 3}, lease)
    backend.create_entry("elections/a", {}, lease)
    backend.put_record("locks/a/deeper/not-an-entry", {}, expect=None)
    assert backend.list_queues("locks") == {"locks/a": [a1, a2], "locks/b": [b1]}
    assert backend.list_queues("nothing") == {}


def test_delete_entry_is_guarded_by_create_revision(backend: Etcd3Backend, server: EtcdServer, prefix: str) -> None:
    lease = backend.grant(10)
    entry = backend.create_entry("locks/q", {"holder": "me"}, lease)
    assert backend.delete_entry(entry) is True
    assert backend.delete_entry(entry) is False  # gone already

    # the same key created again by someone else: a new create revision, not ours to delete
    status, reply = server.v3("kv/put", {"key": b64(f"{prefix}/{entry.key}"), "value": b64("{}")})
    assert status == 200, reply
    assert backend.delete_entry(entry) is False
    assert [e.key for e in backend.read_queue("locks/q").entries] == [entry.key]


# -- leases -------------------------------------------------------------------------------------


def test_grant_leaves_room_for_etcds_expiry_loop(backend: Etcd3Backend) -> None:
    lease = backend.grant(3.7)
    assert isinstance(lease, V3Lease)
    # whole seconds, and 0.5 s below the ttl: expired leases are swept twice a second
    assert lease.granted_ttl == 3 and lease.ttl == 3.7
    assert not lease.expired and int(lease.id, 16) == lease.lease_id


def test_keep_alive_renews_and_reports_a_dead_lease(backend: Etcd3Backend) -> None:
    lease = backend.grant(10)
    entries = [backend.create_entry("locks/q", {}, lease) for _ in range(3)]
    assert backend.keep_alive(lease, entries, timeout=5) == set()
    assert not lease.expired

    backend.revoke(V3Lease(lease.lease_id, 10, 10), [])  # behind our lease object's back
    assert backend.keep_alive(lease, entries, timeout=5) == {e.key for e in entries}
    assert lease.expired


def test_keep_alive_reports_entries_deleted_behind_its_back(backend: Etcd3Backend) -> None:
    lease = backend.grant(30)
    kept, released = backend.create_entry("locks/a", {}, lease), backend.create_entry("locks/b", {}, lease)
    backend.delete_entry(released)  # as `celery etcdlock release` does from another process
    assert backend.keep_alive(lease, [kept, released], timeout=5) == {released.key}
    assert not lease.expired


def test_a_renewal_of_500_entries_is_two_requests(backend: Etcd3Backend, requests_sent: Counter[str]) -> None:
    lease = backend.grant(30)
    entries = [backend.create_entry("locks/many", {"i": i}, lease) for i in range(500)]
    assert requests_sent["/v3/kv/txn"] == 500
    requests_sent.clear()
    assert backend.keep_alive(lease, entries, timeout=5) == set()
    assert dict(requests_sent) == {"/v3/lease/keepalive": 1, "/v3/kv/lease/timetolive": 1}


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
    entry, sent = cost(backend.create_entry, "locks/q", {}, lease)
    assert sent == {"/v3/kv/txn": 1}
    snapshot, sent = cost(backend.read_queue, "locks/q")
    assert sent == {"/v3/kv/range": 1}
    _, sent = cost(backend.keep_alive, lease, [entry], 5)
    assert sent == {"/v3/lease/keepalive": 1, "/v3/kv/lease/timetolive": 1}
    _, sent = cost(backend.wait_gone, entry, snapshot.revision, 0.2)
    assert sent == {"/v3/watch": 1, "/v3/kv/range": 1}  # the watch, then the key read once it exists
    _, sent = cost(backend.delete_entry, entry)
    assert sent == {"/v3/kv/txn": 1}
    record, sent = cost(backend.put_record, "records/k/a", {"v": 1}, expect=None, fence=None)
    assert sent == {"/v3/kv/txn": 1}
    _, sent = cost(backend.get_record, "records/k/a")
    assert sent == {"/v3/kv/range": 1}
    _, sent = cost(backend.put_record, "records/k/b", {"v": 1}, expect=None, ttl=30)
    assert sent == {"/v3/lease/grant": 1, "/v3/kv/txn": 1}
    _, sent = cost(backend.delete_record, "records/k/a", record)
    assert sent == {"/v3/kv/txn": 1}
    _, sent = cost(backend.revoke, lease, [])
    assert sent == {"/v3/kv/lease/revoke": 1}


# -- waiting ------------------------------------------------------------------------------------


def test_wait_gone_on_delete(backend: Etcd3Backend) -> None:
    lease = backend.grant(30)
    first = backend.create_entry("locks/q", {}, lease)
    backend.create_entry("locks/q", {}, lease)
    snapshot = backend.read_queue("locks/q")
    waiter = wait_for(backend, first, snapshot.revision, timeout=60)
    backend.delete_entry(first)
    waiter.join(70)
    assert waiter.results == [WaitResult.GONE]  # type: ignore[attr-defined]


def test_wait_gone_replays_a_delete_before_the_watch(backend: Etcd3Backend) -> None:
    entry = backend.create_entry("locks/q", {}, backend.grant(30))
    snapshot = backend.read_queue("locks/q")
    backend.delete_entry(entry)
    assert backend.wait_gone(entry, snapshot.revision, timeout=30) is WaitResult.GONE


def test_wait_gone_on_lease_expiry(backend: Etcd3Backend) -> None:
    entry = backend.create_entry("locks/q", {}, backend.grant(1))
    snapshot = backend.read_queue("locks/q")
    assert backend.wait_gone(entry, snapshot.revision, timeout=60) is WaitResult.GONE
    assert backend.read_queue("locks/q").entries == []


def test_wait_gone_times_out_when_nothing_happens(backend: Etcd3Backend) -> None:
    lease = backend.grant(30)
    entry = backend.create_entry("locks/q", {}, lease)
    other = backend.create_entry("locks/q", {}, lease)  # events on other keys do not wake it
    snapshot = backend.read_queue("locks/q")
    backend.delete_entry(other)
    started = time.monotonic()
    assert backend.wait_gone(entry, snapshot.revision, timeout=0.5) is WaitResult.TIMEOUT
    assert time.monotonic() - started >= 0.5
    assert backend.wait_gone(entry, snapshot.revision, timeout=0) is WaitResult.TIMEOUT


def test_wait_gone_does_not_depend_on_a_compacted_revision(backend: Etcd3Backend, server: EtcdServer) -> None:
    """wait_gone watches from now and then reads the key, so an old, compacted revision does not matter."""
    lease = backend.grant(30)
    entry = backend.create_entry("locks/q", {}, lease)
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
    leader = backend.create_entry("elections/beat", {"holder": "a"}, lease)
    record = backend.put_record("records/beat/s", {"n": 1}, expect=None, fence=leader)
    assert record is not None
    record = backend.put_record("records/beat/s", {"n": 2}, expect=record, fence=leader)
    assert record is not None

    successor = backend.create_entry("elections/beat", {"holder": "b"}, lease)
    backend.delete_entry(leader)  # deposed
    assert backend.put_record("records/beat/s", {"n": 3}, expect=record, fence=leader) is None
    assert backend.get_record("records/beat/s") == record
    assert backend.put_record("records/beat/s", {"n": 3}, expect=record, fence=successor) is not None


def test_record_with_ttl_expires(backend: Etcd3Backend) -> None:
    record = backend.put_record("records/markers/m", {"task": "t"}, expect=None, ttl=1)
    assert record is not None and record.ttl == 1
    found = backend.get_record("records/markers/m")
    assert found is not None and found.ttl is not None and 0 <= found.ttl <= 2  # etcd may raise a tiny TTL
    wait_until(lambda: backend.get_record("records/markers/m") is None, 60, "the record to expire")


# -- auth ---------------------------------------------------------------------------------------


def test_auth_with_a_token(auth_server: EtcdServer, prefix: str, requests_sent: Counter[str]) -> None:
    b = make(auth_server.url(prefix=prefix))
    lease = b.grant(10)
    entry = b.create_entry("locks/q", {}, lease)
    assert b.read_queue("locks/q").entries == [entry]
    assert requests_sent["/v3/auth/authenticate"] == 1  # once, not per request


def test_a_rejected_token_is_renewed(auth_server: EtcdServer, prefix: str, requests_sent: Counter[str]) -> None:
    b = make(auth_server.url(prefix=prefix))
    entry = b.create_entry("locks/q", {}, b.grant(30))
    snapshot = b.read_queue("locks/q")
    b._token = "expired.1"  # what a token is once its TTL passed or etcd restarted
    assert b.read_queue("locks/q").entries == [entry]
    b._token = "expired.2"
    assert b.wait_gone(entry, snapshot.revision, timeout=0.2) is WaitResult.TIMEOUT
    assert requests_sent["/v3/auth/authenticate"] == 3


def test_bad_credentials(auth_server: EtcdServer, prefix: str) -> None:
    b = make(auth_server.url(prefix=prefix, password="wrong"), retry_max_delay=5)
    with pytest.raises(AuthenticationFailed, match=f"{APP_USER!r}.*(invalid user ID or password)"):
        b.read_queue("locks/q")


def test_no_credentials_where_auth_is_on(auth_server: EtcdServer, prefix: str) -> None:
    b = make(f"etcd3://{auth_server.endpoint}?prefix={prefix}", retry_max_delay=5)
    with pytest.raises(AuthenticationFailed, match="requires authentication.*user:password@"):
        b.read_queue("locks/q")


def test_credentials_where_auth_is_off_are_ignored(server: EtcdServer, prefix: str) -> None:
    b = make(server.url(prefix=prefix, user="someone", password="pw"))
    assert b.read_queue("locks/q").entries == []


# -- servers that are not a v3 etcd, and endpoints that are down ----------------------------------


def test_redis_port_is_not_an_etcd(redis_server: RedisServer) -> None:
    b = make(f"etcd3://{redis_server.endpoint}", retry_max_delay=5)
    with pytest.raises(UnsupportedServer, match=f"{redis_server.endpoint} is not an etcd server.*HTTP"):
        b.read_queue("locks/q")


class _NotEtcd(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        self.send_error(404)

    do_POST = do_GET  # noqa: N815

    def log_message(self, *args: Any) -> None:
        pass


def test_plain_http_server_is_not_an_etcd() -> None:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotEtcd)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        b = make(f"etcd3://127.0.0.1:{httpd.server_address[1]}", retry_max_delay=5)
        with pytest.raises(UnsupportedServer, match="is not an etcd server.*404"):
            b.grant(5)
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_etcd_without_the_json_gateway() -> None:
    with _Etcd("3.5", enable_v2=False, extra=("--enable-grpc-gateway=false",)) as etcd:
        b = make(etcd.url(), retry_max_delay=5)
        with pytest.raises(UnsupportedServer, match="etcd 3.5.* does not serve the v3 JSON gateway"):
            b.read_queue("locks/q")


def test_unreachable_endpoint_is_backend_unavailable() -> None:
    port = free_port()
    b = make(f"etcd3://127.0.0.1:{port}", retry_max_delay=0.3)
    with pytest.raises(BackendUnavailable, match=f"127.0.0.1:{port}") as caught:
        b.read_queue("locks/q")
    assert caught.value.endpoints == (f"http://127.0.0.1:{port}",)


def test_fail_over_to_the_next_endpoint(server: EtcdServer, prefix: str) -> None:
    dead = free_port()
    b = make(f"etcd3://127.0.0.1:{dead},{server.endpoint}?prefix={prefix}", retry_max_delay=10)
    lease = b.grant(10)
    entry = b.create_entry("locks/q", {}, lease)
    assert b.read_queue("locks/q").entries == [entry]
    assert b._current == 1


# -- TLS ----------------------------------------------------------------------------------------


def test_tls(etcd_server_factory: Callable[..., EtcdServer]) -> None:
    etcd = etcd_server_factory("3.5", enable_v2=False, tls=True)
    b = make(etcd.url(prefix="/tls"), retry_max_delay=5)  # with ?ca=&cert=&key=
    entry = b.create_entry("locks/q", {}, b.grant(10))
    assert b.read_queue("locks/q").entries == [entry]
    assert b.wait_gone(entry, b.read_queue("locks/q").revision, timeout=0.2) is WaitResult.TIMEOUT

    plain = make(f"etcd3://{etcd.endpoint}", retry_max_delay=5)
    with pytest.raises(UnsupportedServer, match="speaks TLS only.*etcd3s://"):
        plain.read_queue("locks/q")

    unverified = make(f"etcd3s://{etcd.endpoint}", retry_max_delay=5)
    with pytest.raises(BackendError, match="could not be verified.*ca="):
        unverified.read_queue("locks/q")


def test_tls_scheme_against_a_plain_server(server: EtcdServer) -> None:
    b = make(f"etcd3s://{server.endpoint}", retry_max_delay=5)
    with pytest.raises(UnsupportedServer, match="does not speak TLS.*etcd3://"):
        b.read_queue("locks/q")


# -- fork ---------------------------------------------------------------------------------------


def _child_reads(backend: Etcd3Backend, queue: str, conn: Any) -> None:
    backend.after_fork()
    conn.send([e.key for e in backend.read_queue(queue).entries])


def test_after_fork_the_child_uses_connections_of_its_own(backend: Etcd3Backend) -> None:
    entry = backend.create_entry("locks/q", {}, backend.grant(30))
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child_reads, args=(backend, "locks/q", child))
    proc.start()
    assert parent.poll(60), "the child did not answer"
    assert parent.recv() == [entry.key]
    proc.join(30)
    assert proc.exitcode == 0
    assert backend.read_queue("locks/q").entries == [entry]  # the parent's connections still work


# -- a server that stops answering or dies during a watch -----------------------------------------


def ranges_served(server: EtcdServer) -> int:
    return sum(
        int(float(line.split()[-1]))
        for line in server.metrics().splitlines()
        if line.startswith("grpc_server_handled_total{") and 'grpc_method="Range"' in line
    )


def watch_streams(server: EtcdServer) -> int:
    for line in server.metrics().splitlines():
        if line.startswith("etcd_debugging_mvcc_watch_stream_total "):
            return int(float(line.split()[1]))
    raise AssertionError("etcd_debugging_mvcc_watch_stream_total not in /metrics")


@pytest.mark.parametrize("api", ["v3"])
def test_a_watch_on_a_frozen_server_ends_at_its_deadline(own_etcd: EtcdServer) -> None:
    b = make(own_etcd.url(prefix="/frozen"), retry_max_delay=2, timeout=2)
    entry = b.create_entry("locks/q", {}, b.grant(30))
    snapshot = b.read_queue("locks/q")
    reads = ranges_served(own_etcd)
    waiter = wait_for(b, entry, snapshot.revision, timeout=3)
    # paused only once the watch is up and the key was read after it: from then on only the watch waits
    wait_until(lambda: watch_streams(own_etcd) >= 1 and ranges_served(own_etcd) > reads, 30, "the watch and its read")
    own_etcd.pause()
    try:
        waiter.join(30)
        assert not waiter.is_alive(), "wait_gone hung past its deadline"
        assert waiter.results == [WaitResult.TIMEOUT]  # type: ignore[attr-defined]
    finally:
        own_etcd.resume()


@pytest.mark.parametrize("api", ["v3"])
def test_a_watch_whose_server_dies_is_backend_unavailable(own_etcd: EtcdServer) -> None:
    b = make(own_etcd.url(prefix="/dies"), retry_max_delay=1)
    entry = b.create_entry("locks/q", {}, b.grant(30))
    snapshot = b.read_queue("locks/q")
    errors: list[Exception] = []

    def wait() -> None:
        try:
            b.wait_gone(entry, snapshot.revision, timeout=120)
        except Exception as exc:
            errors.append(exc)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    wait_until(lambda: watch_streams(own_etcd) >= 1, 30, "the watch to be established")
    own_etcd.kill()
    thread.join(60)
    assert not thread.is_alive(), "wait_gone hung after etcd died"
    assert len(errors) == 1 and isinstance(errors[0], BackendUnavailable), errors
    assert own_etcd.endpoint in str(errors[0])


def test_tokens_lost_in_a_restart_are_renewed(
    auth_server: EtcdServer, prefix: str, requests_sent: Counter[str]
) -> None:
    b = make(auth_server.url(prefix=prefix), retry_max_delay=30)
    entry = b.create_entry("locks/q", {}, b.grant(60))
    auth_server.restart()  # simple tokens live in memory only
    assert b.read_queue("locks/q").entries == [entry]
    assert requests_sent["/v3/auth/authenticate"] == 2


# -- how the gateway's gRPC errors are classified (the messages etcd 3.5 sends) ---------------------


@pytest.mark.parametrize(
    ("code", "message", "kind"),
    [
        (14, "etcdserver: leader changed", retry.Transient),
        (14, "etcdserver: no leader", retry.Transient),
        (14, "etcdserver: request timed out", retry.Transient),
        (8, "etcdserver: too many requests", retry.Transient),
        (4, "context deadline exceeded", retry.Transient),
        (2, "etcdserver: leader changed", retry.Transient),  # by message, whatever the code
        (7, "etcdserver: permission denied", AuthenticationFailed),
        (3, "etcdserver: authentication failed, invalid user ID or password", AuthenticationFailed),
        (3, "etcdserver: user name is empty", AuthenticationFailed),
        (5, "etcdserver: requested lease not found", Exception),  # an answer, not retried
        (3, "etcdserver: duplicate key given in txn request", Exception),
    ],
)
def test_grpc_errors_are_classified(code: int, message: str, kind: type[Exception]) -> None:
    b = make("etcd3://127.0.0.1:1,127.0.0.1:2")
    error = b._grpc_error(0, code, message)
    assert isinstance(error, kind)
    if kind is Exception:
        assert not isinstance(error, (retry.Transient, BackendError))  # becomes BackendError, never retried
    assert message in str(error)


class _Unavailable(_NotEtcd):
    def do_GET(self) -> None:  # noqa: N802
        self.send_error(503)

    do_POST = do_GET  # noqa: N815


def test_http_5xx_is_retried_then_backend_unavailable() -> None:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Unavailable)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        b = make(f"etcd3://127.0.0.1:{httpd.server_address[1]}", retry_max_delay=0.3)
        with pytest.raises(BackendUnavailable, match="HTTP 503"):
            b.read_queue("locks/q")
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_tls_with_client_certificates_and_password_auth(etcd_server_factory: Callable[..., EtcdServer]) -> None:
    etcd = etcd_server_factory("3.5", enable_v2=False, tls=True, client_cert_auth=True, auth=True)
    b = make(etcd.url(prefix="/mtls"), retry_max_delay=5)  # etcd3s://app:app-secret@...?ca=&cert=&key=
    entry = b.create_entry("locks/q", {}, b.grant(10))
    assert b.read_queue("locks/q").entries == [entry]
    assert b.keep_alive(b.grant(10), [], timeout=5) == set()

    no_cert = make(f"etcd3s://app:app-secret@{etcd.endpoint}?ca={etcd.ca_file}", retry_max_delay=0.5)
    with pytest.raises(BackendError, match="refused the TLS connection.*client certificate.*cert="):
        no_cert.read_queue("locks/q")
