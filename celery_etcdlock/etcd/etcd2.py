"""The etcd v2 keys API (``etcd://`` and ``etcds://``).

A queue is a directory; an entry is an in-order key created by POST, whose
name is its zero-padded ``createdIndex`` (so name order is creation order)
and whose value is a JSON document made unique by a nonce. That value is
the owner check: renewals (``refresh=true``) and deletes carry it as
``prevValue``, so a process can only renew or delete what it created.

v2 has no leases: a lease here is the group of keys one renewal round
refreshes, each with its own TTL (whole seconds, rounded up).

Requests go to one connection pool per endpoint (``transport.py``: kept-alive
HTTP/1.1, TLS from the URL, basic auth in a header), and fail-over between
endpoints is ours, driven by the retry policy. Answers are checked and
decoded here as python-etcd's ``api_execute`` does (same cluster-ID check,
same error payloads), without its per-request URL parsing, pool lookup and
wrapping, and urllib3's work under it: that cost a waiting process more CPU
than the rest of its work on a handoff.
"""

from __future__ import annotations

import base64
import functools
import itertools
import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import quote, urlencode

from ..errors import AuthenticationFailed, BackendError, UnsupportedServer
from ..options import ConnectionOptions
from . import retry, transport
from .base import (
    Backend,
    Entry,
    Lease,
    Record,
    RecordChange,
    RecordSet,
    Snapshot,
    WaitResult,
    decode_json,
    encode_json,
    peer_port_error,
    server_ttl,
)
from .endpoints import UNREADABLE, Endpoints

logger = logging.getLogger(__name__)
T = TypeVar("T")

_GONE_ACTIONS = frozenset({"delete", "expire", "compareAndDelete"})
_NOT_FOUND, _COMPARE_FAILED, _NOT_A_FILE, _ALREADY_EXISTS, _DIR_NOT_EMPTY = 100, 101, 102, 105, 108
_TRANSIENT_CODES = frozenset({300, 301})  # raft internal error, leader election in progress
_INDEX_CLEARED, _WATCHER_CLEARED = 401, 400
_INVALID_FORM = 210  # "Invalid POST form": what a form over net/http's 10 MB gets ("http: POST too large")
# etcd's plain-HTTP client port sorts HTTP/1 from gRPC by reading the request line (cmux) within 4096 bytes: a longer
# one (a long key: v2 puts it in the URL) gets its connection reset, no answer. (Behind TLS the limit is net/http's
# 1 MB of headers: HTTP 431.)
_MAX_REQUEST_LINE = 4096


class _Failure(Exception):
    """An answer from etcd that is not success: its error code and payload."""

    def __init__(self, code: int | None, payload: dict[str, Any], message: str) -> None:
        super().__init__(message)
        self.code = code
        self.payload = payload


class _WatchTimedOut(Exception):
    pass


def _too_large(endpoint: str, why: str) -> BackendError:
    """A request etcd refuses for its size: the same next time, so an answer, never retried."""
    return BackendError(f"etcd at {endpoint} refuses a request this large ({why}): use shorter lock names and keys")


def _decode_answer(body: bytes, headers: dict[str, str]) -> tuple[dict[str, Any], int]:
    """A success's JSON object and its X-Etcd-Index (``UNREADABLE`` errors if it has neither)."""
    decoded = json.loads(body.decode("utf-8"))
    index = headers.get("x-etcd-index", "0")
    if not isinstance(decoded, dict) or not (index.isascii() and index.isdigit()):
        raise ValueError(f"not a JSON object with an X-Etcd-Index (X-Etcd-Index: {index[:40]!r})")
    return decoded, int(index)


class V2Lease(Lease):
    _ids = itertools.count(1)

    def __init__(self, ttl: float, server_ttl: int) -> None:
        super().__init__(ttl, server_ttl)  # each key's own TTL (v2 has no leases)
        self._id = f"v2-{next(self._ids)}"

    @property
    def id(self) -> str:
        return self._id


class Etcd2Backend(Backend):
    entries_have_own_ttl = True  # no leases: each key has its TTL and is refreshed on its own
    queues_outlive_entries = True  # queues are directories: the renewer removes the unused ones

    def __init__(self, options: ConnectionOptions, *, native: bool = False) -> None:
        self.options = options
        self.prefix = options.prefix
        self.endpoints = options.endpoint_urls
        self.native = native  # a native_twin: connections of its own on unpatched sockets, OS locks
        self._endpoints = Endpoints(options, native=native)
        self._cluster_ids: list[str | None] = [None] * len(self.endpoints)
        self._modified: dict[str, int] = {}  # entry key -> the modifiedIndex its last renewal here saw
        # the path of every key, %-encoded once (a prefix may hold any letter; names are encoded by keys.py)
        self._keys_path = "/v2/keys" + quote(self.prefix, safe="/")
        self._headers: dict[str, str] = {}
        if options.username and options.password:
            credentials = base64.b64encode(f"{options.username}:{options.password}".encode()).decode("ascii")
            self._headers["Authorization"] = f"Basic {credentials}"
        self._form_headers = {**self._headers, "Content-Type": "application/x-www-form-urlencoded"}

    def native_twin(self) -> Etcd2Backend:
        return Etcd2Backend(self.options, native=True)

    # -- HTTP ---------------------------------------------------------------

    def _path(self, key: str) -> str:
        """The request path of ``key``: the (encoded) prefix, then the key (made of URL-safe characters already)."""
        return f"{self._keys_path}/{quote(key, safe='/~')}" if key else self._keys_path

    def _relative(self, path: str) -> str:
        return path[len(self.prefix) + 1 :]

    def _request(
        self, method: str, key: str, params: dict[str, Any], timeout: float | None = None
    ) -> tuple[dict[str, Any], int]:
        """One HTTP request to the current endpoint: (decoded body, X-Etcd-Index).

        As python-etcd's ``api_execute``: GET and DELETE carry ``params`` in the query,
        PUT and POST as a form.
        """
        index, pool = self._endpoints.pick()
        endpoint = self.endpoints[index]
        url = self._path(key)
        body = b""
        headers = self._headers
        if method in ("PUT", "POST"):
            if params:
                body, headers = urlencode(params).encode("ascii"), self._form_headers
        elif params:
            url = f"{url}?{urlencode(params)}"
        if not self.options.tls and len(method) + len(url.encode()) + len(" HTTP/1.1\r\n") + 1 > _MAX_REQUEST_LINE:
            raise _too_large(endpoint, f"its URL is {len(url)} characters long, over the 4 KB etcd reads")
        watch = params.get("wait") == "true"
        try:
            response = pool.request(method, url, body, headers, timeout or self.options.timeout, stream=watch)
            if watch:  # etcd sends the headers at once, the body on the event: leaving the endpoint ends it
                try:
                    with self._endpoints.watching(index, response):
                        response.read()
                finally:
                    response.close()
        except OSError as exc:
            if watch and isinstance(exc, transport.ReadTimeout):
                raise _WatchTimedOut() from None
            raise self._endpoints.connection_failure(index, exc) from None
        if watch and response.status == 200 and not response.body.strip():
            raise _Failure(None, {}, f"{endpoint} ended the watch without an event")  # read again
        self._check_cluster_id(index, endpoint, response.headers.get("x-etcd-cluster-id"))
        if response.status not in (200, 201):
            error = self._error(endpoint, response.status, response.body, response.headers)
            if isinstance(error, retry.Transient):
                # no leader, or a write it could not commit in time (a member cut off from the others
                # answers so after etcd's own request timeout): another member may serve it
                self._endpoints.rotate(index)
            raise error
        return self._endpoints.decoded(index, lambda: _decode_answer(response.body, response.headers))

    def _check_cluster_id(self, index: int, endpoint: str, cluster_id: str | None) -> None:
        """python-etcd's check: an endpoint whose cluster ID changes was replaced (say, from a backup)."""
        if not cluster_id:
            return
        expected, self._cluster_ids[index] = self._cluster_ids[index], cluster_id
        if expected and cluster_id != expected:
            self._endpoints.reset(index)  # connect afresh next time
            raise self._classify(endpoint, {}, f"The UUID of the cluster changed from {expected} to {cluster_id}.")

    def _error(self, endpoint: str, status: int, data: bytes, headers: dict[str, str]) -> Exception:
        """An answer other than 200/201, decoded as python-etcd's ``EtcdError.handle`` does.

        One that is not etcd's JSON error (a proxy's HTML page, a redirect) is judged by its status, as v3 does:
        a 5xx is worth retrying, elsewhere too; anything else says the URL does not lead to etcd.
        """
        text = data.decode("utf-8", errors="replace")  # an error page in any encoding still gets shown
        try:
            payload = json.loads(text)
        except UNREADABLE:
            payload = None
        if not isinstance(payload, dict) or not isinstance(payload.get("errorCode", 0), int):
            shown = " ".join(text.split())[:120]
            if status >= 500:
                return retry.Transient(endpoint, f"HTTP {status} {shown!r}")
            if 300 <= status < 400:
                where = headers.get("location", "")[:200]
                return UnsupportedServer(
                    f"etcd at {endpoint} answered HTTP {status}, a redirect to {where!r}: redirects are not "
                    "followed; give the client URL of etcd itself"
                )
            payload = {"message": f"HTTP {status}", "cause": shown}
        payload["status"] = status
        return self._classify(endpoint, payload, f"{payload.get('message')} : {payload.get('cause')}")

    def _classify(self, endpoint: str, payload: dict[str, Any], message: str) -> Exception:
        code, status = payload.get("errorCode"), payload.get("status")
        cause = str(payload.get("cause", ""))
        if code is None and status not in (None, 401, 404, 413, 431) and "404 page not found" not in cause:
            return UnsupportedServer(
                f"{endpoint} is not an etcd v2 server: it answered {message[:160]}; etcd:// needs the client URL "
                "of etcd 3.4 or 3.5 with --enable-v2"
            )
        # net/http's 413 and 431 are plain text (no status in the payload then); a form over 10 MB is code 209
        if status in (413, 431) or " Too Large" in cause or (code == _INVALID_FORM and "too large" in message):
            return _too_large(endpoint, f"{payload.get('message')}: {cause[:80]}")
        # etcd without v2 answers "404 page not found" as plain text, which python-etcd cannot decode
        if code is None and (status == 404 or "404 page not found" in cause):
            peer_port = self._peer_port_error(endpoint)
            if peer_port is not None:
                return peer_port
            return UnsupportedServer(
                f"etcd at {endpoint} does not serve the v2 keys API (etcd 3.4 and 3.5 need --enable-v2, "
                "3.6 has none): use an etcd3:// URL instead"
            )
        if status == 401 or code == 110:
            who = f"user {self.options.username!r}" if self.options.username else "anonymous access"
            return AuthenticationFailed(f"etcd at {endpoint} refused {who}: {payload.get('message', message)}")
        if code in _TRANSIENT_CODES or (isinstance(status, int) and status >= 500):
            return retry.Transient(endpoint, payload.get("message", message))
        return _Failure(code, payload, f"{endpoint}: {message}")

    def _peer_port_error(self, endpoint: str) -> UnsupportedServer | None:
        """An UnsupportedServer if ``endpoint`` is an etcd member's peer port (which answers 404 to /v2/keys)."""
        pool = self._endpoints.pool(self.endpoints.index(endpoint))
        try:
            response = pool.request("GET", "/members", timeout=self.options.timeout)
        except OSError:
            return None
        return peer_port_error(endpoint, response.status, response.body)

    def _retrying(self, operation: str, fn: Callable[[], T]) -> T:
        try:
            return retry.call(self.options.retry_max_delay, operation, self._endpoints.guarded(fn), self.endpoints)
        except _Failure as exc:
            raise BackendError(f"etcd {operation} failed: {exc}") from None

    # -- leases -------------------------------------------------------------

    def grant(self, ttl: float) -> Lease:
        return V2Lease(ttl, server_ttl(ttl))

    def keep_alive(self, lease: Lease, entries: list[Entry], timeout: float) -> set[str]:
        return self._endpoints.guarded(functools.partial(self._keep_alive, lease, entries, timeout))()

    def _keep_alive(self, lease: Lease, entries: list[Entry], timeout: float) -> set[str]:
        """Refresh each entry (``refresh=true``, guarded by its value, in the form); all by ``timeout``."""
        deadline = time.monotonic() + timeout
        gone: set[str] = set()
        for entry in entries:
            remaining = deadline - time.monotonic()
            if remaining <= 0:  # the session's deadline is near: the next attempt, if any, starts afresh
                raise retry.Transient(self.endpoints[self._endpoints.current], "renewal ran out of time")
            params = {"ttl": lease.server_ttl, "refresh": "true", "prevExist": "true", "prevValue": entry.raw}
            try:
                body, _ = self._request("PUT", entry.key, params, timeout=remaining)
            except _Failure as exc:
                if exc.code not in (_NOT_FOUND, _COMPARE_FAILED):
                    raise BackendError(f"renewal of {entry.key} failed: {exc}") from None
                gone.add(entry.key)
                self._modified.pop(entry.key, None)
            except _WatchTimedOut:  # pragma: no cover - not a watch
                raise retry.Transient(self.endpoints[self._endpoints.current], "renewal timed out") from None
            else:
                self._modified[entry.key] = int(body["node"]["modifiedIndex"])
        return gone

    def revoke(self, lease: Lease, entries: list[Entry]) -> None:
        failed = 0
        for entry in entries:
            try:
                self._endpoints.guarded(functools.partial(self._delete_entry, entry))()
            except (BackendError, _Failure, retry.Transient, _WatchTimedOut):
                failed += 1
        if failed:
            raise BackendError(f"{failed} of {len(entries)} keys of lease {lease.id} could not be deleted")

    # -- queues -------------------------------------------------------------

    def join_queue(self, queue: str, value: dict[str, Any], lease: Lease) -> tuple[Entry, Snapshot]:
        # v2 cannot create and read in one request: two, and the entry goes again if the read fails
        return self._read_after_join(queue, self._create_entry(queue, value, lease))

    def join_queue_if_empty(self, queue: str, value: dict[str, Any], lease: Lease) -> tuple[Entry | None, Snapshot]:
        # fresh: giving up is a decision, and a member cut off from the others answers a plain read alone
        snapshot = self.read_queue(queue, fresh=True)
        if snapshot.entries:
            return None, snapshot
        entry = self._create_entry(queue, value, lease)
        if snapshot.revision > 0 and entry.token == snapshot.revision + 1:
            # etcd's index counts every write to the whole v2 store: nothing at all was written between the
            # read that found the queue empty and this create, so the queue is this entry alone
            return entry, Snapshot([entry], entry.token)
        return self._read_after_join(queue, entry)

    def _read_after_join(self, queue: str, entry: Entry) -> tuple[Entry, Snapshot]:
        try:
            return entry, self.read_queue(queue)
        except BaseException:
            self.delete_entry(entry)
            raise

    def _create_entry(self, queue: str, value: dict[str, Any], lease: Lease) -> Entry:
        value = {**value, "nonce": uuid.uuid4().hex}
        raw = encode_json(value)
        attempts = 0

        def create() -> Entry:
            nonlocal attempts
            attempts += 1
            if attempts > 1:  # the lost attempt may have been applied: the nonce finds it
                for entry in self.read_queue(queue, fresh=True).entries:
                    if entry.raw == raw:
                        return entry
            body, _ = self._request("POST", queue, {"value": raw, "ttl": lease.server_ttl})
            node = body["node"]
            return Entry(self._relative(node["key"]), int(node["createdIndex"]), raw)

        return self._retrying(f"create entry in {queue}", create)

    def read_queue(self, queue: str, fresh: bool = False) -> Snapshot:
        params = {"sorted": "true", "quorum": "true"} if fresh else {"sorted": "true"}

        def read() -> Snapshot:
            try:
                body, index = self._request("GET", queue, params)
            except _Failure as exc:
                if exc.code == _NOT_FOUND:
                    return Snapshot([], int(exc.payload.get("index", 0)))
                raise
            return Snapshot(self._entries(body["node"]), index)

        return self._retrying(f"read queue {queue}", read)

    def _entries(self, node: dict[str, Any]) -> list[Entry]:
        entries = [
            Entry(self._relative(child["key"]), int(child["createdIndex"]), child.get("value", ""), child.get("ttl"))
            for child in node.get("nodes", ())
            if not child.get("dir")
        ]
        entries.sort(key=lambda e: e.token)
        return entries

    def _next_event(self, path: str, params: dict[str, Any], deadline: float) -> dict[str, Any] | WaitResult:
        """The next event of a v2 watch (``wait=true``) by ``deadline``; or what the wait came to."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return WaitResult.TIMEOUT
        try:
            body, _ = self._request("GET", path, params, timeout=remaining)
        except _WatchTimedOut:
            return WaitResult.TIMEOUT
        except _Failure as exc:
            if exc.code in (_INDEX_CLEARED, _WATCHER_CLEARED, None):
                return WaitResult.STALE  # the index is too old to watch from: read again
            raise
        return body

    def wait_any_gone(self, entries: list[Entry], after_revision: int, timeout: float) -> WaitResult:
        # One entry: a watch of its key. Several (a semaphore's waiter): a recursive watch of their queue,
        # which also sees the queue's other changes: those move the index on without a new read.
        deadline = time.monotonic() + timeout
        keys = {entry.key for entry in entries}
        if len(entries) == 1:
            path, what, params = entries[0].key, entries[0].key, {"wait": "true"}
        else:
            path = entries[0].key.rsplit("/", 1)[0]
            what, params = f"{len(entries)} keys of {path}", {"wait": "true", "recursive": "true"}
        wait_index = after_revision + 1

        def poll() -> tuple[bool, int] | WaitResult:
            """An event: (is it one of the entries gone?, its index); or what the wait came to."""
            body = self._next_event(path, {**params, "waitIndex": wait_index}, deadline)
            if isinstance(body, WaitResult):
                return body
            node = body["node"]
            gone = body.get("action") in _GONE_ACTIONS and self._relative(node["key"]) in keys
            return gone, int(node["modifiedIndex"])

        while True:
            # each poll has a retry budget of its own: a wait that worked for long and then lost its
            # connection must not give up at once (a watch that times out is not an outage)
            answer = self._retrying(f"watch {what}", poll)
            if isinstance(answer, WaitResult):
                return answer
            gone, modified = answer
            if gone:
                return WaitResult.GONE
            wait_index = modified + 1

    def delete_entry(self, entry: Entry) -> bool:
        return self._retrying(f"delete {entry.key}", lambda: self._delete_entry(entry))

    def _delete_entry(self, entry: Entry) -> bool:
        """One guarded delete of ``entry``: False if it was gone, or is not ours any more.

        Guarded by index, not by value: ``prevValue`` goes in the URL, which etcd reads only up to
        4 KB, so an entry with more data could never be deleted (its next holder waited the TTL).
        The key's name is its ``createdIndex``, which no other entry ever has; ``prevIndex`` is its
        ``modifiedIndex``, which each renewal moves on: the one the last renewal here saw (the
        creation's, before one), else read, with the value checked, then deleted if still unchanged.
        """
        index = self._modified.get(entry.key, entry.token)
        for attempt in range(2):  # a second read only if a renewal elsewhere moved the index in between
            try:
                self._request("DELETE", entry.key, {"prevIndex": index})
            except _Failure as exc:
                if exc.code == _NOT_FOUND:
                    self._modified.pop(entry.key, None)
                    return False
                if exc.code != _COMPARE_FAILED or attempt:
                    raise
            else:
                self._modified.pop(entry.key, None)
                return True
            try:
                body, _ = self._request("GET", entry.key, {"quorum": "true"})
            except _Failure as exc:
                if exc.code == _NOT_FOUND:
                    return False
                raise
            node = body["node"]
            if node.get("value") != entry.raw or int(node["createdIndex"]) != entry.token:
                return False  # written over (not by this package): not ours to delete
            index = int(node["modifiedIndex"])
        return False  # pragma: no cover - the loop returns or raises

    def _delete(self, key: str, guard: dict[str, Any]) -> bool:
        """DELETE ``key`` if ``guard`` (prevValue / prevIndex) still holds; False if it was gone or changed."""

        def delete() -> bool:
            try:
                self._request("DELETE", key, guard)
            except _Failure as exc:
                if exc.code in (_NOT_FOUND, _COMPARE_FAILED):
                    return False
                raise
            return True

        return self._retrying(f"delete {key}", delete)

    def forget_queue(self, queue: str) -> None:
        try:
            self._request("DELETE", queue, {"dir": "true"})
        except (_Failure, retry.Transient, BackendError) as exc:
            logger.debug("kept queue directory %s: %s", queue, exc)

    def list_queues(self, namespace: str) -> dict[str, list[Entry]]:
        def read() -> dict[str, list[Entry]]:
            try:
                body, _ = self._request("GET", namespace, {"recursive": "true", "sorted": "true"})
            except _Failure as exc:
                if exc.code == _NOT_FOUND:
                    return {}
                raise
            return {
                self._relative(child["key"]): entries
                for child in body["node"].get("nodes", ())
                if child.get("dir") and (entries := self._entries(child))
            }

        return self._retrying(f"list {namespace}", read)

    # -- records ------------------------------------------------------------

    def _record(self, node: dict[str, Any]) -> Record:
        ttl = node.get("ttl")
        return Record(self._relative(node["key"]), decode_json(node.get("value")), int(node["modifiedIndex"]), ttl)

    def get_record(self, key: str) -> Record | None:
        def get() -> Record | None:
            try:
                body, _ = self._request("GET", key, {"quorum": "true"})
            except _Failure as exc:
                if exc.code == _NOT_FOUND:
                    return None
                raise
            return None if body["node"].get("dir") else self._record(body["node"])

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
        # v2 cannot compare the fence key in the same write: callers make the record its own fence
        params: dict[str, Any] = {"value": encode_json(value)}
        if ttl is not None:
            params["ttl"] = server_ttl(ttl)
        if expect is None:
            params["prevExist"] = "false"
        else:
            params["prevIndex"] = expect.version

        attempts = 0

        def put() -> Record | None:
            nonlocal attempts
            attempts += 1
            try:
                body, _ = self._request("PUT", key, params)
            except _Failure as exc:
                if exc.code not in (_COMPARE_FAILED, _ALREADY_EXISTS, _NOT_FOUND, _NOT_A_FILE):
                    raise
                if attempts > 1:  # a lost first attempt may have been applied: our value there is a success
                    current = self.get_record(key)
                    if current is not None and encode_json(current.value) == params["value"]:
                        return current
                return None
            return self._record(body["node"])

        return self._retrying(f"write {key}", put)

    def delete_record(self, key: str, expect: Record | None = None) -> bool:
        return self._delete(key, {"prevIndex": expect.version} if expect is not None else {})

    def read_records(self, prefix: str) -> RecordSet:
        """One recursive, linearizable read of the prefix's directory; its X-Etcd-Index is the revision."""

        def read() -> RecordSet:
            try:
                body, index = self._request("GET", prefix, {"recursive": "true", "quorum": "true"})
            except _Failure as exc:
                if exc.code == _NOT_FOUND:
                    return RecordSet({}, int(exc.payload.get("index", 0)))
                raise
            records: dict[str, Record] = {}
            nodes = list(body["node"].get("nodes", ()))
            while nodes:
                node = nodes.pop()
                if node.get("dir"):
                    nodes.extend(node.get("nodes", ()))
                else:
                    record = self._record(node)
                    records[record.key] = record
            return RecordSet(records, index)

        return self._retrying(f"read records {prefix}", read)

    def watch_records(self, prefix: str, after_revision: int, timeout: float) -> list[RecordChange] | WaitResult:
        """A recursive watch of the prefix's directory from ``after_revision + 1``: one event per answer (v2)."""
        deadline = time.monotonic() + max(0.0, timeout)

        def poll() -> list[RecordChange] | WaitResult | int:
            params = {"wait": "true", "recursive": "true", "waitIndex": after_revision + 1}
            body = self._next_event(prefix, params, deadline)
            if isinstance(body, WaitResult):
                return body
            node = body["node"]
            key, revision = self._relative(node["key"]), int(node["modifiedIndex"])
            gone = body.get("action") in _GONE_ACTIONS
            if node.get("dir"):
                # a directory deleted takes its records with it, in one event: read again; one made: nothing
                return WaitResult.STALE if gone else revision
            return [RecordChange(key, None if gone else self._record(node), revision)]

        while True:
            changes = self._retrying(f"watch records {prefix}", poll)
            if not isinstance(changes, int):
                return changes
            after_revision = changes  # a directory made: no record changed; watch on after it

    # -- process life -------------------------------------------------------

    def after_fork(self) -> None:
        self._endpoints.after_fork()
        self._cluster_ids = [None] * len(self.endpoints)

    def close(self) -> None:
        self._endpoints.close()
        self._cluster_ids = [None] * len(self.endpoints)
