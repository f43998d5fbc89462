"""HTTP connections that never wait on a gevent hub: for a session's renewer thread under gevent.

gevent's monkey-patching replaces the ``socket``, ``ssl``, ``select`` and
``queue`` modules' classes, and urllib3 picks them up: its sockets, its TLS and
its pool of idle connections would all wait by switching to the hub of the
thread that uses them. The renewer is a native thread (see ``green.py``), whose
requests must go on while a greenlet keeps the main thread's hub from running.
So its connections are urllib3's, with:

- a socket of the standard library's own ``socket`` class, resolved with its own
  ``getaddrinfo`` (a blocking call of this thread, as in any unpatched process);
- TLS on a memory BIO over that socket (urllib3's ``SSLTransport``): under gevent,
  even the original ``ssl.SSLSocket`` derives from gevent's socket. The context has
  urllib3's defaults (TLS 1.2 or later, certificate and host name checked), the URL's
  CA (else the system's), and its client certificate and key;
- a check that an idle connection is still open made with the real ``select.poll``;
- a pool of idle connections kept in a list under a native lock.

    pool = connection_pool(options, index)           # no I/O yet
    response = pool.urlopen("POST", "/v3/lease/keepalive", body=b'{"ID":"1"}')

The backends use these only for their ``native_twin``; every other request
goes through their usual pools.
"""

from __future__ import annotations

import queue
import select
import socket
import ssl
from typing import Any

import urllib3
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.exceptions import ConnectTimeoutError, NameResolutionError, NewConnectionError
from urllib3.util.retry import Retry
from urllib3.util.ssltransport import SSLTransport

from .. import green
from ..options import ConnectionOptions


def create_connection(
    address: tuple[str, int],
    timeout: Any,
    source_address: tuple[str, int] | None = None,
    socket_options: Any = None,
) -> socket.socket:
    """``socket.create_connection`` on the standard library's own socket class and resolver."""
    host, port = address
    native_socket = green.original("socket", "socket")
    getaddrinfo = green.original("socket", "getaddrinfo")
    failure: OSError | None = None
    for family, kind, proto, _, sockaddr in getaddrinfo(host.strip("[]"), port, 0, socket.SOCK_STREAM):
        sock = None
        try:
            sock = native_socket(family, kind, proto)
            for option in socket_options or ():
                sock.setsockopt(*option)
            if timeout is None or isinstance(timeout, (int, float)):  # else urllib3's "default": no timeout set
                sock.settimeout(timeout)
            if source_address:
                sock.bind(source_address)
            sock.connect(sockaddr)
            return sock
        except OSError as exc:
            failure = exc
            if sock is not None:
                sock.close()
    raise failure or OSError(f"getaddrinfo found no address for {host}")


class NativeHTTPConnection(HTTPConnection):
    """urllib3's connection, on a native socket."""

    def _new_conn(self) -> socket.socket:
        # urllib3's own _new_conn, with the socket made by create_connection above
        try:
            return create_connection(
                (self._dns_host, self.port), self.timeout, self.source_address, self.socket_options
            )
        except socket.gaierror as exc:
            raise NameResolutionError(self.host, self, exc) from exc
        except TimeoutError as exc:
            message = f"Connection to {self.host} timed out. (connect timeout={self.timeout})"
            raise ConnectTimeoutError(self, message) from exc
        except OSError as exc:
            raise NewConnectionError(self, f"Failed to establish a new connection: {exc}") from exc

    @property
    def is_connected(self) -> bool:
        """Not closed by the server: nothing to read on an idle connection (urllib3's test, on the real poll)."""
        if self.sock is None:
            return False
        poller = green.original("select", "poll")()
        poller.register(self.sock.fileno(), select.POLLIN)
        return not poller.poll(0)


class NativeHTTPSConnection(NativeHTTPConnection, HTTPSConnection):
    """urllib3's TLS connection, on a native socket; its ``ssl_context`` comes from ``tls_context``."""


class _IdleConnections:
    """The queue of a pool's idle connections, last in first out: urllib3's is ``queue.LifoQueue``, gevent's once
    patched. Never blocks: the pools below are made with ``block=False``."""

    def __init__(self, maxsize: int) -> None:
        self._items: list[Any] = []
        self._maxsize = maxsize
        self._lock = green.native_lock()

    def put(self, item: Any, block: bool = False) -> None:
        with self._lock:
            if len(self._items) >= self._maxsize:
                raise queue.Full
            self._items.append(item)

    def get(self, block: bool = False, timeout: float | None = None) -> Any:
        with self._lock:
            if not self._items:
                raise queue.Empty
            return self._items.pop()


class NativeHTTPConnectionPool(urllib3.HTTPConnectionPool):
    ConnectionCls = NativeHTTPConnection
    QueueCls = _IdleConnections  # type: ignore[assignment]


class NativeHTTPSConnectionPool(urllib3.HTTPSConnectionPool):
    ConnectionCls = NativeHTTPSConnection
    QueueCls = _IdleConnections  # type: ignore[assignment]


def tls_context(options: ConnectionOptions) -> ssl.SSLContext:
    """A TLS client context whose sockets are ``SSLTransport`` over the socket given (never gevent's SSLSocket)."""

    # gevent's subclass of SSLContext, once patched: the standard library's property setters call
    # super(ssl.SSLContext, ...) on the patched name, and recurse without it. Only its wrap_socket would
    # wait on the hub; wrap_bio, which SSLTransport uses, is the standard library's.
    # (Made at each call, not on import: gevent may patch ssl after this module is imported.)
    class NativeTLSContext(ssl.SSLContext):
        def wrap_socket(  # type: ignore[override]  # an SSLTransport is what urllib3 uses for TLS in TLS
            self,
            sock: socket.socket,
            server_side: bool = False,
            do_handshake_on_connect: bool = True,
            suppress_ragged_eofs: bool = True,
            server_hostname: str | None = None,  # type: ignore[override]
            session: Any = None,
        ) -> SSLTransport:
            return SSLTransport(sock, self, server_hostname, suppress_ragged_eofs)

    context: ssl.SSLContext = NativeTLSContext(ssl.PROTOCOL_TLS_CLIENT)
    # urllib3's defaults (create_urllib3_context): certificate and host name checked, TLS 1.2 or later
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.options |= ssl.OP_NO_SSLv2 | ssl.OP_NO_SSLv3 | ssl.OP_NO_COMPRESSION | ssl.OP_NO_TICKET
    context.post_handshake_auth = True
    context.verify_mode = ssl.CERT_REQUIRED
    context.check_hostname = True
    context.hostname_checks_common_name = False
    if options.ca:
        context.load_verify_locations(options.ca)
    else:
        context.load_default_certs()
    if options.cert:
        context.load_cert_chain(options.cert, options.key)
    return context


def connection_pool(options: ConnectionOptions, index: int, maxsize: int = 1) -> urllib3.HTTPConnectionPool:
    """A pool of native connections to endpoint ``index``: no retries of its own, ``options.timeout`` per request."""
    host, port = options.endpoints[index]
    common: dict[str, Any] = {
        "maxsize": maxsize,
        "block": False,
        "retries": Retry(total=False, redirect=False),
        "timeout": options.timeout,
    }
    if options.tls:
        return NativeHTTPSConnectionPool(
            host, port, ssl_context=tls_context(options), cert_reqs="CERT_REQUIRED", **common
        )
    return NativeHTTPConnectionPool(host, port, **common)
