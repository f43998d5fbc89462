"""A broken or hostile endpoint: what a proxy, a load balancer or a misbehaving member may send (issue 24).

Each server here is a real socket on loopback that answers from a script
(``tests/support/scripted.py``): a real etcd cannot be made to send one byte
at a time, a body of 400 MB, ``Content-Length: ²`` or a token with a line
break in it. Where the bug shows on a real server (nested prefixes, large v2
data, non-ASCII prefixes), the test uses one.
"""

from __future__ import annotations

import json
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

import pytest
from celery.bin.celery import celery as celery_cli
from click.testing import CliRunner

from celery_etcdlock import Mutex, connect
from celery_etcdlock.errors import BackendError, BackendUnavailable
from celery_etcdlock.etcd import native, transport
from celery_etcdlock.etcd.etcd2 import Etcd2Backend
from celery_etcdlock.etcd.etcd3 import Etcd3Backend
from celery_etcdlock.etcd.gateway import Gateway
from celery_etcdlock.etcd.transport import Pool
from celery_etcdlock.options import parse_url
from tests.support import EtcdServer, make_certificates, wait_until
from tests.support.scripted import OK, Proxy, ScriptedServer, keep_alive, scripted

Next = Callable[[], bytes]


# -- the transport: a deadline per request, bounded answers, nothing sent twice that may do harm ------------------


def test_a_server_that_sends_one_byte_at_a_time_cannot_hold_a_request_past_its_timeout() -> None:
    def trickle(conn: socket.socket, number: int, next_request: Next) -> None:
        next_request()
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 60\r\n\r\n")
        for _ in range(60):  # a byte well within every read timeout: only a total deadline ends it
            conn.sendall(b"x")
            time.sleep(0.1)  # the hostile server's pace, not a synchronisation

    with scripted(trickle) as (server, pool), pytest.raises(transport.ReadTimeout, match="deadline"):
        pool.request("GET", "/v2/keys/x", timeout=0.5)


def test_a_body_over_the_cap_is_refused_without_being_read_in() -> None:
    def announce_400_mb(conn: socket.socket, number: int, next_request: Next) -> None:
        next_request()
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 400000000\r\n\r\n" + b"x" * 65536)
        next_request()  # and wait: a client that reads it in waits for the rest

    with scripted(announce_400_mb) as (server, pool), pytest.raises(transport.TooLarge, match="400000000"):
        pool.request("POST", "/v3/kv/range", b"{}", timeout=5)


@pytest.mark.parametrize("framing", ["chunked", "until close"])
def test_a_body_that_grows_past_the_cap_is_refused(framing: str) -> None:
    mib = b"x" * (1 << 20)

    def nine_mib(conn: socket.socket, number: int, next_request: Next) -> None:
        next_request()
        if framing == "chunked":
            conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for _ in range(9):
                conn.sendall(b"100000\r\n" + mib + b"\r\n")
            conn.sendall(b"0\r\n\r\n")
        else:
            conn.sendall(b"HTTP/1.1 200 OK\r\n\r\n" + mib * 9)

    with scripted(nine_mib) as (server, pool), pytest.raises(transport.TooLarge):
        pool.request("GET", "/v2/keys/x", timeout=10)


def test_a_streamed_line_over_the_cap_is_refused() -> None:
    def endless_line(conn: socket.socket, number: int, next_request: Next) -> None:
        next_request()
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        conn.sendall(b'e\r\n{"result":{}}\n\r\n')  # one good line, then one that never ends
        for _ in range(9):
            conn.sendall(b"100000\r\n" + b"x" * (1 << 20) + b"\r\n")
        next_request()

    with scripted(endless_line) as (server, pool):
        response = pool.request("POST", "/v3/watch", b"{}", timeout=10, stream=True)
        lines = response.lines(time.monotonic() + 10)
        assert next(lines) == b'{"result":{}}'
        with pytest.raises(transport.TooLarge, match="line"):
            next(lines)
        response.close()


@pytest.mark.parametrize("length", ["²", "¹²", "+2", "2x"])
def test_a_content_length_that_is_not_ascii_digits_is_a_protocol_error(length: str) -> None:
    def odd_length(conn: socket.socket, number: int, next_request: Next) -> None:
        next_request()
        conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {length}\r\n\r\nok".encode("latin-1"))
        next_request()

    with scripted(odd_length) as (server, pool), pytest.raises(transport.ProtocolError, match="Content-Length"):
        pool.request("GET", "/", timeout=5)


def test_a_header_value_with_a_line_break_is_never_sent() -> None:
    with scripted(keep_alive) as (server, pool):
        with pytest.raises(ValueError, match="line break"):
            pool.request("POST", "/v3/kv/range", b"{}", {"Authorization": "token\r\nX-Injected: 1"}, timeout=5)
        assert server.requests == []


def test_a_request_that_reached_the_server_is_sent_again_only_if_that_is_harmless() -> None:
    """A reused connection the server hangs up on after reading the request: a POST may have been applied."""

    def hang_up_on_the_second(conn: socket.socket, number: int, next_request: Next) -> None:
        next_request()
        conn.sendall(OK)
        if number == 0:
            next_request()  # read it, then close without a word
            return
        while next_request():
            conn.sendall(OK)

    with scripted(hang_up_on_the_second) as (server, pool):
        assert pool.request("GET", "/first", timeout=5).body == b"ok"
        with pytest.raises(transport.NoResponse):  # a write: the backend's retry policy decides, with its checks
            pool.request("POST", "/v3/kv/txn", b"{}", timeout=5)
        assert [r.split(b" ")[1] for r in server.requests] == [b"/first", b"/v3/kv/txn"]

        # a read its caller calls idempotent is sent again at once, on a new connection
        server.script = hang_up_on_the_second
        pool.close()
    with scripted(hang_up_on_the_second) as (server, pool):
        assert pool.request("GET", "/first", timeout=5).body == b"ok"
        assert pool.request("POST", "/v3/kv/range", b"{}", timeout=5, idempotent=True).body == b"ok"
        assert [r.split(b" ")[1] for r in server.requests] == [b"/first", b"/v3/kv/range", b"/v3/kv/range"]


# -- the backends: every answer they cannot read is one of the package's errors, naming the endpoint --------------


def answering(status: int, body: bytes, headers: str = "Content-Type: application/json\r\n") -> ScriptedServer:
    """A server that answers every request with ``status``, ``headers`` and ``body``."""

    def script(conn: socket.socket, number: int, next_request: Next) -> None:
        while next_request():
            head = f"HTTP/1.1 {status} X\r\n{headers}Content-Length: {len(body)}\r\n\r\n"
            conn.sendall(head.encode("latin-1") + body)

    return ScriptedServer(script)


@contextmanager
def servers(*answers: tuple[int, bytes] | tuple[int, bytes, str]) -> Iterator[str]:
    """The servers of ``answers``, as the host list of an etcd URL."""
    started = [answering(*answer) for answer in answers]
    try:
        yield ",".join(f"127.0.0.1:{server.port}" for server in started)
    finally:
        for server in started:
            server.listener.close()


GOOD_V3 = json.dumps({"header": {"revision": "7", "raft_term": "2"}, "kvs": []}).encode()
V3_UNREADABLE = {
    "empty object": b"{}",
    "wrong types": json.dumps({"header": {"revision": "seven"}, "kvs": []}).encode(),
    "a key that is a number": json.dumps({"header": {"revision": "7"}, "kvs": [{"key": 5}]}).encode(),
    "kvs that are an object": json.dumps({"header": {"revision": "7"}, "kvs": {"a": 1}}).encode(),
    "nested too deep": b"[" * 100_000 + b"]" * 100_000,
}


@pytest.mark.parametrize("answer", V3_UNREADABLE.values(), ids=V3_UNREADABLE.keys())
def test_v3_an_answer_it_cannot_read_is_a_backend_error_naming_the_endpoint(answer: bytes) -> None:
    with servers((200, answer)) as hosts:
        backend = Etcd3Backend(parse_url(f"etcd3://{hosts}?retry_max_delay=1"))
        with pytest.raises(BackendError, match=hosts) as caught:
            backend.read_queue("locks/x")
        assert not isinstance(caught.value, BackendUnavailable)  # an answer, not an outage
        backend.close()


def test_v3_an_answer_it_cannot_read_fails_over_to_another_endpoint() -> None:
    with servers((200, b"{}"), (200, GOOD_V3)) as hosts:
        backend = Etcd3Backend(parse_url(f"etcd3://{hosts}?retry_max_delay=5"))
        assert backend.read_queue("locks/x").revision == 7
        assert backend.gateway.current == 1
        backend.close()


V2_DIR = json.dumps({"action": "get", "node": {"key": "/p/locks/x", "dir": True, "nodes": []}}).encode()
V2_UNREADABLE = {
    "empty object": (200, b"{}", "X-Etcd-Index: 3\r\n"),
    "a node that is a list": (200, b'{"node": []}', "X-Etcd-Index: 3\r\n"),
    "an index that is not a number": (200, V2_DIR, "X-Etcd-Index: abc\r\n"),
    "nested too deep": (200, b"[" * 100_000 + b"]" * 100_000, ""),
    "an error body that is not UTF-8": (400, b"\xff\xfe\x00bad", ""),
}


@pytest.mark.parametrize("answer", V2_UNREADABLE.values(), ids=V2_UNREADABLE.keys())
def test_v2_an_answer_it_cannot_read_is_a_backend_error_naming_the_endpoint(answer: tuple[int, bytes, str]) -> None:
    with servers(answer) as hosts:
        backend = Etcd2Backend(parse_url(f"etcd://{hosts}?prefix=/p&retry_max_delay=1"))
        with pytest.raises(BackendError, match=hosts) as caught:
            backend.read_queue("locks/x")
        assert not isinstance(caught.value, BackendUnavailable)
        backend.close()


def test_v2_a_proxy_error_page_is_retried_on_another_endpoint() -> None:
    """An HTML 502 from a proxy in front of one member: worth a retry elsewhere, as v3 has it."""
    html = b"<html><body><h1>502 Bad Gateway</h1></body></html>"
    with servers((502, html, "Content-Type: text/html\r\n"), (200, V2_DIR, "X-Etcd-Index: 9\r\n")) as hosts:
        backend = Etcd2Backend(parse_url(f"etcd://{hosts}?prefix=/p&retry_max_delay=5"))
        assert backend.read_queue("locks/x").revision == 9
        backend.close()
    with servers((503, html, "Content-Type: text/html\r\n")) as hosts:  # and alone: an outage, once given up
        backend = Etcd2Backend(parse_url(f"etcd://{hosts}?prefix=/p&retry_max_delay=0.3"))
        with pytest.raises(BackendUnavailable, match="503"):
            backend.read_queue("locks/x")
        backend.close()


def test_v2_a_redirect_is_named_as_one() -> None:
    with servers((307, b"", "Location: http://elsewhere:2379/v2/keys/p\r\n")) as hosts:
        backend = Etcd2Backend(parse_url(f"etcd://{hosts}?prefix=/p&retry_max_delay=1"))
        with pytest.raises(BackendError, match="redirect to 'http://elsewhere:2379/v2/keys/p'"):
            backend.read_queue("locks/x")
        backend.close()


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_certificates(tmp_path_factory.mktemp("tls"))


def test_v2_a_certificate_that_fails_verification_fails_at_once_with_the_reason(certificates: dict[str, Path]) -> None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certificates["server_cert"], certificates["server_key"])
    server = ScriptedServer(keep_alive, tls=context)
    backend = Etcd2Backend(parse_url(f"etcds://127.0.0.1:{server.port}?retry_max_delay=2"))  # the system's CAs
    try:
        with pytest.raises(BackendError, match="could not be verified") as caught:
            backend.read_queue("locks/x")
        assert not isinstance(caught.value, BackendUnavailable)
    finally:
        backend.close()
        server.listener.close()


def test_v3_a_token_with_a_line_break_never_reaches_a_header() -> None:
    def auth(conn: socket.socket, number: int, next_request: Next) -> None:
        while request := next_request():
            if request.startswith(b"POST /v3/auth/authenticate"):
                body = json.dumps({"header": {}, "token": "tok\r\nX-Injected: yes"}).encode()
            else:
                body = GOOD_V3
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)

    server = ScriptedServer(auth)
    gateway = Gateway(parse_url(f"etcd3://app:secret@127.0.0.1:{server.port}?retry_max_delay=1"))
    try:
        with pytest.raises(BackendError, match="line break"):
            gateway.post("kv/range", {"key": "eA=="})
        assert not any(b"X-Injected" in request for request in server.requests)
    finally:
        gateway.close()
        server.listener.close()


# -- a renewal that cannot finish in time: the lock is lost, and on_lost runs, on time ------------------------------


@pytest.mark.parametrize("api", ["v3", "v2"])
def test_a_renewal_held_up_by_a_trickling_endpoint_loses_the_lock_on_time(
    etcd_server_for_api: EtcdServer, api: str
) -> None:
    """One byte per 0.2 s from the endpoint once the lock is held: without a total deadline per request, a
    renewal waits for ever (every read gets its byte in time), and on_lost is never called."""
    proxy = Proxy(("127.0.0.1", etcd_server_for_api.client_port))
    scheme = "etcd3" if api == "v3" else "etcd"
    client = connect(f"{scheme}://127.0.0.1:{proxy.port}?prefix=/hostile-{api}&timeout=1&retry_max_delay=1")
    lost = threading.Event()
    lock = Mutex(client, "renewed", ttl=3, on_lost=lambda _: lost.set())
    try:
        assert lock.acquire(timeout=5)
        proxy.trickle = True
        wait_until(lost.is_set, 30, "on_lost to be called once no renewal could land in time")
        assert not lock.held
    finally:
        proxy.close()
        client.close()


# -- names and prefixes -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("host", ["h1\r\nX-Injected: 1", "h1\tx", "h1\x00", "bücher.example"])
def test_a_host_with_control_characters_or_not_in_ascii_is_refused_when_the_url_is_parsed(host: str) -> None:
    with pytest.raises(ValueError, match="host"):
        parse_url(f"etcd3://{host}:2379")


@pytest.mark.parametrize("api", ["v2"])
def test_v2_a_prefix_that_is_not_ascii_is_percent_encoded(etcd_server_for_api: EtcdServer, api: str) -> None:
    """ "é" sent raw is one latin-1 byte (a wrong key), "日本" cannot be sent raw at all."""
    prefix = f"/préfix-日本-{time.monotonic_ns()}"
    client = connect(etcd_server_for_api.url(prefix=prefix))
    try:
        with Mutex(client, "x", ttl=5):
            listed = Pool("127.0.0.1", etcd_server_for_api.client_port).request(
                "GET", "/v2/keys" + quote(prefix) + "/locks/x", timeout=5
            )
            node = json.loads(listed.body)["node"]
            assert node["key"] == f"{prefix}/locks/x" and len(node["nodes"]) == 1
    finally:
        client.close()


@pytest.mark.parametrize("api", ["v3", "v2"])
def test_nested_prefixes_are_isolated(
    etcd_server_for_api: EtcdServer, api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """App A on /nest and app B on /nest/locks: A's lock named "locks" is A's alone, and A's
    `celery etcdlock release locks` leaves B's locks be."""
    base = f"/nest-{time.monotonic_ns()}"
    a, b, b2 = (connect(etcd_server_for_api.url(prefix=prefix)) for prefix in (base, f"{base}/locks", f"{base}/locks"))
    try:
        held_by_b = Mutex(b, "locks", ttl=10)  # B's key: <base>/locks/locks/locks/<entry>, under A's lock "locks"
        assert held_by_b.acquire(timeout=5)
        assert Mutex(b, "x", ttl=10).acquire(timeout=5)
        mine = Mutex(a, "locks", ttl=10)
        assert mine.acquire(blocking=False)  # B's entries are not holders of A's lock
        mine.release()

        module = f"nested_{uuid.uuid4().hex[:8]}"
        base_url, _, _ = etcd_server_for_api.url(prefix=base).partition("?")
        settings = {"etcdlock_url": base_url, "etcdlock_prefix": base}
        (tmp_path / f"{module}.py").write_text(f"from celery import Celery\napp = Celery({module!r})\n"
                                               f"app.conf.update({settings!r})\n")  # fmt: skip
        monkeypatch.syspath_prepend(str(tmp_path))
        result = CliRunner().invoke(celery_cli, ["-A", module, "etcdlock", "release", "locks", "--yes"])
        assert "Released" not in result.output and "not held" in result.output, result.output

        assert held_by_b.held
        assert not Mutex(b2, "locks", ttl=10).acquire(blocking=False)  # a second B process: still B's first's
    finally:
        for client in (a, b, b2):
            client.close()


# -- v2 lock data over 4 KB ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("api", ["v2"])
def test_v2_a_lock_with_data_over_4_kb_is_released_at_once(etcd_server_for_api: EtcdServer, api: str) -> None:
    url = etcd_server_for_api.url(prefix=f"/big-{time.monotonic_ns()}")
    first, second = connect(url), connect(url)
    try:
        lock = Mutex(first, "big", ttl=30, data={"report": "x" * 6000})
        assert lock.acquire(timeout=5)
        lock.release()
        assert Mutex(second, "big", ttl=30).acquire(blocking=False)  # not after the 30 s TTL
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize("api", ["v2"])
def test_v2_an_entry_renewed_elsewhere_is_still_deleted_by_index(etcd_server_for_api: EtcdServer, api: str) -> None:
    """A renewal moves the key's modifiedIndex; under gevent the renewer is another backend (its twin)."""
    options = parse_url(etcd_server_for_api.url(prefix=f"/renewed-{time.monotonic_ns()}"))
    backend, twin = Etcd2Backend(options), Etcd2Backend(options, native=True)
    try:
        lease = backend.grant(10)
        entry, _ = backend.join_queue("locks/x", {"data": "y" * 5000}, lease)
        assert twin.keep_alive(lease, [entry], timeout=5) == set()
        assert backend.delete_entry(entry)
        assert backend.read_queue("locks/x").entries == []
        assert not backend.delete_entry(entry)  # gone: False, as before
    finally:
        backend.close()
        twin.close()


@pytest.mark.parametrize("sockets", ["standard library", "native"])
def test_a_tls_handshake_sent_one_byte_at_a_time_ends_by_the_request_timeout(
    sockets: str, certificates: dict[str, Path]
) -> None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certificates["server_cert"], certificates["server_key"])
    server = ScriptedServer(keep_alive, tls=context)
    proxy = Proxy(("127.0.0.1", server.port), pace=0.05)
    proxy.trickle = True  # a certificate's kilobytes, each byte well within any read timeout
    tls = transport.tls_context(parse_url(f"etcd3s://127.0.0.1?ca={certificates['ca']}"))
    kind = {"connect": native.create_connection, "wrap_tls": native.wrap_tls} if sockets == "native" else {}
    pool = Pool("127.0.0.1", proxy.port, tls, **kind)  # type: ignore[arg-type]
    try:
        with pytest.raises(TimeoutError):
            pool.request("GET", "/", timeout=0.5)
    finally:
        pool.close()
        proxy.close()
        server.listener.close()
