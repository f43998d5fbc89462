"""HTTP transport to etcd's v3 JSON gateway (grpc-gateway), for the v3 backend.

The gateway takes each gRPC request as a JSON ``POST`` to ``<api path><method>``
(``/v3/kv/range``, ``/v3/lease/grant``...), with keys and values base64-encoded
(``b64`` / ``unb64``). This module sends those requests, and the v3 backend
(``etcd3.py``) decides what to send:

    gateway = Gateway(parse_url("etcd3://127.0.0.1:2379"))       # no network I/O yet
    answer = gateway.post("kv/range", {"key": b64("/etcdlock/x")})
    with closing(gateway.watch({"key": b64("/etcdlock/x")}, deadline, "x").results()) as results:
        for result in results: ...

What it takes care of:

- one connection pool per endpoint (``transport.py``: kept-alive HTTP/1.1
  connections, TLS from the URL alone, nothing from the environment), which
  never retries on its own: the backend's retry policy decides, and can
  switch endpoints;
- the API path: ``/v3/`` until a server answers otherwise, then
  ``GET /version`` decides (etcd 3.3 serves ``/v3beta/``, 3.0-3.2 ``/v3alpha/``);
- auth: the gateway's token (``POST auth/authenticate``), sent with every
  request and fetched again when the server rejects it;
- what an answer means: success, a plain answer (``Failure``: a missing
  lease, a bad request), ``retry.Transient`` (no leader, a timeout, a 5xx, a
  refused connection), ``AuthenticationFailed``, a ``BackendError`` for a
  request too large for etcd (never retried), or ``UnsupportedServer`` with
  what the server is instead (redis, plain HTTP, TLS on the wrong port,
  etcd's peer port);
- fail-over: a connection failure or an unavailable member moves to the next
  endpoint; the backend's retry policy then sends again;
- watches, read line by line from the streaming answer with a deadline on
  every read, so that a watch the server cancels or compacts never hangs.

etcd3gw's client is not used: its helpers cannot carry an auth token or a
per-request timeout, hide the gRPC error code, discover the API path with an
extra request in the middle of an operation, and its watch hangs for ever on
a cancelled or compacted watch. Nor are ``requests`` and urllib3: preparing,
sending and wrapping a request through them cost more client CPU than the
rest of the work on it, and with many processes contending on few cores,
client CPU decides throughput.

Nothing here waits and retries: that is the backend's retry policy. Only a
``post`` whose token was rejected, or that found the API path, is sent again
at once.
"""

from __future__ import annotations

import base64
import json
import logging
import socket
import ssl
import time
from collections.abc import Callable, Generator
from typing import Any, TypeVar

from ..errors import AuthenticationFailed, BackendError, UnsupportedServer
from ..options import ConnectionOptions
from . import retry, transport
from .base import peer_port_error
from .endpoints import UNREADABLE, Endpoints, tls_refusal
from .transport import Pool

logger = logging.getLogger(__name__)
T = TypeVar("T")

# gRPC status codes, as the gateway reports them in {"code": N, "message": ...}
CANCELLED, INVALID_ARGUMENT, DEADLINE_EXCEEDED, NOT_FOUND = 1, 3, 4, 5
PERMISSION_DENIED, RESOURCE_EXHAUSTED, FAILED_PRECONDITION = 7, 8, 9
ABORTED, UNAVAILABLE, UNAUTHENTICATED = 10, 14, 16
# RESOURCE_EXHAUSTED is also what an oversized request gets ("received message larger than max"): see _too_large
_TRANSIENT_CODES = frozenset({CANCELLED, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ABORTED, UNAVAILABLE})
# "context deadline exceeded" (UNKNOWN) is what a member cut off from the others answers a lease grant or a put
_TRANSIENT_MESSAGES = (
    "leader changed", "no leader", "too many requests", "timed out", "deadline exceeded", "not capable",
)  # fmt: skip
_TOO_LARGE_MESSAGES = ("larger than max", "request is too large")

_API_PATHS = ((3, 4, "/v3/"), (3, 3, "/v3beta/"), (3, 0, "/v3alpha/"))  # etcd version -> gateway path

_JSON = {"Content-Type": "application/json"}
# what may be sent twice at once if a reused connection was closed under it (see transport.py): reads, and a renewal
_IDEMPOTENT = frozenset({"kv/range", "kv/lease/timetolive", "lease/keepalive", "auth/authenticate"})
_encode = json.JSONEncoder(separators=(",", ":")).encode  # built once: json.dumps with options builds one per call


class Failure(Exception):
    """An answer from etcd that is not success (not transient, not about auth): code and message."""

    def __init__(self, code: int | None, message: str) -> None:
        super().__init__(message)
        self.code = code


class WatchCancelled(Exception):
    """The server ended a watch (cancelled it, or compacted its start revision): read again."""


class _TokenRejected(Exception):
    """The auth token was refused (expired, or the server restarted): authenticate again."""


class _ApiPathChanged(Exception):
    """``GET /version`` found an older gateway path: send the request again."""


def b64(text: str) -> str:
    return base64.b64encode(text.encode("utf-8")).decode("ascii")


def unb64(text: str) -> str:
    return base64.b64decode(text).decode("utf-8", errors="replace")


def prefix_end(prefix: str) -> str:
    """The first key after every key that starts with ``prefix``, base64-encoded (a ``range_end``)."""
    raw = bytearray(prefix.encode("utf-8"))
    while raw and raw[-1] == 0xFF:
        raw.pop()
    if not raw:
        return base64.b64encode(b"\0").decode("ascii")  # no upper bound
    raw[-1] += 1
    return base64.b64encode(bytes(raw)).decode("ascii")


class Gateway:
    """The v3 JSON gateway of a cluster's endpoints. Thread-safe; no I/O before the first request.

    ``native=True`` makes the gateway of a native thread in a gevent process (a session's
    renewer): its connections are on the OS's own sockets (``native.py``) and its locks
    the OS's, so that none of its requests waits on a hub.
    """

    def __init__(self, options: ConnectionOptions, *, native: bool = False) -> None:
        self.options = options
        self.endpoints = options.endpoint_urls
        self.native = native
        self._endpoints = Endpoints(options, native=native)  # pools, the current one, fail-over, open watches
        self._api_paths = ["/v3/"] * len(self.endpoints)
        # has it ever answered like an etcd gateway? A native gateway never probes what a server is (its probes
        # would use gevent's sockets): the process's main gateway has talked to the server before it.
        self._answered = [native] * len(self.endpoints)
        self._auth_lock = self._endpoints.new_lock()
        self._token: str | None = None
        self._auth_enabled = options.username is not None

    @property
    def current(self) -> int:
        """The endpoint requests go to."""
        return self._endpoints.current

    def guarded(self, fn: Callable[[], T]) -> Callable[[], T]:
        """``fn``, which reads answers, with an answer of the wrong shape a ``BackendError`` (or a fail-over)."""
        return self._endpoints.guarded(fn)

    # -- requests -----------------------------------------------------------

    def post(self, path: str, body: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """One gateway request to the current endpoint, authenticated; the decoded answer."""
        for attempt in range(3):
            index, pool = self._pick()
            token = None
            try:
                token = self._auth_token(index, pool)
                return self._send(index, pool, path, body, token, timeout)
            except _ApiPathChanged:
                continue
            except _TokenRejected:
                if attempt > 0 or not self._auth_enabled:
                    message = self._auth_message(index, "had its auth token rejected twice in a row")
                    raise AuthenticationFailed(message) from None
                self._drop_token(token)
        raise BackendError(f"etcd at {self.endpoints[index]} kept changing its API path")

    def watch(self, create_requests: list[dict[str, Any]], deadline: float, what: str) -> Watch:
        """Watches (the ``create_request`` of each), on one stream, until ``deadline`` (monotonic); ``what`` names it.

        The gateway reads the request body as a stream of watch requests, so one
        request carries them all; each gets its ``created`` answer, in order.
        """
        return Watch(self, create_requests, deadline, what)

    def _send(
        self,
        index: int,
        pool: Pool,
        path: str,
        body: dict[str, Any],
        token: str | None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        try:
            response = pool.request(
                "POST",
                self._api_paths[index] + path,
                _encode(body).encode("utf-8"),
                _headers(token),
                timeout or self.options.timeout,
                idempotent=path in _IDEMPOTENT,
            )
        except OSError as exc:
            raise self._connection_failure(index, exc) from None
        if response.status == 200:
            try:
                answer = json.loads(response.body)
            except UNREADABLE:
                answer = None
            if isinstance(answer, dict):
                self._answered[index] = True
                return answer
        raise self._error(index, path, response.status, response.body)

    def _stream(
        self,
        index: int,
        pool: Pool,
        body: bytes,
        deadline: float,
        token: str | None,
    ) -> Generator[dict[str, Any], None, None]:
        """``POST watch`` on one streaming request: each result until ``deadline``, then it ends.

        The gateway streams newline-delimited JSON messages. Each read waits
        at most until the deadline, so a watch the server cancels, compacts
        or forgets never hangs.
        """
        endpoint = self.endpoints[index]
        try:
            path, timeout = self._api_paths[index] + "watch", self.options.timeout
            response = pool.request("POST", path, body, _headers(token), timeout, stream=True)
        except OSError as exc:
            raise self._connection_failure(index, exc) from None
        try:
            if response.status != 200:
                raise self._error(index, "watch", response.status, response.read())
            with self._endpoints.watching(index, response):  # ended if the client moves on
                for line in response.lines(deadline):
                    message = json.loads(line) if line.strip() else None
                    if not isinstance(message, dict):
                        continue
                    error = message.get("error")
                    if isinstance(error, dict):
                        code = int(error.get("grpc_code") or error.get("code") or 2)
                        meaning = self.grpc_error(index, code, str(error.get("message")))
                        raise WatchCancelled(str(meaning)) if isinstance(meaning, Failure) else meaning
                    result = message.get("result", {})
                    if int(result.get("compact_revision", 0)):
                        raise WatchCancelled(f"revision compacted at {result['compact_revision']}")
                    if result.get("canceled"):
                        reason = str(result.get("cancel_reason", ""))
                        if "permission denied" in reason.lower() or "auth" in reason.lower():
                            raise _TokenRejected(reason)  # an expired token shows up as a denial here
                        raise WatchCancelled(f"cancelled: {reason or 'no reason given'}")
                    yield result
            if response.complete and time.monotonic() < deadline:
                raise retry.Transient(endpoint, "the watch stream ended")
        except (OSError, *UNREADABLE) as exc:  # a line of the wrong shape too: a stream we cannot follow
            if time.monotonic() < deadline - 0.001:
                self._rotate(index)
                raise retry.Transient(endpoint, f"watch failed: {type(exc).__name__}: {str(exc)[:200]}") from None
        finally:
            response.close()  # a stream cut short: its connection is closed; the pool opens another when needed

    # -- endpoints ----------------------------------------------------------

    def _pick(self) -> tuple[int, Pool]:
        return self._endpoints.pick()

    def _rotate(self, failed: int) -> None:
        self._endpoints.rotate(failed)

    # -- what an answer means -----------------------------------------------

    def _error(self, index: int, path: str, status: int, data: bytes) -> Exception:
        """What an answer other than a 200 with a JSON object means (returned, not raised)."""
        endpoint = self.endpoints[index]
        try:
            answer = json.loads(data)
        except UNREADABLE:
            answer = None
        if isinstance(answer, dict):
            # a unary call's error is the answer itself; a streaming call's (lease/keepalive) sits in "error"
            error = answer["error"] if isinstance(answer.get("error"), dict) else answer
            code = error.get("code", error.get("grpc_code"))
            if isinstance(code, int):
                self._answered[index] = True
                return self.grpc_error(index, code, str(error.get("message") or error.get("error") or ""))
        text = data.decode("utf-8", errors="replace")
        if status >= 500:
            self._rotate(index)
            return retry.Transient(endpoint, f"HTTP {status} {text[:200]!r}")
        return self._not_a_gateway(index, f"POST {self._api_paths[index]}{path}", status, text)

    def grpc_error(self, index: int, code: int, message: str) -> Exception:
        """The exception a gRPC error from endpoint ``index`` means (returned, not raised)."""
        endpoint = self.endpoints[index]
        lowered = message.lower()
        if code == UNAUTHENTICATED or "invalid auth token" in lowered:
            return _TokenRejected(message)
        if any(m in lowered for m in _TOO_LARGE_MESSAGES):
            # the same request is as large next time: an answer, never an outage (nor, on RESOURCE_EXHAUSTED,
            # the rate limit "too many requests", which passes)
            return BackendError(
                f"etcd at {endpoint} refused a request as too large ({message}): etcd takes requests up to its "
                "--max-request-bytes (1.5 MiB unless set); use shorter lock names and smaller values"
            )
        if code in _TRANSIENT_CODES or any(m in lowered for m in _TRANSIENT_MESSAGES):
            # a member without a leader, cut off, overloaded or shutting down: another may serve
            self._rotate(index)
            return retry.Transient(endpoint, message)
        if code == PERMISSION_DENIED:
            return AuthenticationFailed(self._auth_message(index, f"lacks permission ({message})"))
        if "user name is empty" in lowered:
            if self.options.username is not None:
                self._auth_enabled = True  # auth was turned on after we found it off
                return _TokenRejected(message)
            return AuthenticationFailed(
                f"etcd at {endpoint} requires authentication ({message}): give user:password@ in the etcd3:// URL"
            )
        if "authentication failed" in lowered:
            return AuthenticationFailed(self._auth_message(index, f"was refused ({message})"))
        return Failure(code, f"{endpoint}: {message}")

    def _connection_failure(self, index: int, exc: OSError) -> Exception:
        """What a request's ``exc`` means: first, at a first contact, what the server is if not etcd's gateway."""
        endpoint = self.endpoints[index]
        if not self._answered[index] and tls_refusal(endpoint, exc) is None:
            if isinstance(exc, ssl.SSLError):
                if self._greeting(index).startswith(b"HTTP/"):
                    return UnsupportedServer(f"{endpoint} does not speak TLS, only plain HTTP: use etcd3:// for it")
            elif isinstance(exc, (transport.NotHTTP, ConnectionResetError)):
                # Redis, for one, hangs up without a word on an HTTP request with a Host header.
                greeting = self._greeting(index)
                if (not greeting or greeting.startswith(b"\x15\x03")) and self._speaks_tls(index):
                    return UnsupportedServer(f"{endpoint} speaks TLS only: use etcd3s:// (with ?ca= for its CA)")
                if greeting and not greeting.startswith(b"HTTP/"):
                    line = greeting.split(b"\r\n", 1)[0].decode("utf-8", errors="replace")
                    return UnsupportedServer(
                        f"{endpoint} is not an etcd server: it does not speak HTTP (it answered {line[:80]!r}); "
                        "etcd3:// needs the client URL of an etcd 3 server"
                    )
        return self._endpoints.connection_failure(index, exc)

    def _greeting(self, index: int) -> bytes:
        """The first bytes a plain ``GET /version HTTP/1.0`` gets from the endpoint (b"" if none)."""
        host, port = self.options.endpoints[index]
        try:
            with socket.create_connection((host, port), timeout=min(2.0, self.options.timeout)) as sock:
                sock.sendall(b"GET /version HTTP/1.0\r\n\r\n")
                return sock.recv(128)
        except OSError:
            return b""

    def _speaks_tls(self, index: int) -> bool:
        """Does the endpoint complete a TLS handshake (whoever signed its certificate)?"""
        host, port = self.options.endpoints[index]
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        try:
            with (
                socket.create_connection((host, port), timeout=min(2.0, self.options.timeout)) as sock,
                context.wrap_socket(sock),
            ):
                return True
        except OSError:
            return False

    def _get(self, index: int, path: str) -> tuple[int, bytes]:
        """A plain ``GET`` of ``path`` on endpoint ``index``, to find out what the server is: (0, b"") if none."""
        pool = self._endpoints.pool(index)
        try:
            response = pool.request("GET", path, timeout=self.options.timeout)
        except OSError:
            return 0, b""
        return response.status, response.body

    def _not_a_gateway(self, index: int, request: str, status: int, text: str) -> Exception:
        """An HTTP answer that is not the v3 gateway's: find out what the server is, for the message."""
        endpoint = self.endpoints[index]
        what = f"{request} answered HTTP {status} {text.strip()[:80]!r}"
        if "HTTPS server" in text:
            return UnsupportedServer(f"{endpoint} speaks TLS only ({what}): use etcd3s:// (with ?ca= for its CA)")
        probe_status, probe = self._get(index, "/version")
        try:
            version_text = json.loads(probe).get("etcdserver") if probe_status == 200 else None
        except UNREADABLE:
            version_text = None
        if not isinstance(version_text, str):
            return UnsupportedServer(
                f"{endpoint} is not an etcd server ({what}, and GET /version did not name an etcd version); "
                "etcd3:// needs the client URL of an etcd 3 server"
            )
        try:
            version = tuple(int(part) for part in version_text.split(".")[:2])
        except ValueError:
            version = (0, 0)
        if version < (3, 0):
            return UnsupportedServer(
                f"etcd {version_text} at {endpoint} has no v3 API ({what}): use an etcd:// URL (the v2 keys API)"
            )
        path = next(p for major, minor, p in _API_PATHS if version >= (major, minor))
        if path != self._api_paths[index]:
            logger.info("etcd %s at %s serves the v3 gateway at %s", version_text, endpoint, path)
            self._api_paths[index] = path
            return _ApiPathChanged()
        peer_port = peer_port_error(endpoint, *self._get(index, "/members"))
        if peer_port is not None:
            return peer_port
        return UnsupportedServer(
            f"etcd {version_text} at {endpoint} does not serve the v3 JSON gateway ({what}); "
            "it is on unless etcd runs with --enable-grpc-gateway=false"
        )

    # -- auth ---------------------------------------------------------------

    def _auth_message(self, index: int, what: str) -> str:
        return f"etcd at {self.endpoints[index]}: user {self.options.username!r} {what}"

    def _auth_token(self, index: int, pool: Pool) -> str | None:
        if not self._auth_enabled:
            return None
        with self._auth_lock:
            if self._token is None and self._auth_enabled:
                self._authenticate(index, pool)
            return self._token

    def _authenticate(self, index: int, pool: Pool) -> None:
        body = {"name": self.options.username, "password": self.options.password or ""}
        try:
            answer = self._send(index, pool, "auth/authenticate", body, token=None)
        except Failure as exc:
            if "authentication is not enabled" in str(exc):
                logger.warning(
                    "etcd at %s has authentication off: ignoring the user name in the URL", self.endpoints[index]
                )
                self._auth_enabled = False
                return
            raise AuthenticationFailed(self._auth_message(index, f"was refused ({exc})")) from None
        except _TokenRejected as exc:
            raise AuthenticationFailed(self._auth_message(index, f"was refused ({exc})")) from None
        token = answer.get("token")
        if not token or not isinstance(token, str):
            raise AuthenticationFailed(self._auth_message(index, "got no token from authenticate"))
        if not token.isascii() or not token.isprintable():  # a CR or LF would end the header: never sent
            raise AuthenticationFailed(
                self._auth_message(index, "got a token with a line break or another control character: refused")
            )
        self._token = token
        logger.debug("authenticated to etcd at %s as %r", self.endpoints[index], self.options.username)

    def _drop_token(self, token: str | None) -> None:
        with self._auth_lock:
            if self._token == token:
                self._token = None

    # -- process life -------------------------------------------------------

    def after_fork(self) -> None:
        self._endpoints.after_fork()  # the parent's pools hold its sockets (and TLS state): dropped unclosed
        self._auth_lock = self._endpoints.new_lock()

    def close(self) -> None:
        self._endpoints.close()


class Watch:
    """A watch that lasts until its deadline, over as many streaming requests as the retry policy makes.

    Each ``results()`` is one request. A rejected auth token is dropped and
    fetched again on the next request; two rejections in a row, with no
    accepted request between them, are a refusal. Rejections apart are
    not: a token expires (``--auth-token-ttl``) while a watch waits without
    using it, as often as the stream is cut.
    """

    def __init__(self, gateway: Gateway, create_requests: list[dict[str, Any]], deadline: float, what: str) -> None:
        self._gateway = gateway
        self._body = "\n".join(_encode({"create_request": r}) for r in create_requests).encode("utf-8")
        self._deadline = deadline
        self._what = what
        self._rejected_in_a_row = 0

    def results(self) -> Generator[dict[str, Any], None, None]:
        """Each message of the stream (``created`` first, then ``events``), until the deadline (then it ends).

        Raises ``WatchCancelled`` if the server ends the watch, and
        ``retry.Transient`` if the stream breaks before the deadline.
        Close it (``contextlib.closing``) to end the request early.
        """
        gateway = self._gateway
        index, pool = gateway._pick()
        token = None
        try:
            token = gateway._auth_token(index, pool)
            for result in gateway._stream(index, pool, self._body, self._deadline, token):
                self._rejected_in_a_row = 0  # the server took the token
                yield result
        except _ApiPathChanged:
            raise retry.Transient(gateway.endpoints[index], "found the gateway at another path") from None
        except _TokenRejected:
            self._rejected_in_a_row += 1
            if self._rejected_in_a_row > 1 or not gateway._auth_enabled:
                raise AuthenticationFailed(gateway._auth_message(index, f"may not watch {self._what}")) from None
            gateway._drop_token(token)
            raise retry.Transient(gateway.endpoints[index], "auth token rejected; authenticating again") from None


def _headers(token: str | None) -> dict[str, str]:
    return {"Content-Type": "application/json", "Authorization": token} if token else _JSON
