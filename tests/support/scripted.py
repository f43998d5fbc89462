"""Scripted servers: a real socket on loopback that answers each connection from a script.

For what a real etcd cannot be made to do on demand: close an idle kept-alive
connection, hang up after reading a request, send one byte at a time, answer
with a body too large or not JSON at all. The server records every request
and connection it saw.

    def script(conn, number, next_request):      # number: the connection's, 0, 1, ...
        while next_request():                      # b"" once the client closed
            conn.sendall(OK)

    with scripted(script) as (server, pool):     # pool: a transport Pool to it
        pool.request("GET", "/").body             # b"ok"
"""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

from celery_etcdlock.etcd.transport import Pool

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"

# a script answers the requests of one connection: given the connection's number (0, 1, ...) and a function that
# reads the next request (b"" once the client closed), it writes answers and returns when it is done with it
Script = Callable[[socket.socket, int, Callable[[], bytes]], None]


class ScriptedServer:
    """A loopback server running ``script`` on each connection it accepts; ``requests`` lists what it read."""

    def __init__(self, script: Script, host: str = "127.0.0.1", tls: ssl.SSLContext | None = None) -> None:
        self.listener = socket.create_server((host, 0))
        self.tls = tls
        self.port = self.listener.getsockname()[1]
        self.script = script
        self.connections = 0
        self.requests: list[bytes] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed
            number, self.connections = self.connections, self.connections + 1
            threading.Thread(target=self._serve, args=(conn, number), daemon=True).start()

    def _serve(self, conn: socket.socket, number: int) -> None:
        buffer = bytearray()

        def next_request() -> bytes:
            while b"\r\n\r\n" not in buffer:
                data = conn.recv(65536)
                if not data:
                    return b""
                buffer.extend(data)
            end = buffer.index(b"\r\n\r\n") + 4
            request = bytes(buffer[:end])
            del buffer[:end]
            self.requests.append(request)
            return request

        with conn, suppress(OSError):  # ssl.SSLError too: a client that refused our certificate
            if self.tls is not None:
                conn = self.tls.wrap_socket(conn, server_side=True)
            self.script(conn, number, next_request)


@contextmanager
def scripted(script: Script) -> Iterator[tuple[ScriptedServer, Pool]]:
    server = ScriptedServer(script)
    pool = Pool("127.0.0.1", server.port)
    try:
        yield server, pool
    finally:
        pool.close()
        server.listener.close()


def keep_alive(conn: socket.socket, number: int, next_request: Callable[[], bytes]) -> None:
    """Answer every request with ``OK``, on a kept-alive connection."""
    while next_request():
        conn.sendall(OK)


class Proxy:
    """A TCP proxy on loopback to ``target`` (host, port), for the faults no real server makes on demand.

    ``cut()`` closes every connection through it, as a network fault would. Set ``trickle`` and every
    answer from then on reaches the client one byte at a time, each well within any read timeout.
    A context manager: leaving it closes the proxy and cuts what is still open.
    """

    def __init__(self, target: tuple[str, int], pace: float = 0.2) -> None:
        self.target = target
        self.pace = pace
        self.trickle = False
        self.connections = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            try:
                server = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self.connections += 1
                self._open += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, answers: bool) -> None:
        with suppress(OSError):
            while data := source.recv(65536):
                if not (answers and self.trickle):
                    sink.sendall(data)
                    continue
                for i in range(len(data)):
                    if self._closed.wait(self.pace):  # the hostile pace (not a synchronisation): until closed
                        return
                    sink.sendall(data[i : i + 1])
        with suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def cut(self) -> None:
        with self._lock:
            cut, self._open = self._open, []
        for sock in cut:
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self._closed.set()
        self.listener.close()

    def __enter__(self) -> Proxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        self.cut()
