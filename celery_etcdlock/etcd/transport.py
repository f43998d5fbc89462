"""A small HTTP/1.1 client: what the etcd backends need of HTTP, and nothing more.

Both backends speak HTTP to etcd (v2: the keys API; v3: the JSON gateway).
A general client (urllib3 and http.client under it) cost them more client CPU
per request than all their other work: it parses response headers with the
``email`` package, builds several objects per request and wraps every call
in layers of options this package never uses. With many worker processes on
few cores, client CPU decides throughput. This module does one exchange at a
time on a kept-alive socket, and nothing else:

    pool = endpoint_pool(options, 0)                       # no I/O yet
    response = pool.request("POST", "/v3/kv/range", b'{"key":"eA=="}', {"Content-Type": "application/json"})
    response.status, response.headers["content-type"], response.body

    response = pool.request("POST", "/v3/watch", body, timeout=5, stream=True)   # the body is not read yet
    try:
        for line in response.lines(deadline): ...           # every read ends by the deadline
    finally:
        response.close()                                    # a body not read to its end closes the connection

What it does:

- one ``Pool`` per endpoint, of idle kept-alive connections, reused last in
  first out (the most recently used is the least likely to have been closed
  by the server). A connection is closed on any error, on ``Connection:
  close``, and when its response was not read to the end;
- before an idle connection is reused, a look at its socket: readable means
  the server closed it (or sent what it should not have), so it is closed;
- the server may still close an idle connection while our request is on its
  way. Such a request is sent once more, on a new connection, when the
  connection was reused, the server answered not a single byte (it closed or
  reset the connection), and sending it twice cannot do harm: the request is
  idempotent (a GET, or a request its caller says is, such as a read), or
  no complete copy of it reached the server (the send itself failed, and a
  server never acts on half a request). Any other request that may have
  reached the server is left to the backends' retry policy, which can tell
  an attempt that was applied from one that was lost (a create looks for its
  nonce, a compare-and-swap for its value) and can switch endpoints. No
  redirects, no proxies, no credentials from the environment: the URL says
  where etcd is and whom to trust (its ``?ca=``, else the system's CAs,
  which OpenSSL's ``SSL_CERT_FILE`` and ``SSL_CERT_DIR`` may name);
- Content-Length and chunked bodies, and bodies that end with the connection;
  a body (or a line of a streamed one) over ``MAX_BODY`` is refused with
  ``TooLarge`` before it is read in;
- a total deadline per request, its ``timeout``: connecting, the TLS
  handshake, sending and every read of the answer end by then, so a server
  that sends one byte at a time cannot hold a caller past it; a streamed
  body has a deadline of its own that every read ends by;
- TLS: certificate and host name (or IP address) checked, TLS 1.2 or later;
- header values with CR or LF are refused (``ValueError``): no text that
  came from a server can add a header;
- where sockets come from is a parameter: a session's renewer under gevent
  makes its connections on the OS's own sockets (``native.py``).

Errors are ``OSError``: the socket's own (refused, reset, ``ssl.SSLError``),
``ConnectionClosed`` and ``NoResponse`` (the server hung up), ``ReadTimeout``,
``NotHTTP`` (the server answered something else) and ``ProtocolError``
(``TooLarge``: an answer over ``MAX_BODY``).
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

from .. import green
from ..errors import BackendError
from ..options import ConnectionOptions
from . import native

MAX_IDLE = 32  # idle connections kept per endpoint; more are closed after use
_MAX_HEAD = 64 * 1024  # bytes of status line and headers we read before giving up on a response
_RECV_SIZE = 64 * 1024
#: the largest body (and line of a streamed body) read in: etcd takes requests up to 1.5 MiB (``--max-request-bytes``),
#: and what this package asks for (a queue, a lease's keys, a record) is far smaller; more is a server (or something in
#: the path) that misbehaves, and reading it in would cost the client its memory
MAX_BODY = 8 * 1024 * 1024


class ProtocolError(OSError):
    """The server's answer is not HTTP/1.1 we can read."""


class TooLarge(ProtocolError):
    """The answer is over ``MAX_BODY``: refused, not read in."""


class NotHTTP(ProtocolError):
    """The server answered, but not in HTTP: ``greeting`` is what it sent first."""

    def __init__(self, greeting: bytes) -> None:
        super().__init__(f"the server answered something that is not HTTP: {greeting[:80]!r}")
        self.greeting = greeting


class ConnectionClosed(ConnectionResetError):
    """The server closed the connection before its answer was complete."""


class NoResponse(ConnectionClosed):
    """The server closed (or reset) the connection without sending a byte of an answer."""


class ReadTimeout(TimeoutError):
    """The answer was not complete by the request's deadline (or a streamed body's)."""


class Socket(Protocol):
    """What this module uses of a socket: ``socket.socket``, ``ssl.SSLSocket`` and ``native.TLSSocket`` have it."""

    def sendall(self, data: bytes, /) -> None: ...
    def recv(self, size: int, /) -> bytes: ...
    def settimeout(self, timeout: float | None, /) -> None: ...
    def shutdown(self, how: int, /) -> None: ...
    def fileno(self) -> int: ...
    def close(self) -> None: ...


# a connected TCP socket to (host, port) within the timeout; then TLS over a socket, for a host name
Connect = Callable[[tuple[str, int], float], socket.socket]
WrapTLS = Callable[[socket.socket, ssl.SSLContext, str], Socket]


def _connect(address: tuple[str, int], timeout: float) -> socket.socket:
    # socket.create_connection looked up at each call: gevent's once it has patched the socket module
    return socket.create_connection(address, timeout)


def _wrap_tls(sock: socket.socket, context: ssl.SSLContext, hostname: str) -> Socket:
    return context.wrap_socket(sock, server_hostname=hostname)


def tls_context(options: ConnectionOptions) -> ssl.SSLContext:
    """A TLS client context from the URL: its CA (else the system's), its client certificate and key."""
    # ssl.SSLContext as it is now: under gevent its subclass, whose wrap_socket makes green sockets (and whose
    # property setters work once ssl is patched; the standard library's would recurse)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED, host name (or IP address) checked
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        if options.ca:
            context.load_verify_locations(options.ca)
        else:
            context.load_default_certs()
        if options.cert:
            context.load_cert_chain(options.cert, options.key)
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        files = [f"{name}={path}" for name, path in (("ca", options.ca), ("cert", options.cert), ("key", options.key))]
        given = ", ".join(f for f in files if not f.endswith("=None")) or "the system's CAs"
        raise BackendError(f"the TLS files of the etcd URL ({given}) could not be loaded: {exc}") from None
    return context


def endpoint_pool(options: ConnectionOptions, index: int, *, native_sockets: bool = False) -> Pool:
    """The pool of endpoint ``index``; ``native_sockets``: on the OS's own sockets (a native thread under gevent)."""
    host, port = options.endpoints[index]
    tls = tls_context(options) if options.tls else None
    if native_sockets:
        return Pool(host, port, tls, connect=native.create_connection, wrap_tls=native.wrap_tls)
    return Pool(host, port, tls)


_poll = green.original("select", "poll") if hasattr(select, "poll") else None  # never gevent's: no hub needed


def _readable(sock: Socket) -> bool:
    """Is there something to read (or an end of file) on an idle connection's socket, right now?"""
    if _poll is None:  # pragma: no cover - Windows has no poll
        return bool(select.select([sock], [], [], 0)[0])
    poller = _poll()
    poller.register(sock.fileno(), select.POLLIN)
    return bool(poller.poll(0))


class _Unanswered(NoResponse):
    """``NoResponse``, and whether the whole request had been sent (``delivered``): may it be sent again?"""

    def __init__(self, message: str, delivered: bool) -> None:
        super().__init__(message)
        self.delivered = delivered


def _remaining(deadline: float) -> float:
    """Seconds left until ``deadline``; ``ReadTimeout`` if none."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise ReadTimeout("the answer was not complete by the request's deadline")
    return remaining


class Connection:
    """One connection to the server: its socket, and what was read from it but not used yet."""

    def __init__(self, sock: Socket) -> None:
        self.sock = sock
        self.buffer = bytearray()
        self.reusable = True  # False once the server said it will close it, or a body ends with it
        self.deadline: float | None = None  # when set, every read ends by then (a streamed body)

    def close(self) -> None:
        self.reusable = False
        self.sock.close()

    def abort(self) -> None:
        """Shut the socket down, from any thread: a read blocked on it fails at once."""
        self.reusable = False
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def _fill(self) -> bool:
        """Read what came next into the buffer; False at the end of the stream."""
        if self.deadline is not None:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise ReadTimeout("the answer was not complete by the request's deadline")
            self.sock.settimeout(remaining)
        try:
            data = self.sock.recv(_RECV_SIZE)
        except TimeoutError:
            raise ReadTimeout("the answer was not complete by the request's deadline") from None
        self.buffer += data
        return bool(data)

    def read_head(self) -> tuple[int, dict[str, str]]:
        """The status and headers (names in lower case) of the response that comes next."""
        buffer = self.buffer
        while (end := buffer.find(b"\r\n\r\n")) < 0:
            if len(buffer) >= 5 and not buffer.startswith(b"HTTP/"):
                raise NotHTTP(bytes(buffer))
            if len(buffer) > _MAX_HEAD:
                raise ProtocolError(f"the response headers are over {_MAX_HEAD} bytes")
            try:
                more = self._fill()
            except ConnectionResetError as exc:
                if not buffer:
                    raise NoResponse(f"Remote end reset the connection without response ({exc})") from None
                raise
            if not more:
                if not buffer:
                    raise NoResponse("Remote end closed connection without response")
                if not buffer.startswith(b"HTTP/"):
                    raise NotHTTP(bytes(buffer))
                raise ConnectionClosed("Remote end closed connection in the middle of the response headers")
        status_line, *lines = buffer[:end].decode("latin-1").split("\r\n")
        del buffer[: end + 4]
        version, _, rest = status_line.partition(" ")
        try:
            status = int(rest[:3])
        except ValueError:
            raise ProtocolError(f"bad HTTP status line {status_line[:80]!r}") from None
        headers: dict[str, str] = {}
        for line in lines:
            name, _, value = line.partition(":")
            headers[name.lower()] = value.strip()  # a header sent twice keeps its last value: none we read repeats
        # HTTP/1.0 keeps a connection only if asked to: never reuse one, it costs nothing here
        if version != "HTTP/1.1" or headers.get("connection", "").lower() == "close":
            self.reusable = False
        return status, headers

    def read_exactly(self, size: int) -> bytes:
        if size > MAX_BODY:
            raise TooLarge(f"the server announced {size} bytes, over the {MAX_BODY} this client reads")
        while len(self.buffer) < size:
            if not self._fill():
                raise ConnectionClosed("Remote end closed connection in the middle of the response body")
        data = bytes(self.buffer[:size])
        del self.buffer[:size]
        return data

    def read_line(self) -> bytes:
        """The next CRLF-ended line, without its CRLF."""
        while (end := self.buffer.find(b"\r\n")) < 0:
            if len(self.buffer) > _MAX_HEAD:
                raise ProtocolError("a chunk size line is too long")
            if not self._fill():
                raise ConnectionClosed("Remote end closed connection in the middle of a chunked response body")
        line = bytes(self.buffer[:end])
        del self.buffer[: end + 2]
        return line

    def read_chunk(self) -> bytes:
        """The data of the next chunk of a chunked body; b"" after the last one (its trailers read)."""
        size_line = self.read_line()
        try:
            digits = size_line.split(b";", 1)[0].strip()
            if not digits.isalnum():  # int() takes "+1", "1_0" and spaces, which HTTP does not
                raise ValueError
            size = int(digits, 16)
        except ValueError:
            raise ProtocolError(f"bad chunk size line {size_line[:80]!r}") from None
        if size == 0:
            while self.read_line():  # trailers, up to the empty line
                pass
            return b""
        return self.read_exactly(size + 2)[:-2]  # and the CRLF after the data

    def read_some(self) -> bytes:
        """What has arrived of a body that ends with the connection; b"" at its end."""
        if not self.buffer and not self._fill():
            return b""
        data = bytes(self.buffer)
        self.buffer.clear()
        return data


class Response:
    """A response whose status and headers are read; its body is read by ``read()`` or ``lines()``.

    Once the body was read to its end, the connection goes back to its pool;
    ``close()`` closes it if not (always call it for a streamed response).
    """

    def __init__(self, pool: Pool, connection: Connection, status: int, headers: dict[str, str]) -> None:
        self.status = status
        self.headers = headers
        self.body = b""
        self.complete = False  # the body was read to its end
        self._pool = pool
        self._connection: Connection | None = connection

    def read(self) -> bytes:
        """The whole body (also kept as ``body``)."""
        self.body = b"".join(self._pieces(MAX_BODY))
        return self.body

    def lines(self, deadline: float) -> Iterator[bytes]:
        """The body's lines as they arrive, until it ends or ``deadline`` (``time.monotonic()``) passes.

        Every read waits at most until the deadline: a server that stops
        sending never holds the caller past it.
        """
        connection = self._connection
        assert connection is not None, "the body was read already"
        connection.deadline = deadline
        pending = b""
        try:
            for piece in self._pieces(None):  # a stream has no total size: each line is bounded instead
                pending += piece
                while (end := pending.find(b"\n")) >= 0:
                    yield pending[:end]
                    pending = pending[end + 1 :]
                if len(pending) > MAX_BODY:
                    self.close()
                    raise TooLarge(f"a line of the streamed answer is over the {MAX_BODY} bytes this client reads")
        except ReadTimeout:
            return  # the deadline passed (the reads wait for nothing longer)
        if pending:
            yield pending

    def abort(self) -> None:
        """End the reading of the body from another thread: the read fails at once (``close()`` it after)."""
        connection = self._connection
        if connection is not None:
            connection.abort()

    def close(self) -> None:
        """Close the connection, unless its body was read to its end (it is back in the pool then)."""
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()

    def _pieces(self, limit: int | None) -> Iterator[bytes]:
        """The body as it arrives (``TooLarge`` past ``limit`` bytes); at its end the connection goes back."""
        connection = self._connection
        assert connection is not None, "the body was read already"
        try:
            if "chunked" in self.headers.get("transfer-encoding", ""):
                pieces = iter(connection.read_chunk, b"")
            elif "content-length" in self.headers:
                length = self.headers["content-length"]
                if not (length.isascii() and length.isdigit()):  # "²" and "١" are digits to str.isdigit()
                    raise ProtocolError(f"bad Content-Length {length[:80]!r}")
                pieces = iter((connection.read_exactly(int(length)),))
            elif self.status not in (204, 304):
                connection.reusable = False
                pieces = iter(connection.read_some, b"")
            else:
                pieces = iter(())
            read = 0
            for piece in pieces:
                read += len(piece)
                if limit is not None and read > limit:
                    raise TooLarge(f"the answer is over the {limit} bytes this client reads")
                yield piece
        except BaseException:
            self.close()
            raise
        self.complete, self._connection = True, None
        self._pool.release(connection)


class Pool:
    """Kept-alive connections to one ``host:port``, over TLS when given a context. Thread-safe; no I/O until used.

    ``connect`` makes a connected TCP socket and ``wrap_tls`` puts TLS over it
    (the standard library's, or gevent's once it patched them, by default).
    """

    def __init__(
        self,
        host: str,
        port: int,
        tls: ssl.SSLContext | None = None,
        *,
        connect: Connect = _connect,
        wrap_tls: WrapTLS = _wrap_tls,
        max_idle: int = MAX_IDLE,
    ) -> None:
        self.host, self.port = host, port
        self.tls = tls
        self._connect = connect
        self._wrap_tls = wrap_tls
        self._max_idle = max_idle
        self._host_header = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._idle: list[Connection] = []
        # held only to push or pop an idle connection: a native lock, which a greenlet and a native thread can share
        self._lock = green.native_lock()
        self._closed = False

    def request(
        self,
        method: str,
        target: str,
        body: bytes = b"",
        headers: Mapping[str, str] | None = None,
        timeout: float = 10.0,
        stream: bool = False,
        idempotent: bool | None = None,
    ) -> Response:
        """Send the request; the response, its body read (``body``) unless ``stream``.

        ``target`` is the path and query; ``timeout`` (seconds) is the total
        deadline of the request: connecting, sending and reading the answer
        (of a streamed one, its status and headers). With ``stream``, read the
        body with ``read()`` (by the same deadline) or ``lines()``, and
        ``close()`` the response. ``idempotent`` (default: a GET or HEAD) lets
        a request the server hung up on be sent again at once (see the module's
        docstring). Every request of this module goes through here: this is the
        one place to count them.
        """
        deadline = time.monotonic() + timeout
        head = f"{method} {target} HTTP/1.1\r\nHost: {self._host_header}\r\n"
        if body or method in ("POST", "PUT"):
            head += f"Content-Length: {len(body)}\r\n"
        if headers:
            for name, value in headers.items():
                if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
                    raise ValueError(f"the HTTP header {name[:40]!r} has a line break in its name or value")
                head += f"{name}: {value}\r\n"
        data = (head + "\r\n").encode("latin-1") + body
        response = self._send(data, deadline, method in ("GET", "HEAD") if idempotent is None else idempotent)
        if not stream:
            response.read()
        return response

    def _send(self, data: bytes, deadline: float, idempotent: bool) -> Response:
        """Send ``data`` on an idle connection, or a new one; the response, its status and headers read."""
        connection = self._idle_connection()
        if connection is not None:
            try:
                return self._exchange(connection, data, deadline)
            except _Unanswered as exc:
                # the server closed the idle connection as our request came: send it again, once, where that is safe
                if exc.delivered and not idempotent:
                    raise NoResponse(str(exc)) from None
        return self._exchange(self._new_connection(deadline), data, deadline)

    def _exchange(self, connection: Connection, data: bytes, deadline: float) -> Response:
        delivered = True
        try:
            connection.deadline = deadline
            connection.sock.settimeout(_remaining(deadline))  # sendall: a total timeout
            try:
                connection.sock.sendall(data)
            except (BrokenPipeError, ConnectionResetError):
                # the server may have answered before it read all of it (a request too large): read that
                delivered = False
            try:
                status, headers = connection.read_head()
            except NoResponse as exc:
                raise _Unanswered(str(exc), delivered) from None
        except BaseException:
            connection.close()
            raise
        return Response(self, connection, status, headers)

    def _idle_connection(self) -> Connection | None:
        while True:
            with self._lock:
                if not self._idle:
                    return None
                connection = self._idle.pop()
            if not _readable(connection.sock):
                return connection
            connection.close()  # closed by the server while idle (or it sent what it should not have)

    def _new_connection(self, deadline: float) -> Connection:
        sock = self._connect((self.host, self.port), _remaining(deadline))
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is None:
                return Connection(sock)
            sock.settimeout(_remaining(deadline))  # the standard library's handshake ends by it as a whole
            return Connection(self._wrap_tls(sock, self.tls, self.host))
        except BaseException:
            sock.close()
            raise

    def release(self, connection: Connection) -> None:
        """Take a connection back whose response was read to its end."""
        connection.deadline = None
        if connection.reusable and not connection.buffer:
            with self._lock:
                if not self._closed and len(self._idle) < self._max_idle:
                    self._idle.append(connection)
                    return
        connection.close()

    def close(self) -> None:
        """Close the idle connections; those in use close when their response is done."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()

    @property
    def idle_connections(self) -> int:
        return len(self._idle)
