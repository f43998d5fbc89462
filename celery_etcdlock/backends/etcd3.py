"""The etcd v3 API through its JSON gateway, with etcd3gw (``etcd3://`` and ``etcd3s://``).

A queue is a key prefix; an entry is the key ``<queue>/<lease hex>.<nonce>``,
attached to the session's lease, created by a transaction that puts it only
if it does not exist yet. Its token is its ``create_revision``. The queue is
read in one range request sorted by create revision; a waiter watches the one
key it waits for, for DELETE, from the revision of that read. A renewal is
one lease keep-alive plus one listing of the lease's keys, whatever the
number of entries (the listing notices an entry deleted behind our back).
Records are written by one transaction comparing their mod revision and,
when fenced, the fence entry's create revision.

    backend = Etcd3Backend(parse_url("etcd3://127.0.0.1:2379"))   # no network I/O yet
    lease = backend.grant(10)
    entry = backend.create_entry("locks/x", {"mode": "write"}, lease)
    backend.read_queue("locks/x").entries[0] == entry

etcd3gw gives one ``Etcd3Client`` per endpoint (its HTTP session, TLS and
URLs). Requests go through that client's session rather than its helpers,
because the helpers cannot carry an auth token or a per-request timeout,
hide the gRPC error code, discover the API path with an extra request in
the middle of the first operation, and its watch hangs for ever on a
cancelled or compacted watch. So: the API path is ``/v3/`` until a server
says otherwise (then ``GET /version`` decides), auth is the gateway's token
(``POST /v3/auth/authenticate``, re-done when a token is rejected), and a
watch is read here, line by line, with a deadline on every read.

Fail-over: a connection failure moves this backend to the next endpoint and
raises ``retry.Transient``, which the retry policy retries.
"""

from __future__ import annotations

import base64
import http.client
import json
import math
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import requests
from celery.utils.log import get_logger
from etcd3gw.client import Etcd3Client
from requests.adapters import HTTPAdapter

from .. import retry
from ..errors import AuthenticationFailed, BackendError, UnsupportedServer
from .base import Backend, Entry, Lease, LeaseExpired, Record, Snapshot, WaitResult, decode_json, encode_json

if TYPE_CHECKING:
    from ..connect import ConnectionOptions

logger = get_logger(__name__)
T = TypeVar("T")

# gRPC status codes, as the gateway reports them in {"code": N, "message": ...}
_CANCELLED, _INVALID_ARGUMENT, _DEADLINE_EXCEEDED, _NOT_FOUND = 1, 3, 4, 5
_PERMISSION_DENIED, _RESOURCE_EXHAUSTED, _FAILED_PRECONDITION = 7, 8, 9
_ABORTED, _UNAVAILABLE, _UNAUTHENTICATED = 10, 14, 16
_TRANSIENT_CODES = frozenset({_CANCELLED, _DEADLINE_EXCEEDED, _RESOURCE_EXHAUSTED, _ABORTED, _UNAVAILABLE})
_TRANSIENT_MESSAGES = ("leader changed", "no leader", "too many requests", "timed out", "not capable")

_API_PATHS = ((3, 4, "/v3/"), (3, 3, "/v3beta/"), (3, 0, "/v3alpha/"))  # etcd version -> gateway path


class _Failure(Exception):
    """An answer from etcd that is not success (not transient, not about auth): code and message."""

    def __init__(self, code: int | None, message: str) -> None:
        super().__init__(message)
        self.code = code


class _TokenRejected(Exception):
    """The auth token was refused (expired, or the server restarted): authenticate again."""


class _ApiPathChanged(Exception):
    """``GET /version`` found an older gateway path: send the request again."""


class V3Lease(Lease):
    """One etcd lease."""

    def __init__(self, lease_id: int, ttl: float, granted_ttl: int) -> None:
        self.lease_id = lease_id
        self.ttl = ttl
        self.granted_ttl = granted_ttl  # what etcd granted: ceil(ttl), or etcd's minimum if higher

    @property
    def id(self) -> str:
        return f"{self.lease_id:x}"

    def __repr__(self) -> str:
        return f"<V3Lease {self.id} ttl={self.granted_ttl} expired={self.expired}>"


def _b64(text: str) -> str:
    return base64.b64encode(text.encode("utf-8")).decode("ascii")


def _unb64(text: str) -> str:
    return base64.b64decode(text).decode("utf-8", errors="replace")


def _range_end(prefix: str) -> str:
    """The first key after every key that starts with ``prefix``, base64-encoded."""
    raw = bytearray(prefix.encode("utf-8"))
    while raw and raw[-1] == 0xFF:
        raw.pop()
    if not raw:
        return base64.b64encode(b"\0").decode("ascii")  # no upper bound
    raw[-1] += 1
    return base64.b64encode(bytes(raw)).decode("ascii")


def _find_cause(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The first ``kind`` in ``exc``'s args, causes and contexts (requests nests urllib3's errors)."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, kind):
            return current
        todo.extend(a for a in current.args if isinstance(a, BaseException))
        todo.extend(c for c in (current.__cause__, current.__context__) if c is not None)
        reason = getattr(current, "reason", None)
        if isinstance(reason, BaseException):
            todo.append(reason)
    return None


def _not_http(exc: BaseException) -> http.client.BadStatusLine | None:
    """The server answered with something that is not HTTP (a redis port, say)."""
    found = _find_cause(exc, http.client.BadStatusLine)
    if isinstance(found, http.client.BadStatusLine) and not isinstance(found, http.client.RemoteDisconnected):
        return found
    return None


class Etcd3Backend(Backend):
    schemes = ("etcd3", "etcd3s")

    def __init__(self, options: ConnectionOptions) -> None:
        self.options = options
        self.prefix = options.prefix
        self.endpoints = options.endpoint_urls
        self._current = 0
        self._local = threading.Lock()
        self._clients: list[Etcd3Client | None] = [None] * len(self.endpoints)
        self._api_paths = ["/v3/"] * len(self.endpoints)
        self._answered = [False] * len(self.endpoints)  # has it ever answered like an etcd gateway?
        self._auth_lock = threading.Lock()
        self._token: str | None = None
        self._auth_enabled = options.username is not None
        # given with every request: requests lets $REQUESTS_CA_BUNDLE override a session's own CA
        self._verify: str | bool = (options.ca or True) if options.tls else True

    # -- HTTP ---------------------------------------------------------------

    def _client(self, index: int) -> Etcd3Client:
        client = self._clients[index]
        if client is None:
            host, port = self.options.endpoints[index]
            session = requests.Session()
            # no proxies, netrc or CA bundle from the environment: the URL says where etcd is and whom to
            # trust; and looking them up again on every request costs more than the request itself
            session.trust_env = False
            adapter = HTTPAdapter(pool_connections=1, pool_maxsize=32)
            session.mount("http://", adapter)
            session.mount("https://", adapter)
            if self.options.tls:
                session.verify = self._verify
                if self.options.cert:
                    session.cert = (self.options.cert, self.options.key) if self.options.key else self.options.cert
            client = Etcd3Client(
                host=host,
                port=port,
                protocol="https" if self.options.tls else "http",
                timeout=self.options.timeout,
                api_path=self._api_paths[index],  # given: no discovery request behind our back
                session=session,
            )
            self._clients[index] = client
        return client

    def _pick(self) -> tuple[int, Etcd3Client]:
        with self._local:
            index = self._current
            return index, self._client(index)

    def _rotate(self, failed: int) -> None:
        with self._local:
            if self._current == failed and len(self.endpoints) > 1:
                self._current = (failed + 1) % len(self.endpoints)
                logger.warning("etcd %s failed; switching to %s", self.endpoints[failed], self.endpoints[self._current])

    def _full(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    def _relative(self, key: str) -> str:
        return key[len(self.prefix) + 1 :]

    def _post(self, path: str, body: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """One gateway request to the current endpoint, authenticated; the decoded answer."""
        for attempt in range(3):
            index, client = self._pick()
            token = None
            try:
                token = self._auth_token(index)
                return self._send(index, client, path, body, token, timeout)
            except _ApiPathChanged:
                continue
            except _TokenRejected:
                if attempt > 0 or not self._auth_enabled:
                    message = self._auth_message(index, "had its auth token rejected twice in a row")
                    raise AuthenticationFailed(message) from None
                self._drop_token(token)
        raise BackendError(f"etcd at {self.endpoints[index]} kept changing its API path")

    def _send(
        self,
        index: int,
        client: Etcd3Client,
        path: str,
        body: dict[str, Any],
        token: str | None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        url = client.base_url + self._api_paths[index] + path
        headers = {"Authorization": token} if token else None
        try:
            response = client.session.post(
                url, json=body, headers=headers, timeout=timeout or self.options.timeout, verify=self._verify
            )
        except requests.RequestException as exc:
            raise self._connection_failure(index, client, exc) from None
        return self._decode(index, client, path, response)

    def _decode(self, index: int, client: Etcd3Client, path: str, response: requests.Response) -> dict[str, Any]:
        endpoint = self.endpoints[index]
        try:
            answer = response.json()
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            answer = None
        if response.status_code == 200 and answer is not None:
            self._answered[index] = True
            return answer
        if answer is not None and isinstance(answer.get("code"), int):
            self._answered[index] = True
            raise self._grpc_error(index, answer["code"], str(answer.get("message") or answer.get("error") or ""))
        if response.status_code >= 500:
            raise retry.Transient(endpoint, f"HTTP {response.status_code} {response.text[:200]!r}")
        raise self._not_a_gateway(index, client, f"POST {self._api_paths[index]}{path}", response)

    def _grpc_error(self, index: int, code: int, message: str) -> Exception:
        endpoint = self.endpoints[index]
        lowered = message.lower()
        if code == _UNAUTHENTICATED or "invalid auth token" in lowered:
            return _TokenRejected(message)
        if code in _TRANSIENT_CODES or any(m in lowered for m in _TRANSIENT_MESSAGES):
            if code == _UNAVAILABLE:
                self._rotate(index)  # a member without a leader, or shutting down: another may serve
            return retry.Transient(endpoint, message)
        if code == _PERMISSION_DENIED:
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
        return _Failure(code, f"{endpoint}: {message}")

    def _connection_failure(self, index: int, client: Etcd3Client, exc: requests.RequestException) -> Exception:
        endpoint = self.endpoints[index]
        first_contact = not self._answered[index]
        if isinstance(exc, requests.exceptions.SSLError):
            text = str(exc)
            if "CERTIFICATE_VERIFY_FAILED" in text or "certificate verify failed" in text:
                return BackendError(
                    f"the TLS certificate of {endpoint} could not be verified: {exc} "
                    "(give the CA that signed it with ?ca=/path/to/ca.pem)"
                )
            if any(alert in text for alert in ("ALERT_BAD_CERTIFICATE", "CERTIFICATE_REQUIRED", "UNKNOWN_CA")):
                return BackendError(
                    f"{endpoint} refused the TLS connection ({exc}): it wants a client certificate it trusts "
                    "(give ?cert=/path/to/client.pem&key=/path/to/client.key)"
                )
            if first_contact and self._greeting(index).startswith(b"HTTP/"):
                return UnsupportedServer(f"{endpoint} does not speak TLS, only plain HTTP: use etcd3:// for it")
        elif first_contact and (_not_http(exc) or _find_cause(exc, ConnectionResetError)):
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
        self._rotate(index)
        return retry.Transient(endpoint, exc)

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
            with socket.create_connection((host, port), timeout=min(2.0, self.options.timeout)) as sock, \
                    context.wrap_socket(sock):
                return True
        except OSError:
            return False

    def _not_a_gateway(self, index: int, client: Etcd3Client, request: str, response: requests.Response) -> Exception:
        """An HTTP answer that is not the v3 gateway's: find out what the server is, for the message."""
        endpoint = self.endpoints[index]
        what = f"{request} answered HTTP {response.status_code} {response.text.strip()[:80]!r}"
        if "HTTPS server" in response.text:
            return UnsupportedServer(f"{endpoint} speaks TLS only ({what}): use etcd3s:// (with ?ca= for its CA)")
        try:
            probe = client.session.get(client.base_url + "/version", timeout=self.options.timeout, verify=self._verify)
            version_text = probe.json().get("etcdserver") if probe.status_code == 200 else None
        except (requests.RequestException, ValueError, AttributeError):
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
        return UnsupportedServer(
            f"etcd {version_text} at {endpoint} does not serve the v3 JSON gateway ({what}); "
            "it is on unless etcd runs with --enable-grpc-gateway=false"
        )

    # -- auth ---------------------------------------------------------------

    def _auth_message(self, index: int, what: str) -> str:
        return f"etcd at {self.endpoints[index]}: user {self.options.username!r} {what}"

    def _auth_token(self, index: int) -> str | None:
        if not self._auth_enabled:
            return None
        with self._auth_lock:
            if self._token is None and self._auth_enabled:
                self._authenticate(index)
            return self._token

    def _authenticate(self, index: int) -> None:
        client = self._client(index)
        body = {"name": self.options.username, "password": self.options.password or ""}
        try:
            answer = self._send(index, client, "auth/authenticate", body, token=None)
        except _Failure as exc:
            if "authentication is not enabled" in str(exc):
                logger.warning("etcd at %s has authentication off: ignoring the user name in the URL",
                               self.endpoints[index])
                self._auth_enabled = False
                return
            raise AuthenticationFailed(self._auth_message(index, f"was refused ({exc})")) from None
        except _TokenRejected as exc:
            raise AuthenticationFailed(self._auth_message(index, f"was refused ({exc})")) from None
        token = answer.get("token")
        if not token:
            raise AuthenticationFailed(self._auth_message(index, "got no token from authenticate"))
        self._token = str(token)
        logger.debug("authenticated to etcd at %s as %r", self.endpoints[index], self.options.username)

    def _drop_token(self, token: str | None) -> None:
        with self._auth_lock:
            if self._token == token:
                self._token = None

    # -- retries ------------------------------------------------------------

    def _retrying(self, operation: str, fn: Callable[[], T]) -> T:
        try:
            return retry.run(retry.call_policy(self.options.retry_max_delay, operation), fn, self.endpoints)
        except _Failure as exc:
            raise BackendError(f"etcd {operation} failed: {exc}") from None

    def _txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]],
             failure: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        return self._post("kv/txn", {"compare": compare, "success": success, "failure": failure or []})

    def _range(self, key: str, prefix: bool = False) -> dict[str, Any]:
        body: dict[str, Any] = {"key": _b64(key)}
        if prefix:
            body.update(range_end=_range_end(key), sort_order="ASCEND", sort_target="CREATE")
        return self._post("kv/range", body)

    def _entry(self, kv: dict[str, Any]) -> Entry:
        raw = _unb64(kv.get("value", ""))
        return Entry(self._relative(_unb64(kv["key"])), int(kv["create_revision"]), decode_json(raw), raw)

    # -- leases -------------------------------------------------------------

    def grant(self, ttl: float) -> Lease:
        wanted = max(1, math.ceil(ttl))

        def grant() -> Lease:
            answer = self._post("lease/grant", {"TTL": wanted})
            return V3Lease(int(answer["ID"]), ttl, int(answer.get("TTL", wanted)))

        return self._retrying(f"grant a {wanted}s lease", grant)

    def keep_alive(self, lease: Lease, entries: list[Entry], timeout: float) -> set[str]:
        """Renew the lease, then list the keys it still carries: two requests, whatever the number of entries.

        The second request notices an entry deleted behind our back (``celery
        etcdlock release``, an operator) while the lease lives on, so its holder
        learns at once that it lost the lock. A single attempt: the session's
        renewal policy retries.
        """
        lease = self._own(lease)
        deadline = time.monotonic() + max(0.05, timeout)
        try:
            answer = self._post("lease/keepalive", {"ID": str(lease.lease_id)}, timeout=max(0.05, timeout))
        except _Failure as exc:
            raise BackendError(f"etcd keep-alive of lease {lease.id} failed: {exc}") from None
        if int(answer.get("result", {}).get("TTL", 0)) <= 0:
            lease.expired = True
            return {entry.key for entry in entries}
        if not entries:
            return set()
        try:
            answer = self._post(
                "kv/lease/timetolive",
                {"ID": str(lease.lease_id), "keys": True},
                timeout=max(0.05, deadline - time.monotonic()),
            )
        except (retry.Transient, _Failure) as exc:
            logger.debug("lease %s renewed, but listing its keys failed (%s): checked next time", lease.id, exc)
            return set()
        if int(answer.get("TTL", -1)) <= 0:
            lease.expired = True
            return {entry.key for entry in entries}
        alive = {self._relative(_unb64(key)) for key in answer.get("keys", ())}
        return {entry.key for entry in entries if entry.key not in alive}

    def revoke(self, lease: Lease) -> None:
        lease = self._own(lease)

        def revoke() -> None:
            try:
                self._post("kv/lease/revoke", {"ID": str(lease.lease_id)})
            except _Failure as exc:
                if exc.code != _NOT_FOUND:
                    raise
            lease.expired = True

        self._retrying(f"revoke lease {lease.id}", revoke)

    @staticmethod
    def _own(lease: Lease) -> V3Lease:
        if not isinstance(lease, V3Lease):
            raise TypeError(f"the etcd v3 backend needs one of its own leases, not {lease!r}")
        return lease

    # -- queues -------------------------------------------------------------

    def create_entry(self, queue: str, value: dict[str, Any], lease: Lease) -> Entry:
        lease = self._own(lease)
        if lease.expired:
            raise LeaseExpired(f"lease {lease.id} has expired")
        key = f"{queue}/{lease.id}.{secrets.token_hex(8)}"  # the nonce: no two acquisitions share a key
        raw = encode_json(value)
        full = _b64(self._full(key))

        def create() -> Entry:
            try:
                answer = self._txn(
                    [{"key": full, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
                    [{"request_put": {"key": full, "value": _b64(raw), "lease": str(lease.lease_id)}}],
                    [{"request_range": {"key": full}}],
                )
            except _Failure as exc:
                if exc.code == _NOT_FOUND and "lease not found" in str(exc):
                    lease.expired = True
                    raise LeaseExpired(f"lease {lease.id} has expired") from None
                raise
            if answer.get("succeeded"):
                return Entry(key, int(answer["header"]["revision"]), value, raw)
            # a retry whose first attempt was applied: the unique key is there with our value
            kvs = answer["responses"][0]["response_range"].get("kvs", [])
            if kvs and _unb64(kvs[0].get("value", "")) == raw and int(kvs[0].get("lease", 0)) == lease.lease_id:
                return self._entry(kvs[0])
            raise _Failure(None, f"{key} already exists with another value")

        return self._retrying(f"create entry in {queue}", create)

    def join_queue(self, queue: str, value: dict[str, Any], lease: Lease) -> tuple[Entry, Snapshot]:
        """One transaction: create my key and read the whole queue, which already includes it."""
        lease = self._own(lease)
        if lease.expired:
            raise LeaseExpired(f"lease {lease.id} has expired")
        key = f"{queue}/{lease.id}.{secrets.token_hex(8)}"
        raw = encode_json(value)
        full = _b64(self._full(key))
        queue_prefix = self._full(queue) + "/"
        read_queue = {
            "request_range": {
                "key": _b64(queue_prefix),
                "range_end": _range_end(queue_prefix),
                "sort_order": "ASCEND",
                "sort_target": "CREATE",
            }
        }

        def join() -> tuple[Entry, Snapshot]:
            try:
                answer = self._txn(
                    [{"key": full, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
                    [{"request_put": {"key": full, "value": _b64(raw), "lease": str(lease.lease_id)}}, read_queue],
                    [read_queue],
                )
            except _Failure as exc:
                if exc.code == _NOT_FOUND and "lease not found" in str(exc):
                    lease.expired = True
                    raise LeaseExpired(f"lease {lease.id} has expired") from None
                raise
            revision = int(answer["header"]["revision"])
            kvs = answer["responses"][-1]["response_range"].get("kvs", [])
            snapshot = Snapshot([self._entry(kv) for kv in kvs], revision)
            mine = next((e for e in snapshot.entries if e.key == key), None)
            # a retry whose first attempt was applied finds the unique key there with our value
            if mine is None or mine.raw != raw:
                raise _Failure(None, f"{key} was not created")
            return mine, snapshot

        return self._retrying(f"join queue {queue}", join)

    def read_queue(self, queue: str, fresh: bool = False) -> Snapshot:
        # v3 ranges are linearizable unless asked to be serializable: every read is fresh

        def read() -> Snapshot:
            answer = self._range(self._full(queue) + "/", prefix=True)
            return Snapshot([self._entry(kv) for kv in answer.get("kvs", [])], int(answer["header"]["revision"]))

        return self._retrying(f"read queue {queue}", read)

    def wait_gone(self, entry: Entry, after_revision: int, timeout: float) -> WaitResult:
        deadline = time.monotonic() + timeout
        key = self._full(entry.key)
        denied = 0

        def watch() -> WaitResult:
            nonlocal denied
            if time.monotonic() >= deadline:
                return WaitResult.TIMEOUT
            index, client = self._pick()
            token = None
            try:
                token = self._auth_token(index)
                return self._watch_delete(index, client, key, after_revision + 1, deadline, token)
            except _ApiPathChanged:
                raise retry.Transient(self.endpoints[index], "found the gateway at another path") from None
            except _TokenRejected:
                denied += 1
                if denied > 1 or not self._auth_enabled:
                    raise AuthenticationFailed(self._auth_message(index, f"may not watch {entry.key}")) from None
                self._drop_token(token)
                raise retry.Transient(self.endpoints[index], "auth token rejected; authenticating again") from None

        return self._retrying(f"watch {entry.key}", watch)

    def _watch_delete(
        self, index: int, client: Etcd3Client, key: str, start_revision: int, deadline: float, token: str | None
    ) -> WaitResult:
        """Watch ``key`` for DELETE from ``start_revision`` on one streaming request, until ``deadline``.

        The gateway streams newline-delimited JSON messages. Each read waits
        at most until the deadline (the socket's timeout is set before each
        read), so a watch the server cancels, compacts or forgets never hangs.
        """
        endpoint = self.endpoints[index]
        body = {"create_request": {"key": _b64(key), "start_revision": str(start_revision), "filters": ["NOPUT"]}}
        headers = {"Authorization": token} if token else None
        url = client.base_url + self._api_paths[index] + "watch"
        try:
            response = client.session.post(
                url, json=body, headers=headers, stream=True, timeout=self.options.timeout, verify=self._verify
            )
        except requests.RequestException as exc:
            raise self._connection_failure(index, client, exc) from None
        try:
            if response.status_code != 200:
                self._decode(index, client, "watch", response)  # raises what the answer means
                raise _Failure(None, f"{endpoint}: watch answered HTTP {response.status_code}")
            sock = _socket_of(response)
            for message in _messages(response, sock, deadline):
                result = self._watch_message(index, message)
                if result is not None:
                    return result
            if time.monotonic() >= deadline:
                return WaitResult.TIMEOUT
            raise retry.Transient(endpoint, "the watch stream ended")
        except (requests.RequestException, OSError, ValueError) as exc:
            if time.monotonic() >= deadline - 0.001:
                return WaitResult.TIMEOUT
            self._rotate(index)
            raise retry.Transient(endpoint, f"watch failed: {exc}") from None
        finally:
            response.close()

    def _watch_message(self, index: int, message: dict[str, Any]) -> WaitResult | None:
        error = message.get("error")
        if isinstance(error, dict):
            code = int(error.get("grpc_code") or error.get("code") or 2)
            exc = self._grpc_error(index, code, str(error.get("message")))
            if isinstance(exc, _Failure):
                logger.debug("watch ended with %s: reading again", exc)
                return WaitResult.STALE
            raise exc
        result = message.get("result", {})
        if int(result.get("compact_revision", 0)):
            return WaitResult.STALE  # the revision to watch from was compacted: read again
        if result.get("canceled"):
            reason = str(result.get("cancel_reason", ""))
            if "permission denied" in reason.lower() or "auth" in reason.lower():
                raise _TokenRejected(reason)  # an expired token shows up as a denial here
            logger.debug("watch cancelled (%s): reading again", reason or "no reason given")
            return WaitResult.STALE
        if any(event.get("type") == "DELETE" for event in result.get("events", ())):
            return WaitResult.GONE
        return None

    def delete_entry(self, entry: Entry) -> bool:
        full = _b64(self._full(entry.key))

        def delete() -> bool:
            answer = self._txn(
                [{"key": full, "target": "CREATE", "result": "EQUAL", "create_revision": str(entry.token)}],
                [{"request_delete_range": {"key": full}}],
            )
            return bool(answer.get("succeeded"))

        return self._retrying(f"delete {entry.key}", delete)

    def list_queues(self, namespace: str) -> dict[str, list[Entry]]:
        def read() -> dict[str, list[Entry]]:
            answer = self._range(self._full(namespace) + "/", prefix=True)
            queues: dict[str, list[Entry]] = {}
            for kv in answer.get("kvs", []):  # sorted by create revision, so each queue is too
                entry = self._entry(kv)
                rest = entry.key[len(namespace) + 1 :].split("/")
                if len(rest) == 2:
                    queues.setdefault(f"{namespace}/{rest[0]}", []).append(entry)
            return queues

        return self._retrying(f"list {namespace}", read)

    # -- records ------------------------------------------------------------

    def _record(self, kv: dict[str, Any]) -> Record:
        ttl: float | None = None
        lease_id = int(kv.get("lease", 0))
        if lease_id:  # one more request, for records that expire
            left = int(self._post("kv/lease/timetolive", {"ID": str(lease_id)}).get("TTL", -1))
            ttl = float(max(0, left))
        return Record(self._relative(_unb64(kv["key"])), decode_json(_unb64(kv.get("value", ""))),
                      int(kv["mod_revision"]), ttl)

    def get_record(self, key: str) -> Record | None:
        def get() -> Record | None:
            kvs = self._range(self._full(key)).get("kvs", [])
            return self._record(kvs[0]) if kvs else None

        return self._retrying(f"read {key}", get)

    def put_record(
        self,
        key: str,
        value: dict[str, Any],
        *,
        expect: Record | None,
        fence: Entry | None = None,
        ttl: float | None = None,
    ) -> Record | None:
        full = _b64(self._full(key))
        raw = encode_json(value)
        compare: list[dict[str, Any]] = [
            {"key": full, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
            if expect is None
            else {"key": full, "target": "MOD", "result": "EQUAL", "mod_revision": str(expect.version)}
        ]
        if fence is not None:  # a deposed holder's write must fail: its key is gone or re-created
            compare.append({"key": _b64(self._full(fence.key)), "target": "CREATE", "result": "EQUAL",
                            "create_revision": str(fence.token)})
        put: dict[str, Any] = {"key": full, "value": _b64(raw)}
        lease: V3Lease | None = None
        if ttl is not None:
            lease = self._own(self.grant(ttl))  # a lease of its own: the record outlives its writer
            put["lease"] = str(lease.lease_id)
        attempts = 0

        def write() -> Record | None:
            nonlocal attempts
            attempts += 1
            answer = self._txn(compare, [{"request_put": put}], [{"request_range": {"key": full}}])
            if answer.get("succeeded"):
                return Record(key, value, int(answer["header"]["revision"]), ttl)
            kvs = answer["responses"][0]["response_range"].get("kvs", [])
            if attempts > 1 and kvs and _unb64(kvs[0].get("value", "")) == raw and \
                    int(kvs[0].get("lease", 0)) == (lease.lease_id if lease else 0):
                return Record(key, value, int(kvs[0]["mod_revision"]), ttl)  # our lost first attempt
            return None

        record = self._retrying(f"write {key}", write)
        if record is None and lease is not None:
            self._forget_lease(lease)
        return record

    def _forget_lease(self, lease: V3Lease) -> None:
        try:
            self._post("kv/lease/revoke", {"ID": str(lease.lease_id)})
        except (retry.Transient, BackendError, _Failure) as exc:
            logger.debug("could not revoke unused lease %s (%s); it expires by itself", lease.id, exc)

    def delete_record(self, key: str, expect: Record | None = None) -> bool:
        full = _b64(self._full(key))

        def delete() -> bool:
            if expect is None:
                return int(self._post("kv/deleterange", {"key": full}).get("deleted", 0)) > 0
            answer = self._txn(
                [{"key": full, "target": "MOD", "result": "EQUAL", "mod_revision": str(expect.version)}],
                [{"request_delete_range": {"key": full}}],
            )
            return bool(answer.get("succeeded"))

        return self._retrying(f"delete {key}", delete)

    def list_records(self, directory: str) -> list[Record]:
        def read() -> list[Record]:
            answer = self._range(self._full(directory) + "/", prefix=True)
            start = len(self._full(directory)) + 1
            return [self._record(kv) for kv in answer.get("kvs", []) if "/" not in _unb64(kv["key"])[start:]]

        return self._retrying(f"list {directory}", read)

    # -- process life -------------------------------------------------------

    def after_fork(self) -> None:
        # The parent's sessions share its sockets (and TLS state): drop them unclosed.
        self._local = threading.Lock()
        self._auth_lock = threading.Lock()
        self._clients = [None] * len(self.endpoints)

    def close(self) -> None:
        with self._local:
            clients, self._clients = self._clients, [None] * len(self.endpoints)
        for client in clients:
            if client is not None:
                client.session.close()


def _socket_of(response: requests.Response) -> socket.socket | None:
    connection = getattr(response.raw, "connection", None) or getattr(response.raw, "_connection", None)
    sock = getattr(connection, "sock", None)
    return sock if isinstance(sock, socket.socket) else None


def _messages(response: requests.Response, sock: socket.socket | None, deadline: float) -> Iterator[dict[str, Any]]:
    """The JSON messages of a gateway stream, each read bounded by ``deadline``."""
    chunks = response.iter_content(chunk_size=None)
    buffer = b""
    while True:
        while b"\n" not in buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            if sock is not None:
                sock.settimeout(remaining)
            try:
                chunk = next(chunks)
            except StopIteration:
                return
            buffer += chunk
        line, _, buffer = buffer.partition(b"\n")
        if line.strip():
            message = json.loads(line)
            if isinstance(message, dict):
                yield message
