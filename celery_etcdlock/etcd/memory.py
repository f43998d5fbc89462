"""``memory://``: an in-process stand-in for etcd v3, for tests.

    client = connect("memory://")              # the process's default namespace
    client = connect("memory://unit-1")        # a namespace of its own: nothing shared with any other
    with Mutex(client, "reports", ttl=5) as lock:
        lock.token                             # a revision, as on etcd

It keeps what the primitives rely on, with etcd v3's semantics, so that a
test on memory:// means what it would mean on etcd (the same contract
tests run on both):

- one revision counter per namespace, raised by every write; an entry's
  token is its create revision, so tokens only grow and a queue is FIFO;
- leases with a TTL on a real clock: an entry rides on its session's lease
  and goes when the lease is not kept alive in time, so a holder that stops
  renewing loses its lock after its TTL, and a waiter blocked on it wakes;
- waits that wake on the delete or expiry of the very entries waited for,
  and nothing else;
- records written by compare-and-swap on their version, fenced by an entry
  that must still exist with its token, and records with a TTL of their own.

Thread-safe: one lock per namespace; a wait sleeps on a condition of its
own, which a delete or expiry of one of its entries notifies.

What it does not model: other processes (a namespace lives in the process
that made it), a server that fails, is slow or restarts, auth and TLS, and
etcd's rounding of TTLs to its minimum. A forked child must not use a
namespace it inherited: its copy would silently part from the parent's, so
its first operation raises ``InvalidUse`` instead. For prefork workers, use
a real etcd (the ``etcd_server`` fixture of ``celery_etcdlock.testing``).
"""

from __future__ import annotations

import collections
import itertools
import os
import random
import threading
from dataclasses import dataclass, field
from typing import Any

from .. import clock
from ..errors import InvalidUse
from ..options import ConnectionOptions
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


class MemoryLease(NumberedLease):
    """A lease of a memory namespace."""


@dataclass
class _Key:
    """One stored key: a queue entry (on a lease) or a record (maybe with an expiry of its own)."""

    key: str  # full key, with the prefix
    raw: str  # the stored JSON text
    created: int  # create revision
    modified: int  # mod revision
    lease: int | None = None
    expires_at: float | None = None  # records with a TTL
    entry: Entry | None = None  # as a queue read shows it: made once, it is read at every turn of every waiter


@dataclass
class _LeaseState:
    ttl: int
    expires_at: float
    keys: set[str] = field(default_factory=set)


class _Watch:
    """One waiting call: notified when one of the keys it waits for goes."""

    def __init__(self, lock: threading.Lock) -> None:
        self.condition = threading.Condition(lock)
        self.fired = False


class _Namespace:
    """The "server" of one ``memory://NAME``: keys, leases, revisions. Every method wants ``lock`` held."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.revision = 1  # as a fresh etcd: the first write is revision 2
        self.keys: dict[str, _Key] = {}
        self.children: dict[str, dict[str, _Key]] = {}  # parent -> its keys, in creation order
        self.leases: dict[int, _LeaseState] = {}
        self.expiring: dict[str, float] = {}  # records with an expiry of their own -> when
        self.watches: dict[str, set[_Watch]] = {}
        self.next_expiry = float("inf")  # no lease or record expires before this (it may be earlier than needed)
        # lease ids as etcd's: not in order, so that nothing comes to rely on an order they do not have
        self.lease_ids = itertools.count(random.randrange(1 << 40, 1 << 60))
        self.nonces = itertools.count(random.randrange(1 << 32))  # the entry keys' nonces
        # the latest changes, for watches of records from a past revision (etcd keeps its history until compacted)
        self.history: collections.deque[tuple[int, str, _Key | None]] = collections.deque(maxlen=HISTORY)
        self.forgotten = 0  # the revision of the latest change no longer in the history
        self.changed = threading.Condition(self.lock)  # notified on every change while record_watches > 0
        self.record_watches = 0

    def __enter__(self) -> _Namespace:
        """Hold the namespace, with what expired by now gone."""
        self.lock.acquire()
        try:
            self.expire(clock.now())
        except BaseException:
            self.lock.release()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.lock.release()

    # -- time

    def expire(self, now: float) -> None:
        """Delete what expired by ``now``: each lease's keys at one revision, as etcd revokes a lease."""
        if now < self.next_expiry:
            return
        for lease_id, lease in list(self.leases.items()):
            if lease.expires_at <= now:
                self.drop_lease(lease_id)
        for key in [key for key, when in self.expiring.items() if when <= now]:
            self.delete(self.keys[key])
        expiries = [lease.expires_at for lease in self.leases.values()] + list(self.expiring.values())
        self.next_expiry = min(expiries, default=float("inf"))

    def expires(self, when: float) -> None:
        self.next_expiry = min(self.next_expiry, when)

    # -- keys

    def put(self, key: str, raw: str, *, lease: int | None = None, expires_at: float | None = None) -> _Key:
        self.revision += 1
        old = self.keys.get(key)
        if old is not None:
            self.unlink(old)  # a put over a key keeps its create revision, as in etcd
            created = old.created
        else:
            created = self.revision
        kv = _Key(key, raw, created, self.revision, lease, expires_at)
        self.keys[key] = kv
        self.children.setdefault(key.rsplit("/", 1)[0], {})[key] = kv
        if lease is not None:
            self.leases[lease].keys.add(key)
        if expires_at is not None:
            self.expiring[key] = expires_at
            self.expires(expires_at)
        self.remember(key, kv)
        return kv

    def remember(self, key: str, kv: _Key | None) -> None:
        if len(self.history) == self.history.maxlen:
            self.forgotten = self.history[0][0]
        self.history.append((self.revision, key, kv))
        if self.record_watches:
            self.changed.notify_all()

    def delete(self, kv: _Key) -> None:
        self.revision += 1
        self.remove(kv)

    def remove(self, kv: _Key) -> None:
        """Take ``kv`` away (at the current revision) and wake whoever waits for it."""
        self.unlink(kv)
        self.remember(kv.key, None)
        for watch in self.watches.pop(kv.key, ()):
            watch.fired = True
            watch.condition.notify()

    def unlink(self, kv: _Key) -> None:
        del self.keys[kv.key]
        parent = kv.key.rsplit("/", 1)[0]
        siblings = self.children[parent]
        del siblings[kv.key]
        if not siblings:
            del self.children[parent]
        if kv.lease is not None and kv.lease in self.leases:
            self.leases[kv.lease].keys.discard(kv.key)
        self.expiring.pop(kv.key, None)

    def find(self, key: str, created: int) -> _Key | None:
        """``key``, if it is still the one created at revision ``created``."""
        kv = self.keys.get(key)
        return kv if kv is not None and kv.created == created else None

    def drop_lease(self, lease_id: int) -> None:
        lease = self.leases.pop(lease_id)
        if lease.keys:
            self.revision += 1
            for key in list(lease.keys):
                self.remove(self.keys[key])


#: changes a namespace remembers for watches from a past revision (v2 keeps 1000 events)
HISTORY = 1000


def _created(kv: _Key) -> int:
    return kv.created


_namespaces: dict[str, _Namespace] = {}
_namespaces_lock = threading.Lock()


def _namespace(name: str) -> _Namespace:
    with _namespaces_lock:
        namespace = _namespaces.get(name)
        if namespace is None:
            namespace = _namespaces[name] = _Namespace(name)
        return namespace


def _forget_namespaces_after_fork() -> None:
    # the child may not use the parent's namespaces (see _check_process); a lock another thread held at the
    # fork would be held for ever in the child, so this one is new
    global _namespaces_lock
    _namespaces_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_namespaces_after_fork)


class MemoryBackend(Backend):
    def __init__(self, options: ConnectionOptions) -> None:
        self.options = options
        self.prefix = options.prefix
        self.endpoints = options.endpoint_urls
        self.namespace = options.namespace
        self._pid = os.getpid()
        self._store = _namespace(options.namespace)

    # -- keys and the namespace ---------------------------------------------

    def _full(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    def _relative(self, key: str) -> str:
        return key[len(self.prefix) + 1 :]

    def _check_process(self) -> None:
        """Refuse to work in a process that did not create the namespace (a forked child)."""
        pid = os.getpid()
        if pid != self._pid or pid != self._store.pid:
            created = self._store.pid if pid == self._pid else self._pid
            raise InvalidUse(
                f"{self.endpoints[0]} was created in process {created} and used in process {pid}, a forked child: "
                "memory:// lives in one process, and a child's copy would silently part from its parent's. "
                "Connect to a real etcd for prefork workers and other processes (celery_etcdlock.testing's "
                "etcd_server fixture starts one), or use the solo or threads pool"
            )

    def _locked(self) -> _Namespace:
        """The namespace, to hold in a ``with`` block, if this process may use it."""
        self._check_process()  # before the lock: one held by another thread at the fork is never released here
        return self._store

    def _entry(self, kv: _Key) -> Entry:
        if kv.entry is None:
            kv.entry = Entry(self._relative(kv.key), kv.created, kv.raw)
        return kv.entry

    def _entry_with_ttl(self, kv: _Key, now: float) -> Entry:
        ttl = None
        if kv.lease is not None:
            ttl = float(max(0, int(self._store.leases[kv.lease].expires_at - now)))  # whole seconds, as etcd says
        return Entry(self._relative(kv.key), kv.created, kv.raw, ttl)

    def _snapshot(self, store: _Namespace, queue: str) -> Snapshot:
        children = store.children.get(self._full(queue))
        if not children:
            return Snapshot([], store.revision)
        ordered = sorted(children.values(), key=_created) if len(children) > 1 else children.values()
        return Snapshot([self._entry(kv) for kv in ordered], store.revision)

    @staticmethod
    def _own(lease: Lease) -> MemoryLease:
        if not isinstance(lease, MemoryLease):
            raise TypeError(f"the memory backend needs one of its own leases, not {lease!r}")
        return lease

    def _live(self, store: _Namespace, lease: Lease) -> MemoryLease:
        lease = self._own(lease)
        if lease.lease_id not in store.leases:
            lease.expired = True
        if lease.expired:
            raise LeaseExpired(f"lease {lease.id} has expired")
        return lease

    # -- leases -------------------------------------------------------------

    def grant(self, ttl: float) -> Lease:
        wanted = server_ttl(ttl)  # what etcd would be asked for, and grant: the session's clocks run on it
        with self._locked() as store:
            lease_id = next(store.lease_ids)
            expires_at = clock.now() + wanted
            store.leases[lease_id] = _LeaseState(wanted, expires_at)
            store.expires(expires_at)
        return MemoryLease(lease_id, ttl, wanted)

    def keep_alive(self, lease: Lease, entries: list[Entry], timeout: float) -> set[str]:
        lease = self._own(lease)
        with self._locked() as store:
            state = store.leases.get(lease.lease_id)
            if state is None:
                lease.expired = True
                return {entry.key for entry in entries}
            state.expires_at = clock.now() + state.ttl
            alive = {self._relative(key) for key in state.keys}
            carried = {(key, store.keys[self._full(key)].created) for key in alive}
        lease.keys = alive
        return {entry.key for entry in entries if (entry.key, entry.token) not in carried}

    def revoke(self, lease: Lease, entries: list[Entry]) -> None:
        lease = self._own(lease)
        lease.expired = True
        with self._locked() as store:
            if lease.lease_id in store.leases:
                store.drop_lease(lease.lease_id)

    def delete_stray(self, lease: Lease, key: str) -> None:
        lease = self._own(lease)
        with self._locked() as store:
            kv = store.keys.get(self._full(key))
            if kv is not None and kv.lease == lease.lease_id:
                store.delete(kv)

    # -- queues -------------------------------------------------------------

    def join_queue(self, queue: str, value: dict[str, Any], lease: Lease) -> tuple[Entry, Snapshot]:
        entry, snapshot = self._join(queue, value, lease, only_if_empty=False)
        assert entry is not None
        return entry, snapshot

    def join_queue_if_empty(self, queue: str, value: dict[str, Any], lease: Lease) -> tuple[Entry | None, Snapshot]:
        return self._join(queue, value, lease, only_if_empty=True)

    def _join(
        self, queue: str, value: dict[str, Any], lease: Lease, only_if_empty: bool
    ) -> tuple[Entry | None, Snapshot]:
        raw = encode_json(value)  # before anything is written: a value that is not JSON is refused here
        with self._locked() as store:
            lease = self._live(store, lease)
            if only_if_empty and self._full(queue) in store.children:
                return None, self._snapshot(store, queue)
            key = self._full(f"{queue}/{lease.id}.{next(store.nonces):x}")  # as v3: lease and nonce
            kv = store.put(key, raw, lease=lease.lease_id)
            return self._entry(kv), self._snapshot(store, queue)

    def read_queue(self, queue: str, fresh: bool = False) -> Snapshot:
        with self._locked() as store:
            return self._snapshot(store, queue)

    def wait_any_gone(self, entries: list[Entry], after_revision: int, timeout: float) -> WaitResult:
        # Nothing is missed by looking at the keys now rather than watching from after_revision: a key
        # deleted since that read is absent now (v3 does the same once its watch exists).
        deadline = clock.now() + max(0.0, timeout)
        keys = [(self._full(entry.key), entry.token) for entry in entries]
        with self._locked() as store:
            if any(store.find(key, token) is None for key, token in keys):
                return WaitResult.GONE
            watch = _Watch(store.lock)
            for key, _ in keys:
                store.watches.setdefault(key, set()).add(watch)
            try:
                while True:
                    now = clock.now()
                    store.expire(now)  # the entries' lease may have run out while nobody else looked
                    if watch.fired:
                        return WaitResult.GONE
                    if now >= deadline:
                        return WaitResult.TIMEOUT
                    # their leases are renewed, never shortened: waking at the soonest expiry seen now is enough
                    expiries = [store.leases[kv.lease].expires_at for kv in self._kvs(store, keys) if kv.lease]
                    watch.condition.wait(min([deadline, *expiries]) - now)
            finally:
                for key, _ in keys:
                    watchers = store.watches.get(key)
                    if watchers is not None:
                        watchers.discard(watch)
                        if not watchers:
                            del store.watches[key]

    @staticmethod
    def _kvs(store: _Namespace, keys: list[tuple[str, int]]) -> list[_Key]:
        return [kv for key, token in keys if (kv := store.find(key, token)) is not None]

    def delete_entry(self, entry: Entry) -> bool:
        with self._locked() as store:
            kv = store.find(self._full(entry.key), entry.token)
            if kv is None:
                return False
            store.delete(kv)
            return True

    def list_queues(self, namespace: str) -> dict[str, list[Entry]]:
        start = self._full(namespace) + "/"
        with self._locked() as store:
            now = clock.now()
            return {
                self._relative(parent): [self._entry_with_ttl(kv, now) for kv in sorted(kids.values(), key=_created)]
                for parent, kids in store.children.items()
                if parent.startswith(start) and "/" not in parent[len(start) :]
            }

    # -- records ------------------------------------------------------------

    def _record(self, kv: _Key, now: float) -> Record:
        ttl = None if kv.expires_at is None else float(max(0, int(kv.expires_at - now)))
        return Record(self._relative(kv.key), decode_json(kv.raw), kv.modified, ttl)

    def get_record(self, key: str) -> Record | None:
        with self._locked() as store:
            kv = store.keys.get(self._full(key))
            return None if kv is None else self._record(kv, clock.now())

    def put_record(
        self,
        key: str,
        value: dict[str, Any],
        *,
        expect: Record | None,
        fence: Entry | None = None,
        ttl: float | None = None,
    ) -> Record | None:
        raw = encode_json(value)
        full = self._full(key)
        with self._locked() as store:
            current = store.keys.get(full)
            if (current is None) != (expect is None) or (current and expect and current.modified != expect.version):
                return None
            if fence is not None and store.find(self._full(fence.key), fence.token) is None:
                return None  # a deposed holder's write fails: its key is gone or was created again
            expires_at = None if ttl is None else clock.now() + server_ttl(ttl)
            kv = store.put(full, raw, expires_at=expires_at)
            return Record(key, decode_json(raw), kv.modified, ttl)

    def delete_record(self, key: str, expect: Record | None = None) -> bool:
        with self._locked() as store:
            kv = store.keys.get(self._full(key))
            if kv is None or (expect is not None and kv.modified != expect.version):
                return False
            store.delete(kv)
            return True

    def read_records(self, prefix: str) -> RecordSet:
        start = self._full(prefix) + "/"
        with self._locked() as store:
            now = clock.now()
            records = {
                (record := self._record(kv, now)).key: record for key, kv in store.keys.items() if key.startswith(start)
            }
            return RecordSet(records, store.revision)

    def watch_records(self, prefix: str, after_revision: int, timeout: float) -> list[RecordChange] | WaitResult:
        deadline = clock.now() + max(0.0, timeout)
        start = self._full(prefix) + "/"
        with self._locked() as store:
            store.record_watches += 1
            try:
                while True:
                    now = clock.now()
                    store.expire(now)
                    if after_revision < store.forgotten:
                        return WaitResult.STALE
                    changes = [
                        RecordChange(self._relative(key), None if kv is None else self._record(kv, now), revision)
                        for revision, key, kv in store.history
                        if revision > after_revision and key.startswith(start)
                    ]
                    if changes:
                        return changes
                    if now >= deadline:
                        return WaitResult.TIMEOUT
                    store.changed.wait(min(deadline, store.next_expiry) - now)
            finally:
                store.record_watches -= 1

    # -- process life -------------------------------------------------------

    def native_twin(self) -> MemoryBackend:
        # no network: the twin is this backend (its locks are held only for bookkeeping, never across a wait)
        return self

    def after_fork(self) -> None:
        """Nothing to reconnect: the child's first operation raises (see ``_check_process``)."""

    def close(self) -> None:
        """Nothing to release: the namespace lives on for the process's other clients."""
