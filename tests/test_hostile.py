"""A broken or hostile endpoint: what a proxy, a load balancer or a misbehaving member may send (issue 24).

Each server here is a real socket on loopback that answers from a script
(``tests/support/scripted.py``): a real etcd cannot be made to send one byte
at a time, a body of 400 MB, ``Content-Length: ²`` or a token with a line
break in it. Where the bug shows on a real server (nested prefixes, large v2
data, non-ASCII prefixes), the test uses one.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import pytest

from celery_etcdlock.etcd import transport
from tests.support.scripted import OK, keep_alive, scripted

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
