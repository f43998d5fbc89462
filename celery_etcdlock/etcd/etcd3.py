"""The etcd v3 API (``etcd3://`` and ``etcd3s://``), over its JSON gateway (``gateway.py``).

A queue is a key prefix; an entry is the key ``<queue>/<lease hex>.<nonce>``,
attached to the session's lease and put by a transaction only if it does not
exist yet (the nonce: two acquisitions under one lease get two keys). Its
token is its ``create_revision``. As in etcd's ``concurrency.Mutex``, a
queue is read in one range sorted by create revision, and a waiter watches
the one key it waits for, for DELETE (from now, then checks the key still
exists: see ``wait_gone``). A
record is a plain key, written by a transaction that compares its mod
revision and, when fenced, the fence entry's create revision.

    backend = Etcd3Backend(parse_url("etcd3://127.0.0.1:2379"))   # no network I/O yet
    lease = backend.grant(10)
    entry, snapshot = backend.join_queue("locks/x", {"mode": "write"}, lease)
    snapshot.entries[0] == entry                                   # the oldest: acquired

What each operation costs, in requests:

- ``grant``, ``revoke``, ``read_queue``: 1.
- ``join_queue``: 1 transaction, which creates the entry (put if absent) and
  reads the queue.
- ``list_queues``: 1 range, plus 1 per distinct lease of the entries found
  (its time to live: what each entry has left).
- ``delete_entry``: 1 transaction (delete if the create revision is ours).
- ``wait_gone``: 1 streaming watch until the event or the timeout, and 1
  range once the watch exists.
- ``keep_alive``: 3 whatever the number of entries: the lease's keep-alive,
  a linearizable read that confirms it (see ``keep_alive``), then the
  listing of the lease's keys, which notices an entry deleted behind its
  holder's back (``celery etcdlock release``, an operator). 2 when no
  entries ride on the lease, 1 when the lease is gone.
- ``put_record``: 1 transaction; with a ``ttl``, 1 more before it (a lease of
  the record's own, so that it outlives its writer), and 1 after it to
  revoke that lease if the compare failed, or the lease of a record with a
  ``ttl`` that it replaced.
- ``delete_record``: 1; and 1 more for a record with a ``ttl``, to revoke
  its lease (or leases would pile up until they expire).
- ``get_record``: 1 range, plus 1 per record that expires
  (its lease's time to live).

Add ``auth/authenticate`` for the first request and after a token is
rejected, and the cost again for each retry of a transient failure.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from contextlib import closing
from typing import Any, TypeVar

from ..errors import BackendError
from ..options import ConnectionOptions
from . import retry
from .base import (
    Backend,
    Entry,
    Lease,
    LeaseExpired,
    NumberedLease,
    Record,
    RecordChange,
    RecordSet,
    Snapshot,
    WaitResult,
    decode_json,
    encode_json,
    server_ttl,
)
from .gateway import NOT_FOUND, Failure, Gateway, WatchCancelled, b64, prefix_end, unb64

logger = logging.getLogger(__name__)
T = TypeVar("T")


class V3Lease(NumberedLease):
    """One etcd lease."""


# -- request bodies (keys base64-encoded, as the gateway wants them) ----------------------------


def _range_request(key: str, prefix: bool = False) -> dict[str, Any]:
    """``key``, or with ``prefix`` every key under it, oldest first."""
    body: dict[str, Any] = {"key": b64(key)}
    if prefix:
        body.update(range_end=prefix_end(key), sort_order="ASCEND", sort_target="CREATE")
    return body


def _created_at(key: str, revision: int) -> dict[str, Any]:
    """Compare: ``key`` was created at ``revision`` (0: it does not exist)."""
    return {"key": key, "target": "CREATE", "result": "EQUAL", "create_revision": str(revision)}


def _modified_at(key: str, revision: int) -> dict[str, Any]:
    return {"key": key, "target": "MOD", "result": "EQUAL", "mod_revision": str(revision)}


def _put(key: str, raw: str, lease: V3Lease | None = None, prev_kv: bool = False) -> dict[str, Any]:
    put: dict[str, Any] = {"key": key, "value": b64(raw)}
    if lease is not None:
        put["lease"] = str(lease.lease_id)
    if prev_kv:
        put["prev_kv"] = True
    return {"request_put": put}


def _leases_of(kvs: Any) -> list[str]:
    """The leases (ids as the gateway writes them) that the key-values ``kvs`` were attached to."""
    return [kv["lease"] for kv in kvs if kv and kv.get("lease") and kv["lease"] != "0"]


class Etcd3Backend(Backend):
    def __init__(self, options: ConnectionOptions, *, native: bool = False) -> None:
        self.options = options
        self.prefix = options.prefix
        self.endpoints = options.endpoint_urls
        self.gateway = Gateway(options, native=native)  # the HTTP transport (tests reach it here too)

    def native_twin(self) -> Etcd3Backend:
        return Etcd3Backend(self.options, native=True)

    # -- keys and requests --------------------------------------------------

    def _full(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    def _relative(self, key: str) -> str:
        return key[len(self.prefix) + 1 :]

    def _retrying(self, operation: str, fn: Callable[[], T]) -> T:
        try:
            return retry.call(self.options.retry_max_delay, operation, self.gateway.guarded(fn), self.endpoints)
        except Failure as exc:
            raise BackendError(f"etcd {operation} failed: {exc}") from None

    def _txn(
        self, compare: list[dict[str, Any]], success: list[dict[str, Any]], failure: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        return self.gateway.post("kv/txn", {"compare": compare, "success": success, "failure": failure or []})

    def _range(self, key: str, prefix: bool = False) -> dict[str, Any]:
        return self.gateway.post("kv/range", _range_request(key, prefix))

    def _entry(self, kv: dict[str, Any], ttl: float | None = None) -> Entry:
        raw = unb64(kv.get("value", ""))
        return Entry(self._relative(unb64(kv["key"])), int(kv["create_revision"]), raw, ttl)

    def _queue_entries(self, queue: str, kvs: list[dict[str, Any]]) -> list[Entry]:
        """The entries of ``queue`` among the key-values of a range over it: exactly one level under it.

        A range over ``<prefix>/<queue>/`` also holds the keys of a client whose prefix nests in ours
        (``/app`` and ``/app/locks``: its ``locks/x/...`` is under our lock named ``locks``); they are not ours.
        """
        entries = [self._entry(kv) for kv in kvs]
        start = len(queue) + 1
        return [entry for entry in entries if "/" not in entry.key[start:]]

    # -- leases -------------------------------------------------------------

    def grant(self, ttl: float) -> Lease:
        # etcd may grant more than asked (its minimum TTL); the clocks run on what was asked, the safe side
        wanted = server_ttl(ttl)

        def grant() -> Lease:
            answer = self.gateway.post("lease/grant", {"TTL": wanted})
            return V3Lease(int(answer["ID"]), ttl, wanted)

        return self._retrying(f"grant a {wanted}s lease", grant)

    def keep_alive(self, lease: Lease, entries: list[Entry], timeout: float) -> set[str]:
        return self.gateway.guarded(lambda: self._keep_alive(lease, entries, timeout))()

    def _keep_alive(self, lease: Lease, entries: list[Entry], timeout: float) -> set[str]:
        """Renew the lease, confirm the renewal, then list the keys it still carries.

        A single attempt: the session retries. A raft leader renews a lease alone, from its own
        lessor, without asking the other members. One cut off from them, or frozen and resumed,
        still takes itself for the leader for a moment, and its "renewed" may be false: the real
        leader never heard of it and expires the lease on time (etcd-io/etcd#15247, fixed in
        etcd 3.5.13 and 3.4.31). So a renewal counts only once a linearizable read (which a
        leader answers only after a quorum confirmed it leads) is answered in the same raft term:
        the leader of that term, the one that renewed, really led.
        """
        lease = self._own(lease)
        deadline = time.monotonic() + max(0.05, timeout)
        try:
            answer = self.gateway.post("lease/keepalive", {"ID": str(lease.lease_id)}, timeout=max(0.05, timeout))
        except Failure as exc:
            raise BackendError(f"etcd keep-alive of lease {lease.id} failed: {exc}") from None
        result = answer.get("result", {})
        if int(result.get("TTL", 0)) <= 0:
            lease.expired = True
            return {entry.key for entry in entries}
        self._confirm_term(lease, _raft_term(result), deadline)
        if not entries:
            return set()
        try:
            answer = self.gateway.post(
                "kv/lease/timetolive",
                {"ID": str(lease.lease_id), "keys": True},
                timeout=max(0.05, deadline - time.monotonic()),
            )
        except (retry.Transient, Failure, BackendError) as exc:  # the renewal stands: a listing only advises
            logger.debug("lease %s renewed, but listing its keys failed (%s): checked next time", lease.id, exc)
            return set()
        if int(answer.get("TTL", -1)) <= 0:
            lease.expired = True
            return {entry.key for entry in entries}
        alive = {self._relative(unb64(key)) for key in answer.get("keys", ())}
        lease.keys = alive
        return {entry.key for entry in entries if entry.key not in alive}

    def _confirm_term(self, lease: V3Lease, renewed_in: int, deadline: float) -> None:
        try:
            answer = self.gateway.post(
                "kv/range",
                {"key": b64(self._full(_TERM_PROBE)), "count_only": True},  # linearizable: no "serializable"
                timeout=max(0.05, deadline - time.monotonic()),
            )
        except Failure as exc:
            raise BackendError(f"etcd keep-alive of lease {lease.id}: the confirming read failed: {exc}") from None
        confirmed_in = _raft_term(answer)
        if not renewed_in or confirmed_in != renewed_in:
            # a leader changed in between, or the renewing member no longer leads: the renewal may be void
            raise retry.Transient(
                self.gateway.endpoints[self.gateway.current],
                f"lease {lease.id} was renewed in raft term {renewed_in}, but etcd is in term {confirmed_in}",
            )

    def delete_stray(self, lease: Lease, key: str) -> None:
        lease = self._own(lease)
        full = b64(self._full(key))
        # only while it still rides on our lease: the key's name is ours (lease id and nonce), and so is the key
        compare = [{"key": full, "target": "LEASE", "result": "EQUAL", "lease": str(lease.lease_id)}]
        self._retrying(f"delete stray {key}", lambda: self._txn(compare, [{"request_delete_range": {"key": full}}]))

    def revoke(self, lease: Lease, entries: list[Entry]) -> None:
        lease = self._own(lease)
        lease.expired = True
        try:
            self.gateway.post("kv/lease/revoke", {"ID": str(lease.lease_id)})
        except Failure as exc:
            if exc.code != NOT_FOUND:
                raise BackendError(f"etcd revoke of lease {lease.id} failed: {exc}") from None
        except retry.Transient as exc:
            raise BackendError(f"etcd revoke of lease {lease.id} failed: {exc}") from None

    def _forget_lease(self, lease_id: int) -> None:
        """Revoke a lease nothing needs any more, once: if that fails, it expires by itself."""
        try:
            self.gateway.post("kv/lease/revoke", {"ID": str(lease_id)})
        except (retry.Transient, BackendError, Failure) as exc:
            logger.debug("could not revoke unused lease %x (%s); it expires by itself", lease_id, exc)

    @staticmethod
    def _own(lease: Lease) -> V3Lease:
        if not isinstance(lease, V3Lease):
            raise TypeError(f"the etcd v3 backend needs one of its own leases, not {lease!r}")
        return lease

    def _live(self, lease: Lease) -> V3Lease:
        lease = self._own(lease)
        if lease.expired:
            raise LeaseExpired(f"lease {lease.id} has expired")
        return lease

    def _txn_with(
        self,
        lease: V3Lease,
        compare: list[dict[str, Any]],
        success: list[dict[str, Any]],
        failure: list[dict[str, Any]],
    ) -> dict[str, Any]:
        """A transaction that puts with ``lease``: ``LeaseExpired`` if etcd no longer knows the lease."""
        try:
            return self._txn(compare, success, failure)
        except Failure as exc:
            if exc.code == NOT_FOUND and "lease not found" in str(exc):
                lease.expired = True
                raise LeaseExpired(f"lease {lease.id} has expired") from None
            raise

    # -- queues -------------------------------------------------------------

    @staticmethod
    def _new_key(queue: str, lease: V3Lease) -> str:
        return f"{queue}/{lease.id}.{secrets.token_hex(8)}"  # the nonce: no two acquisitions share a key

    def join_queue(self, queue: str, value: dict[str, Any], lease: Lease) -> tuple[Entry, Snapshot]:
        """One transaction: create my key and read the whole queue, which already includes it."""
        lease = self._live(lease)
        key, raw = self._new_key(queue, lease), encode_json(value)
        full = b64(self._full(key))
        read_queue = {"request_range": _range_request(self._full(queue) + "/", prefix=True)}

        def join() -> tuple[Entry, Snapshot]:
            answer = self._txn_with(lease, [_created_at(full, 0)], [_put(full, raw, lease), read_queue], [read_queue])
            kvs = answer["responses"][-1]["response_range"].get("kvs", [])
            snapshot = Snapshot(self._queue_entries(queue, kvs), int(answer["header"]["revision"]))
            mine = next((e for e in snapshot.entries if e.key == key), None)
            # a retry whose first attempt was applied finds the unique key there with our value
            if mine is None or mine.raw != raw:
                raise Failure(None, f"{key} was not created")
            return mine, snapshot

        return self._retrying(f"join queue {queue}", join)

    def join_queue_if_empty(self, queue: str, value: dict[str, Any], lease: Lease) -> tuple[Entry | None, Snapshot]:
        """One transaction: if no key is under the queue, create mine; either way, read the queue."""
        lease = self._live(lease)
        key, raw = self._new_key(queue, lease), encode_json(value)
        full = b64(self._full(key))
        start = self._full(queue) + "/"
        # a compare over a range holds for an empty range: "no key in the queue was ever created"
        empty = {"key": b64(start), "range_end": prefix_end(start), "target": "CREATE", "result": "EQUAL",
                 "create_revision": "0"}  # fmt: skip
        read_queue = {"request_range": _range_request(start, prefix=True)}

        def join() -> tuple[Entry | None, Snapshot, bool]:
            answer = self._txn_with(lease, [empty], [_put(full, raw, lease), read_queue], [read_queue])
            kvs = answer["responses"][-1]["response_range"].get("kvs", [])
            snapshot = Snapshot(self._queue_entries(queue, kvs), int(answer["header"]["revision"]))
            mine = next((e for e in snapshot.entries if e.key == key), None)
            if mine is not None and mine.raw == raw:
                return mine, snapshot, False  # created now, or by a retried attempt that had landed
            return None, snapshot, bool(kvs) and not snapshot.entries

        created, snapshot, only_nested = self._retrying(f"join queue {queue} if empty", join)
        if not only_nested:
            return created, snapshot
        # The compare saw keys, but none of this queue's own: another client's, whose prefix nests in ours (say
        # /app/locks under /app). A compare cannot tell them apart, so join, and keep the entry only if it is first.
        entry, snapshot = self.join_queue(queue, value, lease)
        if snapshot.entries[0].key == entry.key:
            return entry, snapshot
        self.delete_entry(entry)
        return None, Snapshot([e for e in snapshot.entries if e.key != entry.key], snapshot.revision)

    def read_queue(self, queue: str, fresh: bool = False) -> Snapshot:
        # v3 ranges are linearizable unless asked to be serializable: every read is fresh

        def read() -> Snapshot:
            answer = self._range(self._full(queue) + "/", prefix=True)
            return Snapshot(self._queue_entries(queue, answer.get("kvs", [])), int(answer["header"]["revision"]))

        return self._retrying(f"read queue {queue}", read)

    def wait_any_gone(self, entries: list[Entry], after_revision: int, timeout: float) -> WaitResult:
        # A watch from a past revision that has writes after it is served from etcd's "unsynced" set,
        # which is checked only every 100 ms: under contention every handoff would wait for it. A watch
        # from now is synced. So watch from now, and once every watch exists, read the keys: a delete that
        # came before the watch shows as an absent key, one after it as an event. Nothing is missed, and
        # after_revision is not needed (nor can it be compacted away). All keys share one stream.
        deadline = time.monotonic() + timeout
        what = entries[0].key if len(entries) == 1 else f"{len(entries)} keys of {entries[0].key.rsplit('/', 1)[0]}"
        watch = self.gateway.watch(
            [{"key": b64(self._full(entry.key)), "filters": ["NOPUT"]} for entry in entries], deadline, what
        )

        def wait() -> WaitResult | None:
            if time.monotonic() >= deadline:
                return WaitResult.TIMEOUT
            created = 0
            try:
                with closing(watch.results()) as results:
                    for result in results:
                        if result.get("created"):
                            created += 1
                            if created == len(entries) and not self._all_exist(entries):
                                return WaitResult.GONE
                        if any(event.get("type") == "DELETE" for event in result.get("events", ())):
                            return WaitResult.GONE
            except WatchCancelled as exc:
                logger.debug("watch of %s ended (%s): reading again", what, exc)
                return WaitResult.STALE
            except retry.Transient as exc:
                if not created:
                    raise
                logger.debug("watch of %s was cut (%s): watching again", what, exc)
                return None
            return WaitResult.TIMEOUT

        # The retry budget counts from a call's start: a watch that worked for longer than the budget and
        # then lost its connection starts a new one, or a long wait would give up at its first failure.
        while (result := self._retrying(f"watch {what}", wait)) is None:
            pass
        return result

    def _all_exist(self, entries: list[Entry]) -> bool:
        """Whether every one of ``entries`` (these very keys, not namesakes created later) still exists."""
        if len(entries) == 1:
            kvs = self._range(self._full(entries[0].key)).get("kvs", [])
        else:  # one read of their queue, keys only
            queue = self._full(entries[0].key.rsplit("/", 1)[0]) + "/"
            request = {**_range_request(queue, prefix=True), "keys_only": True}
            kvs = self.gateway.post("kv/range", request).get("kvs", [])
        alive = {(self._relative(unb64(kv["key"])), int(kv["create_revision"])) for kv in kvs}
        return all((entry.key, entry.token) in alive for entry in entries)

    def delete_entry(self, entry: Entry) -> bool:
        full = b64(self._full(entry.key))

        def delete() -> bool:
            answer = self._txn([_created_at(full, entry.token)], [{"request_delete_range": {"key": full}}])
            return bool(answer.get("succeeded"))

        return self._retrying(f"delete {entry.key}", delete)

    def list_queues(self, namespace: str) -> dict[str, list[Entry]]:
        """Each queue under ``namespace``, its entries with the seconds their lease has left (one request a lease)."""

        def read() -> dict[str, list[Entry]]:
            answer = self._range(self._full(namespace) + "/", prefix=True)
            queued: list[tuple[str, dict[str, Any]]] = []
            for kv in answer.get("kvs", []):  # sorted by create revision, so each queue is too
                rest = self._relative(unb64(kv["key"]))[len(namespace) + 1 :].split("/")
                if len(rest) == 2:
                    queued.append((f"{namespace}/{rest[0]}", kv))
            ttls = {lease_id: self._ttl_left(lease_id) for lease_id in set(_leases_of(kv for _, kv in queued))}
            queues: dict[str, list[Entry]] = {}
            for queue, kv in queued:
                queues.setdefault(queue, []).append(self._entry(kv, ttls.get(kv.get("lease", "0"))))
            return queues

        return self._retrying(f"list {namespace}", read)

    def _ttl_left(self, lease_id: str) -> float:
        """The seconds lease ``lease_id`` has left (0 once it expired)."""
        left = int(self.gateway.post("kv/lease/timetolive", {"ID": lease_id}).get("TTL", -1))
        return float(max(0, left))

    # -- records ------------------------------------------------------------

    def _record(self, kv: dict[str, Any]) -> Record:
        lease_id = kv.get("lease")
        ttl = self._ttl_left(lease_id) if lease_id else None  # one more request, for records that expire
        return Record(
            self._relative(unb64(kv["key"])), decode_json(unb64(kv.get("value", ""))), int(kv["mod_revision"]), ttl
        )

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
        full = b64(self._full(key))
        raw = encode_json(value)
        compare = [_created_at(full, 0) if expect is None else _modified_at(full, expect.version)]
        if fence is not None:  # a deposed holder's write must fail: its key is gone or re-created
            compare.append(_created_at(b64(self._full(fence.key)), fence.token))
        lease: V3Lease | None = None
        if ttl is not None:
            lease = self._own(self.grant(ttl))  # a lease of its own: the record outlives its writer
        attempts = 0
        replaced: list[str] = []  # the lease of the record written over

        def write() -> Record | None:
            nonlocal attempts
            attempts += 1
            answer = self._txn(compare, [_put(full, raw, lease, prev_kv=True)], [{"request_range": {"key": full}}])
            if answer.get("succeeded"):
                replaced.extend(_leases_of([answer["responses"][0]["response_put"].get("prev_kv")]))
                return Record(key, value, int(answer["header"]["revision"]), ttl)
            kvs = answer["responses"][0]["response_range"].get("kvs", [])
            if (
                attempts > 1
                and kvs
                and unb64(kvs[0].get("value", "")) == raw
                and int(kvs[0].get("lease", 0)) == (lease.lease_id if lease else 0)
            ):
                return Record(key, value, int(kvs[0]["mod_revision"]), ttl)  # our lost first attempt
            return None

        record = self._retrying(f"write {key}", write)
        if record is None and lease is not None:
            self._forget_lease(lease.lease_id)
        for lease_id in replaced:
            if lease is None or int(lease_id) != lease.lease_id:
                self._forget_lease(int(lease_id))  # it carried only the old record
        return record

    def delete_record(self, key: str, expect: Record | None = None) -> bool:
        """Delete ``key`` (guarded by ``expect``), then revoke the record's own lease if it had one."""
        full = b64(self._full(key))
        delete_request = {"key": full, "prev_kv": True}
        leases: list[str] = []

        def delete() -> bool:
            if expect is None:
                answer = self.gateway.post("kv/deleterange", delete_request)
            else:
                answer = self._txn([_modified_at(full, expect.version)], [{"request_delete_range": delete_request}])
                if not answer.get("succeeded"):
                    return False
                answer = answer["responses"][0]["response_delete_range"]
            leases[:] = _leases_of(answer.get("prev_kvs", ()))
            return int(answer.get("deleted", 0)) > 0

        deleted = self._retrying(f"delete {key}", delete)
        for lease_id in leases:  # put_record's lease of its own, which nothing else rides on
            self._forget_lease(int(lease_id))
        return deleted

    def read_records(self, prefix: str) -> RecordSet:
        """One range over the prefix (records with a ``ttl`` read as ``ttl=None`` here: no request per lease)."""
        start = self._full(prefix) + "/"

        def read() -> RecordSet:
            answer = self.gateway.post("kv/range", {"key": b64(start), "range_end": prefix_end(start)})
            records = {}
            for kv in answer.get("kvs", []):
                key = self._relative(unb64(kv["key"]))
                records[key] = Record(key, decode_json(unb64(kv.get("value", ""))), int(kv["mod_revision"]))
            return RecordSet(records, int(answer["header"]["revision"]))

        return self._retrying(f"read records {prefix}", read)

    def watch_records(self, prefix: str, after_revision: int, timeout: float) -> list[RecordChange] | WaitResult:
        """One streaming watch of the prefix from ``after_revision + 1``, until its first events or the timeout."""
        deadline = time.monotonic() + max(0.0, timeout)
        start = self._full(prefix) + "/"
        request = {"key": b64(start), "range_end": prefix_end(start), "start_revision": str(after_revision + 1)}
        watch = self.gateway.watch([request], deadline, f"records {prefix}")

        def wait() -> list[RecordChange] | WaitResult:
            if time.monotonic() >= deadline:
                return WaitResult.TIMEOUT
            try:
                with closing(watch.results()) as results:
                    for result in results:
                        changes = [self._change(event) for event in result.get("events", ())]
                        if changes:
                            return changes
            except WatchCancelled as exc:
                logger.debug("watch of records %s ended (%s): reading again", prefix, exc)
                return WaitResult.STALE
            return WaitResult.TIMEOUT

        # nothing is returned before the first events, so a watch cut before them starts again from the same revision
        return self._retrying(f"watch records {prefix}", wait)

    def _change(self, event: dict[str, Any]) -> RecordChange:
        kv = event["kv"]
        key, revision = self._relative(unb64(kv["key"])), int(kv["mod_revision"])
        if event.get("type") == "DELETE":
            return RecordChange(key, None, revision)
        return RecordChange(key, Record(key, decode_json(unb64(kv.get("value", ""))), revision), revision)

    # -- process life -------------------------------------------------------

    def after_fork(self) -> None:
        self.gateway.after_fork()

    def close(self) -> None:
        self.gateway.close()


#: a key nobody writes, read (counted, not fetched) to confirm a renewal: see ``Etcd3Backend.keep_alive``
_TERM_PROBE = "renewal-term-probe"


def _raft_term(answer: dict[str, Any]) -> int:
    """The raft term in an answer's header (0 when absent)."""
    header = answer.get("header")
    return int(header.get("raft_term") or 0) if isinstance(header, dict) else 0
