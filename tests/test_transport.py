"""The HTTP/1.1 client under both backends (etcd/transport.py), against scripted servers.

What the backends' tests against etcd cannot make happen on demand: a server
that closes an idle kept-alive connection, one that hangs up after reading a
request, ``Connection: close``, a stream that stops, a body cut short. Each
test's server is a real socket on loopback that answers from a script, and
records every request and connection it saw. How the backends use the
transport (auth, TLS, errors, fail-over) is tested in test_gateway.py,
test_etcd2_backend.py and test_connect.py.
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from celery_etcdlock.etcd import native, transport
from celery_etcdlock.etcd.transport import Pool
from celery_etcdlock.locks.connect import parse_url
from tests.support import wait_until
from tests.support.scripted import OK, ScriptedServer, keep_alive, scripted
from tests.support.tls import make_certificates


def test_sequential_requests_share_one_kept_alive_connection() -> None:
    with scripted(keep_alive) as (server, pool):
        for _ in range(5):
            response = pool.request("POST", "/v3/kv/range", b"{}", {"Content-Type": "application/json"})
            assert (response.status, response.body) == (200, b"ok")
        assert server.connections == 1 and pool.idle_connections == 1
        assert server.requests[0].startswith(b"POST /v3/kv/range HTTP/1.1\r\nHost: 127.0.0.1:")
        assert b"Content-Length: 2\r\n" in server.requests[0]


def test_an_idle_connection_the_server_closed_is_not_reused() -> None:
    def one_request_each(conn: socket.socket, number: int, next_request: Callable[[], bytes]) -> None:
        next_request()
        conn.sendall(OK)  # kept alive, as far as the client knows, then closed while idle

    with scripted(one_request_each) as (server, pool):
        assert pool.request("GET", "/a").body == b"ok"
        wait_until(lambda: transport._readable(pool._idle[0].sock), 10, "the server to close the idle connection")
        assert pool.request("GET", "/b").body == b"ok"
    assert server.connections == 2 and len(server.requests) == 2


def test_a_request_the_server_hung_up_on_unanswered_is_sent_once_more_only_on_a_reused_connection() -> None:
    """The server closes a kept-alive connection as the next request arrives (it read it, answered nothing)."""

    def hang_up_on_the_second(conn: socket.socket, number: int, next_request: Callable[[], bytes]) -> None:
        next_request()
        conn.sendall(OK)
        if number == 0:
            next_request()  # and close without a word

    with scripted(hang_up_on_the_second) as (server, pool):
        assert pool.request("GET", "/first").body == b"ok"
        assert pool.request("GET", "/second").body == b"ok"  # on a new connection
        assert server.connections == 2
        assert [r.split(b" ")[1] for r in server.requests] == [b"/first", b"/second", b"/second"]

        # the same on a new connection is the server's answer: raised, not sent again
        def hang_up(conn: socket.socket, number: int, next_request: Callable[[], bytes]) -> None:
            next_request()

        server.script = hang_up
        pool.close()
        with pytest.raises(transport.NoResponse, match="without response"):
            Pool("127.0.0.1", server.port).request("POST", "/third", b"{}")
        assert server.connections == 3 and server.requests[-1].startswith(b"POST /third")


def test_connection_close_and_http_1_0_answers_are_not_kept() -> None:
    def answers(conn: socket.socket, number: int, next_request: Callable[[], bytes]) -> None:
        while next_request():
            if number == 0:
                conn.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok")
            else:
                conn.sendall(b"HTTP/1.0 200 OK\r\n\r\nok")  # its body ends with the connection
                return

    with scripted(answers) as (server, pool):
        assert pool.request("GET", "/").body == b"ok"
        assert pool.idle_connections == 0
        assert pool.request("GET", "/").body == b"ok"
        assert pool.idle_connections == 0
    assert server.connections == 2


def test_a_chunked_stream_ends_at_its_deadline_and_its_connection_is_closed() -> None:
    def stream(conn: socket.socket, number: int, next_request: Callable[[], bytes]) -> None:
        next_request()
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        conn.sendall(b'5\r\n{"a":\r\n')  # a message in two chunks
        conn.sendall(b"3\r\n1}\n\r\n")
        conn.sendall(b'10\r\n{"b":2}\n{"c":3}\n\r\n')
        next_request()  # then nothing more, until the client hangs up

    with scripted(stream) as (server, pool):
        response = pool.request("POST", "/v3/watch", b"{}", timeout=5, stream=True)
        started = time.monotonic()
        lines = list(response.lines(started + 0.5))
        response.close()
        assert lines == [b'{"a":1}', b'{"b":2}', b'{"c":3}']
        assert 0.4 < time.monotonic() - started < 5  # ended by the deadline, not by the 5 s read timeout
        assert not response.complete and pool.idle_connections == 0


def test_a_whole_chunked_body_with_trailers_is_read_and_the_connection_kept() -> None:
    def chunked(conn: socket.socket, number: int, next_request: Callable[[], bytes]) -> None:
        while next_request():
            conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Etcd-Index: 7\r\n\r\n")
            conn.sendall(b"3;ext=1\r\nabc\r\n2\r\nde\r\n0\r\nX-Trailer: t\r\n\r\n")

    with scripted(chunked) as (server, pool):
        for _ in range(2):
            response = pool.request("GET", "/v2/keys/a?wait=true")
            assert (response.body, response.headers["x-etcd-index"]) == (b"abcde", "7")
        assert server.connections == 1


def test_a_silent_server_is_a_read_timeout_and_a_body_cut_short_an_error() -> None:
    def silent_then_short(conn: socket.socket, number: int, next_request: Callable[[], bytes]) -> None:
        next_request()
        if number == 1:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort")
            return
        next_request()  # silent until the client hangs up

    with scripted(silent_then_short) as (server, pool):
        started = time.monotonic()
        with pytest.raises(transport.ReadTimeout):
            pool.request("GET", "/", timeout=0.3)
        assert time.monotonic() - started < 5
        with pytest.raises(transport.ConnectionClosed, match="middle of the response body"):
            pool.request("GET", "/")
        assert pool.idle_connections == 0


def test_what_is_not_http_is_named() -> None:
    def redis_like(conn: socket.socket, number: int, next_request: Callable[[], bytes]) -> None:
        next_request()
        conn.sendall(b"-ERR unknown command\r\n")
        next_request()

    with scripted(redis_like) as (server, pool), pytest.raises(transport.NotHTTP) as caught:
        pool.request("GET", "/version", timeout=5)
    assert caught.value.greeting.startswith(b"-ERR")


# -- TLS: the certificate and the name (or IP address) it is for are checked, on both kinds of sockets ------------

SOCKETS: dict[str, dict[str, Any]] = {
    "standard library": {},
    "native (TLS on a memory BIO)": {"connect": native.create_connection, "wrap_tls": native.wrap_tls},
}


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_certificates(tmp_path_factory.mktemp("tls"))  # a server certificate for 127.0.0.1 and localhost


@pytest.mark.parametrize("sockets", SOCKETS)
def test_tls_checks_the_certificate_and_the_name_it_is_for(sockets: str, certificates: dict[str, Path]) -> None:
    server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_context.load_cert_chain(certificates["server_cert"], certificates["server_key"])
    for listen_on, connect_to, refusal in [
        ("127.0.0.1", "127.0.0.1", None),  # the IP address in the certificate
        ("127.0.0.1", "localhost", None),  # the name in the certificate
        ("127.0.0.2", "127.0.0.2", "IP address mismatch"),  # another loopback address, not in the certificate
    ]:
        server = ScriptedServer(keep_alive, listen_on, server_context)
        options = parse_url(f"etcd3s://{connect_to}:{server.port}?ca={certificates['ca']}")
        pool = Pool(connect_to, server.port, transport.tls_context(options), **SOCKETS[sockets])
        try:
            if refusal is None:
                assert [pool.request("GET", "/").body for _ in range(3)] == [b"ok"] * 3
                assert server.connections == 1  # kept alive over TLS too
            else:
                with pytest.raises(ssl.SSLCertVerificationError, match=refusal):
                    pool.request("GET", "/")
        finally:
            pool.close()
            server.listener.close()

    # and a CA that did not sign it
    server = ScriptedServer(keep_alive, "127.0.0.1", server_context)
    pool = Pool("127.0.0.1", server.port, transport.tls_context(parse_url("etcd3s://127.0.0.1")), **SOCKETS[sockets])
    try:
        with pytest.raises(ssl.SSLCertVerificationError, match="unable to get local issuer|self.signed"):
            pool.request("GET", "/")
    finally:
        pool.close()
        server.listener.close()
