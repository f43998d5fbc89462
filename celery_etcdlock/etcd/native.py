"""Sockets that never wait on a gevent hub: for a session's renewer thread under gevent.

gevent's monkey-patching replaces the ``socket`` and ``ssl`` modules' classes:
their sockets wait by switching to the hub of the thread that uses them. The
renewer is a native thread (see ``green.py``), whose requests must go on while
a greenlet keeps the main thread's hub from running. So the pools of its
``native_twin`` backend (``transport.endpoint_pool(..., native_sockets=True)``)
make their connections here:

- ``create_connection``: a socket of the standard library's own ``socket``
  class, resolved with its own ``getaddrinfo`` (a blocking call of this thread,
  as in any unpatched process);
- ``wrap_tls``: TLS on a memory BIO over that socket (``TLSSocket``). Under
  gevent even the original ``ssl.SSLSocket`` is built on gevent's socket;
  ``SSLContext.wrap_bio`` is the standard library's whatever the patching.

In a process that is not patched these are the standard library's sockets
with an extra step; only the renewer's twin uses them.
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Callable
from typing import Any, TypeVar

from .. import green

T = TypeVar("T")


def create_connection(address: tuple[str, int], timeout: float) -> socket.socket:
    """``socket.create_connection`` on the standard library's own socket class and resolver."""
    host, port = address
    native_socket = green.original("socket", "socket")
    getaddrinfo = green.original("socket", "getaddrinfo")
    failure: OSError | None = None
    for family, kind, proto, _, sockaddr in getaddrinfo(host, port, 0, socket.SOCK_STREAM):
        sock: socket.socket | None = None
        try:
            sock = native_socket(family, kind, proto)
            sock.settimeout(timeout)
            sock.connect(sockaddr)
            return sock
        except OSError as exc:
            failure = exc
            if sock is not None:
                sock.close()
    raise failure or OSError(f"getaddrinfo found no address for {host}")


def wrap_tls(sock: socket.socket, context: ssl.SSLContext, hostname: str) -> TLSSocket:
    """TLS over ``sock`` (handshake done), with the context's checks of the server's certificate and name."""
    return TLSSocket(sock, context, hostname)


class TLSSocket:
    """A TLS client connection over a socket, through memory BIOs: the part of a socket the transport uses.

    The TLS object reads and writes only memory; every byte goes through the
    socket given, with its timeout, so no call here can wait on a hub.
    """

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, hostname: str) -> None:
        self._sock = sock
        self._incoming, self._outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_hostname=hostname)
        # the handshake as a whole within the socket's timeout, as the standard library's (not each of its reads)
        timeout = sock.gettimeout()
        self._run(self._tls.do_handshake, deadline=None if timeout is None else time.monotonic() + timeout)

    def _run(self, operation: Callable[..., T], *args: Any, deadline: float | None = None) -> T:
        """``operation(*args)`` on the TLS object, feeding it from the socket until it has what it needs."""
        while True:
            try:
                result = operation(*args)
            except ssl.SSLWantReadError:
                self._flush()
                if deadline is not None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise TimeoutError("the TLS handshake did not end within the timeout") from None
                    self._sock.settimeout(remaining)
                data = self._sock.recv(65536)
                if data:
                    self._incoming.write(data)
                else:
                    self._incoming.write_eof()  # the TLS object raises SSLEOFError, or returns b"" after close_notify
                continue
            self._flush()
            return result

    def _flush(self) -> None:
        if self._outgoing.pending:
            self._sock.sendall(self._outgoing.read())

    def sendall(self, data: bytes, /) -> None:
        view = memoryview(data)
        while view:
            view = view[self._run(self._tls.write, view) :]

    def recv(self, size: int, /) -> bytes:
        try:
            return self._run(self._tls.read, size)
        except (ssl.SSLEOFError, ssl.SSLZeroReturnError):
            return b""  # the end of the stream, with or without the server's close_notify (as SSLSocket's recv)

    def settimeout(self, timeout: float | None, /) -> None:
        self._sock.settimeout(timeout)

    def fileno(self) -> int:
        return self._sock.fileno()

    def shutdown(self, how: int, /) -> None:
        self._sock.shutdown(how)

    def close(self) -> None:
        self._sock.close()
