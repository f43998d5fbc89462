"""The v3 backend's HTTP transport (etcd/gateway.py) against real servers.

Real etcd 3.5 (and 3.4's v3 gateway where the two differ: error texts, auth),
with auth, TLS and client certificates, without the JSON gateway, with short
auth tokens; and what is not a v3 etcd client port: a redis, a plain HTTP
server, etcd's peer port, dead ports. Connections are cut by a real TCP proxy
in between. Requests are counted by wrapping ``transport.Pool.request``, which
every request of both backends goes through.
"""

from __future__ import annotations

import base64
import http.server
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from celery_etcdlock.errors import AuthenticationFailed, BackendError, BackendUnavailable, UnsupportedServer
from celery_etcdlock.etcd import retry, transport
from celery_etcdlock.etcd.base import Entry, WaitResult
from celery_etcdlock.etcd.etcd3 import Etcd3Backend
from celery_etcdlock.etcd.gateway import Failure, Gateway
from celery_etcdlock.locks.connect import parse_url
from tests.support import (
    APP_PASSWORD,
    APP_USER,
    ROOT_PASSWORD,
    ROOT_USER,
    EtcdServer,
    RedisServer,
    etcd_versions,
    free_port,
    wait_until,
)
from tests.support.scripted import Proxy

# -- helpers ------------------------------------------------------------------------------------


@contextmanager
def count_requests() -> Iterator[Counter[str]]:
    """Counts every HTTP request any connection pool sends, by URL path, while in the block."""
    counts: Counter[str] = Counter()
    real_request = transport.Pool.request

    def request(self: transport.Pool, method: str, target: str, *args: Any, **kwargs: Any) -> Any:
        counts[target.split("?")[0]] += 1
        return real_request(self, method, target, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(transport.Pool, "request", request)
        yield counts


@pytest.fixture
def requests_sent() -> Iterator[Counter[str]]:
    with count_requests() as counts:
        yield counts


def make(url: str, **kwargs: Any) -> Etcd3Backend:
    return Etcd3Backend(parse_url(url, **kwargs))


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


@pytest.fixture
def prefix() -> str:
    return f"/g-{uuid.uuid4().hex[:10]}"


#: the v3 release lines, and with 3.4 every v3 gateway there is: 3.6 moved the gateway to grpc-gateway v2,
#: whose errors have no "error" text (only "code" and "message"), unary or streamed (etcd issue 21100)
V3_LINES = [v for v in ("3.5", "3.6", "3.7") if etcd_versions.version_wanted("v3", v)]
GATEWAYS = [v for v in ("3.4", *V3_LINES) if etcd_versions.version_wanted("v3", v)]


@pytest.fixture(scope="module", params=V3_LINES)
def auth_server(request: pytest.FixtureRequest) -> Iterator[EtcdServer]:
    """An etcd of each v3 release line with v3 auth on (users in tests/support/etcd_server.py)."""
    etcd_versions.require(request.param)
    with EtcdServer(request.param, enable_v2=False, auth=True, name=f"auth{request.param}") as etcd:
        yield etcd


@pytest.fixture(scope="module", params=GATEWAYS)
def any_gateway(request: pytest.FixtureRequest) -> Iterator[EtcdServer]:
    """The v3 gateway of etcd 3.4 to 3.7, each without v2."""
    etcd_versions.require(request.param)
    with EtcdServer(request.param, enable_v2=False, name=f"gw{request.param}") as etcd:
        yield etcd


def join(backend: Etcd3Backend, queue: str, lease: Any, value: dict[str, Any] | None = None) -> Entry:
    entry, _ = backend.join_queue(queue, value or {}, lease)
    return entry


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


class Waiter(threading.Thread):
    """``backend.wait_gone(entry, 0, timeout)`` in a thread: its result or its error."""

    def __init__(self, backend: Etcd3Backend, entry: Entry, timeout: float) -> None:
        super().__init__(daemon=True)
        self.backend, self.entry, self.timeout = backend, entry, timeout
        self.result: WaitResult | None = None
        self.error: Exception | None = None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.backend.wait_gone(self.entry, 0, self.timeout)
        except Exception as exc:
            self.error = exc


# -- the transport itself -----------------------------------------------------------------------


def test_one_pool_per_endpoint_and_no_io_before_the_first_request(etcd35_server: EtcdServer) -> None:
    dead = free_port()
    gateway = Gateway(parse_url(f"etcd3://127.0.0.1:{dead},{etcd35_server.endpoint}"))
    gateway.close()  # nothing to close yet
    with pytest.raises(retry.Transient):
        gateway.post("kv/range", {"key": b64("/x")})
    assert gateway.current == 1  # failed over
    for _ in range(5):
        assert "header" in gateway.post("kv/range", {"key": b64("/x")})
    pool = gateway._endpoints._pools[1]
    assert pool is not None and pool.idle_connections == 1  # one kept-alive connection for sequential requests
    gateway.close()
    assert gateway._endpoints._pools == [None, None]


class _HangUp(threading.Thread):
    """A server that accepts connections and closes each at once, counting them."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.accepted = 0
        self.start()

    def run(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.accepted += 1
            conn.recv(65536)
            conn.close()


def test_the_transport_does_not_retry_on_its_own() -> None:
    hang_up = _HangUp()
    try:
        gateway = Gateway(parse_url(f"etcd3://127.0.0.1:{hang_up.port}"))
        gateway._answered[0] = True  # as if it had answered before: no probing of what the server is
        with pytest.raises(retry.Transient, match="Remote end closed|aborted"):
            gateway.post("kv/txn", {})
        assert hang_up.accepted == 1  # one connection, one request: the retry policy decides about more
    finally:
        hang_up.listener.close()


def test_nothing_comes_from_the_environment(
    etcd35_server: EtcdServer, prefix: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    dead_proxy = f"http://127.0.0.1:{free_port()}"
    for name in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.setenv(name, dead_proxy)
    monkeypatch.setenv("NO_PROXY", "")
    (tmp_path / ".netrc").write_text(f"machine 127.0.0.1 login {APP_USER} password wrong\n")
    monkeypatch.setenv("NETRC", str(tmp_path / ".netrc"))
    monkeypatch.setenv("HOME", str(tmp_path))
    b = make(etcd35_server.url(prefix=prefix), retry_max_delay=2)
    entry = join(b, "locks/q", b.grant(10))
    assert b.read_queue("locks/q").entries == [entry]


# -- auth ---------------------------------------------------------------------------------------


def test_auth_with_a_token(auth_server: EtcdServer, prefix: str, requests_sent: Counter[str]) -> None:
    b = make(auth_server.url(prefix=prefix))
    entry = join(b, "locks/q", b.grant(10))
    assert b.read_queue("locks/q").entries == [entry]
    assert requests_sent["/v3/auth/authenticate"] == 1  # once, not per request


def test_a_rejected_token_is_renewed(auth_server: EtcdServer, prefix: str, requests_sent: Counter[str]) -> None:
    b = make(auth_server.url(prefix=prefix))
    entry = join(b, "locks/q", b.grant(30))
    snapshot = b.read_queue("locks/q")
    b.gateway._token = "expired.1"  # what a token is once its TTL passed or etcd restarted
    assert b.read_queue("locks/q").entries == [entry]
    b.gateway._token = "expired.2"
    assert b.wait_gone(entry, snapshot.revision, timeout=0.2) is WaitResult.TIMEOUT
    assert requests_sent["/v3/auth/authenticate"] == 3


def test_a_keep_alive_whose_token_was_rejected_renews_it(
    auth_server: EtcdServer, prefix: str, requests_sent: Counter[str]
) -> None:
    """lease/keepalive is a streamed call: its refusal is {"error": {...}} (3.5: grpc_code, http_code;
    3.6+: code, message), not a unary answer; either way the token is renewed and the lease with it."""
    b = make(auth_server.url(prefix=prefix))
    lease = b.grant(30)
    entry = join(b, "locks/q", lease)
    b.gateway._token = "expired.1"
    assert b.keep_alive(lease, [entry], timeout=10) == set()  # no key lost
    assert not lease.expired
    assert requests_sent["/v3/auth/authenticate"] == 2


def test_bad_credentials(auth_server: EtcdServer, prefix: str) -> None:
    b = make(auth_server.url(prefix=prefix, password="wrong"), retry_max_delay=5)
    with pytest.raises(AuthenticationFailed, match=f"{APP_USER!r}.*(invalid user ID or password)") as caught:
        b.read_queue("locks/q")
    assert "wrong" not in str(caught.value)


def test_no_credentials_where_auth_is_on(auth_server: EtcdServer, prefix: str) -> None:
    b = make(f"etcd3://{auth_server.endpoint}?prefix={prefix}", retry_max_delay=5)
    with pytest.raises(AuthenticationFailed, match="requires authentication.*user:password@"):
        b.read_queue("locks/q")


def test_credentials_where_auth_is_off_are_ignored(etcd35_server: EtcdServer, prefix: str) -> None:
    b = make(etcd35_server.url(prefix=prefix, user="someone", password="pw"))
    assert b.read_queue("locks/q").entries == []


@pytest.mark.slow_but_newest
def test_tokens_lost_in_a_restart_are_renewed(
    auth_server: EtcdServer, prefix: str, requests_sent: Counter[str]
) -> None:
    b = make(auth_server.url(prefix=prefix), retry_max_delay=30)
    entry = join(b, "locks/q", b.grant(60))
    auth_server.restart()  # simple tokens live in memory only
    assert b.read_queue("locks/q").entries == [entry]
    assert requests_sent["/v3/auth/authenticate"] == 2


# -- a watch whose token expires while it waits (issue 10.8) ---------------------------------------


def _token_expired(etcd: EtcdServer, token: str) -> bool:
    """etcd logs each simple token its TTL keeper deletes (at info before 3.5.2 or so, at debug since)."""
    return any(
        "deleted a simple token" in line and f'"token":"{token}"' in line
        for line in etcd.log_path.read_text(errors="replace").splitlines()
    )


def _wait_for_the_watch(etcd: EtcdServer, ranges_before: int) -> None:
    """Until the watch exists and its key was read after it: from then on only the watch waits."""
    wait_until(lambda: watch_streams(etcd) >= 1 and ranges_served(etcd) > ranges_before, 30, "the watch and its read")


@pytest.mark.slow
@pytest.mark.parametrize("version", GATEWAYS)
def test_a_watch_survives_token_expiry_at_every_stream_cut(
    version: str, etcd_server_factory: Callable[..., EtcdServer]
) -> None:
    """Two stream cuts, each after the watch's idle token expired: two rejections, each followed by a
    successful re-authentication. Only rejections in a row are a refusal."""
    etcd = etcd_server_factory(
        version, enable_v2=False, auth=True, extra_flags=("--auth-token-ttl=1", "--log-level=debug")
    )  # a watch's refusal is a cancel_reason text, the same on every version
    with Proxy(("127.0.0.1", etcd.client_port)) as proxy, count_requests() as sent:
        b = make(f"etcd3://{APP_USER}:{APP_PASSWORD}@127.0.0.1:{proxy.port}?prefix=/ttl", retry_max_delay=60)
        entry = join(b, "locks/q", b.grant(60))
        ranges = ranges_served(etcd)
        waiter = Waiter(b, entry, timeout=120)
        for cut in (1, 2):
            _wait_for_the_watch(etcd, ranges)
            token = b.gateway._token
            assert token is not None
            wait_until(lambda t=token: _token_expired(etcd, t), 30, "etcd to expire the watch's idle token")
            ranges = ranges_served(etcd)
            proxy.cut()
            wait_until(lambda n=cut: sent["/v3/auth/authenticate"] > n or not waiter.is_alive(), 30, "a re-auth")
            assert waiter.error is None and waiter.is_alive(), waiter.error
        _wait_for_the_watch(etcd, ranges)
        assert b.delete_entry(entry)
        waiter.join(30)
    assert waiter.error is None and waiter.result is WaitResult.GONE
    assert sent["/v3/auth/authenticate"] == 3  # the first, then one after each cut


def _root(etcd: EtcdServer, method: str, body: dict[str, Any]) -> None:
    status, reply = etcd.v3(method, body, token=etcd.v3_token(ROOT_USER, ROOT_PASSWORD))
    assert status == 200, reply


@pytest.mark.slow
@pytest.mark.parametrize("version", [v for v in ("3.5", "3.7") if v in V3_LINES])
@pytest.mark.parametrize(
    ("refusal", "change", "message"),
    [
        ("wrong password", ("auth/user/changepw", {"name": APP_USER, "password": "changed"}), "invalid user ID"),
        ("role revoked", ("auth/user/revoke", {"name": APP_USER, "role": "app"}), "may not watch"),
    ],
)
def test_a_watch_whose_user_is_refused_fails_clearly(
    refusal: str,
    change: tuple[str, dict[str, Any]],
    message: str,
    version: str,
    etcd_server_factory: Callable[..., EtcdServer],
) -> None:
    etcd = etcd_server_factory(version, enable_v2=False, auth=True)
    with Proxy(("127.0.0.1", etcd.client_port)) as proxy:
        b = make(f"etcd3://{APP_USER}:{APP_PASSWORD}@127.0.0.1:{proxy.port}?prefix=/no", retry_max_delay=60)
        entry = join(b, "locks/q", b.grant(60))
        ranges = ranges_served(etcd)
        waiter = Waiter(b, entry, timeout=120)
        _wait_for_the_watch(etcd, ranges)
        _root(etcd, *change)
        proxy.cut()
        waiter.join(60)
    assert not waiter.is_alive()
    assert isinstance(waiter.error, AuthenticationFailed), waiter.error
    assert message in str(waiter.error) and APP_USER in str(waiter.error)
    assert APP_PASSWORD not in str(waiter.error)


def test_a_long_watch_cut_after_the_retry_budget_watches_again(etcd35_server: EtcdServer, prefix: str) -> None:
    """The retry budget counts from a call's start: a watch that worked longer than it, then lost its
    connection, must not give up at once."""
    with Proxy(("127.0.0.1", etcd35_server.client_port)) as proxy:
        b = make(f"etcd3://127.0.0.1:{proxy.port}?prefix={prefix}", retry_max_delay=0.5)
        entry = join(b, "locks/q", b.grant(60))
        ranges = ranges_served(etcd35_server)
        started = time.monotonic()
        waiter = Waiter(b, entry, timeout=60)
        wait_until(lambda: ranges_served(etcd35_server) > ranges, 30, "the watch's read of its key")
        wait_until(lambda: time.monotonic() - started > 1.0, 5, "the retry budget to pass")
        ranges = ranges_served(etcd35_server)
        proxy.cut()
        wait_until(lambda: ranges_served(etcd35_server) > ranges or not waiter.is_alive(), 30, "the new watch's read")
        assert waiter.error is None and waiter.is_alive(), waiter.error
        b.delete_entry(entry)
        waiter.join(30)
    assert waiter.result is WaitResult.GONE


# -- requests etcd refuses for their size (issue 10.4) --------------------------------------------


def test_a_request_too_large_fails_at_once(any_gateway: EtcdServer, prefix: str, requests_sent: Counter[str]) -> None:
    b = make(any_gateway.url(prefix=prefix), retry_max_delay=60)
    lease = b.grant(30)
    requests_sent.clear()
    # over --max-request-bytes (1.5 MiB): "etcdserver: request is too large" (INVALID_ARGUMENT)
    with pytest.raises(BackendError, match="too large.*--max-request-bytes") as caught:
        b.put_record("records/k/big", {"v": "x" * 2_000_000}, expect=None)
    assert not isinstance(caught.value, BackendUnavailable)
    # over gRPC's limit too: "received message larger than max" (RESOURCE_EXHAUSTED, like a rate limit)
    with pytest.raises(BackendError, match="larger than max.*--max-request-bytes") as caught:
        b.join_queue("locks/" + "q" * 3_000_000, {}, lease)
    assert not isinstance(caught.value, BackendUnavailable)
    assert requests_sent == {"/v3/kv/txn": 2}  # one attempt each, no retry
    assert b.read_queue("locks/q").entries == []  # and the client still works


# -- servers that are not a v3 etcd client port, and endpoints that are down ----------------------


def test_redis_port_is_not_an_etcd(redis_server: RedisServer) -> None:
    b = make(f"etcd3://{redis_server.endpoint}", retry_max_delay=5)
    with pytest.raises(UnsupportedServer, match=f"{redis_server.endpoint} is not an etcd server.*HTTP"):
        b.read_queue("locks/q")


def test_the_peer_port_is_named(any_gateway: EtcdServer) -> None:
    b = make(f"etcd3://127.0.0.1:{any_gateway.peer_port}", retry_max_delay=5)
    expected = f"127.0.0.1:{any_gateway.peer_port} is etcd's peer port; use the client port, usually 2379"
    with pytest.raises(UnsupportedServer, match=f"{expected}.*{any_gateway.client_url}"):
        b.read_queue("locks/q")


class _NotEtcd(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        self.send_error(404)

    do_POST = do_GET  # noqa: N815

    def log_message(self, *args: Any) -> None:
        pass


class _Unavailable(_NotEtcd):
    def do_GET(self) -> None:  # noqa: N802
        self.send_error(503)

    do_POST = do_GET  # noqa: N815


@contextmanager
def http_server(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[int]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield httpd.server_address[1]
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_plain_http_server_is_not_an_etcd() -> None:
    with http_server(_NotEtcd) as port:
        b = make(f"etcd3://127.0.0.1:{port}", retry_max_delay=5)
        with pytest.raises(UnsupportedServer, match="is not an etcd server.*404"):
            b.grant(5)


def test_http_5xx_is_retried_then_backend_unavailable() -> None:
    with http_server(_Unavailable) as port:
        b = make(f"etcd3://127.0.0.1:{port}", retry_max_delay=0.3)
        with pytest.raises(BackendUnavailable, match="HTTP 503"):
            b.read_queue("locks/q")


def test_etcd_without_the_json_gateway(etcd_server_factory: Callable[..., EtcdServer]) -> None:
    etcd = etcd_server_factory("3.5", enable_v2=False, extra_flags=("--enable-grpc-gateway=false",))
    b = make(etcd.url(), retry_max_delay=5)
    with pytest.raises(UnsupportedServer, match="etcd 3.5.* does not serve the v3 JSON gateway"):
        b.read_queue("locks/q")


def test_unreachable_endpoint_is_backend_unavailable() -> None:
    port = free_port()
    b = make(f"etcd3://127.0.0.1:{port}", retry_max_delay=0.3)
    with pytest.raises(BackendUnavailable, match=f"127.0.0.1:{port}") as caught:
        b.read_queue("locks/q")
    assert caught.value.endpoints == (f"http://127.0.0.1:{port}",)


def test_fail_over_to_the_next_endpoint(etcd35_server: EtcdServer, prefix: str) -> None:
    dead = free_port()
    b = make(f"etcd3://127.0.0.1:{dead},{etcd35_server.endpoint}?prefix={prefix}", retry_max_delay=10)
    entry = join(b, "locks/q", b.grant(10))
    assert b.read_queue("locks/q").entries == [entry]
    assert b.gateway.current == 1


# -- TLS ----------------------------------------------------------------------------------------


def test_tls(etcd_server_factory: Callable[..., EtcdServer], monkeypatch: pytest.MonkeyPatch) -> None:
    etcd = etcd_server_factory("3.5", enable_v2=False, tls=True)
    for name in ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"):  # requests would trust these: the URL alone says whom
        monkeypatch.setenv(name, str(etcd.ca_file))
    b = make(etcd.url(prefix="/tls"), retry_max_delay=5)  # with ?ca=&cert=&key=
    entry = join(b, "locks/q", b.grant(10))
    assert b.read_queue("locks/q").entries == [entry]
    assert b.wait_gone(entry, b.read_queue("locks/q").revision, timeout=0.2) is WaitResult.TIMEOUT

    plain = make(f"etcd3://{etcd.endpoint}", retry_max_delay=5)
    with pytest.raises(UnsupportedServer, match="speaks TLS only.*etcd3s://"):
        plain.read_queue("locks/q")

    unverified = make(f"etcd3s://{etcd.endpoint}", retry_max_delay=5)
    with pytest.raises(BackendError, match="could not be verified.*ca="):
        unverified.read_queue("locks/q")


def test_tls_scheme_against_a_plain_server(etcd35_server: EtcdServer) -> None:
    b = make(f"etcd3s://{etcd35_server.endpoint}", retry_max_delay=5)
    with pytest.raises(UnsupportedServer, match="does not speak TLS.*etcd3://"):
        b.read_queue("locks/q")


def test_tls_with_client_certificates_and_password_auth(etcd_server_factory: Callable[..., EtcdServer]) -> None:
    etcd = etcd_server_factory("3.5", enable_v2=False, tls=True, client_cert_auth=True, auth=True)
    b = make(etcd.url(prefix="/mtls"), retry_max_delay=5)  # etcd3s://app:app-secret@...?ca=&cert=&key=
    entry = join(b, "locks/q", b.grant(10))
    assert b.read_queue("locks/q").entries == [entry]
    assert b.keep_alive(b.grant(10), [], timeout=5) == set()

    no_cert = make(f"etcd3s://app:app-secret@{etcd.endpoint}?ca={etcd.ca_file}", retry_max_delay=0.5)
    with pytest.raises(BackendError, match="refused the TLS connection.*client certificate.*cert="):
        no_cert.read_queue("locks/q")


# -- a server that stops answering or dies during a watch -----------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("api", ["v3"])
def test_a_watch_on_a_frozen_server_ends_at_its_deadline(own_etcd: EtcdServer) -> None:
    b = make(own_etcd.url(prefix="/frozen"), retry_max_delay=2, timeout=2)
    entry = join(b, "locks/q", b.grant(30))
    ranges = ranges_served(own_etcd)
    waiter = Waiter(b, entry, timeout=3)
    _wait_for_the_watch(own_etcd, ranges)
    own_etcd.pause()
    try:
        waiter.join(30)
        assert not waiter.is_alive(), "wait_gone hung past its deadline"
        assert waiter.error is None and waiter.result is WaitResult.TIMEOUT
    finally:
        own_etcd.resume()


@pytest.mark.parametrize("api", ["v3"])
def test_a_watch_whose_server_dies_is_backend_unavailable(own_etcd: EtcdServer) -> None:
    b = make(own_etcd.url(prefix="/dies"), retry_max_delay=1)
    entry = join(b, "locks/q", b.grant(30))
    waiter = Waiter(b, entry, timeout=120)
    wait_until(lambda: watch_streams(own_etcd) >= 1, 30, "the watch to be established")
    own_etcd.kill()
    waiter.join(60)
    assert not waiter.is_alive(), "wait_gone hung after etcd died"
    assert isinstance(waiter.error, BackendUnavailable), waiter.error
    assert own_etcd.endpoint in str(waiter.error)


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
        (8, "grpc: received message larger than max (3000009 vs. 2097152)", BackendError),  # never retried
        (3, "etcdserver: request is too large", BackendError),
        (5, "etcdserver: requested lease not found", Failure),  # an answer, not retried
        (3, "etcdserver: duplicate key given in txn request", Failure),
    ],
)
def test_grpc_errors_are_classified(code: int, message: str, kind: type[Exception]) -> None:
    gateway = Gateway(parse_url("etcd3://127.0.0.1:1,127.0.0.1:2"))
    error = gateway.grpc_error(0, code, message)
    assert isinstance(error, kind)
    assert not isinstance(error, BackendUnavailable)
    assert message in str(error)


def test_the_backends_import_no_http_client_library() -> None:
    """The transport is our own (transport.py): no requests, urllib3, http.client or python-etcd."""
    code = (
        "import sys, celery_etcdlock.etcd.etcd3, celery_etcdlock.etcd.etcd2; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('requests', 'urllib3', 'etcd') "
        "or m == 'http.client'))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]"
