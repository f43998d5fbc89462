"""The small interface every etcd backend implements.

The primitives (mutex, read-write lock, election) and the Celery layer are
written against this interface only, never against python-etcd or etcd3gw,
so that the etcd v2 and v3 backends are interchangeable.

Vocabulary:

- A *queue* is a directory (v2) or key prefix (v3) of *entries*, one per
  acquisition request, ordered by creation. An entry's ``token`` is its
  creation number (``createdIndex`` / ``create_revision``): strictly
  increasing, so it is both the queue order and the fencing token.
- A *lease* keeps a group of entries alive. In v3 it is a real etcd lease;
  in v2 it is the group of keys that one refresh round renews. Only the
  session (``celery_etcdlock.locks.session``) uses leases.
- A *record* is a plain JSON document at a known key, written with a
  compare-and-swap (beat schedule state, enqueue markers).

What differs between the APIs is said by two class attributes
(``entries_have_own_ttl``, ``queues_outlive_entries``), never by asking
which API a backend is.

Every key passed in or out is *relative to the client's prefix*: backends
add and strip the prefix, so nothing outside a backend can reach outside it.
All values are JSON objects (``dict``); nothing else is ever stored.

Each method is one logical etcd operation, already wrapped in the retry
policy: it either succeeds, returns its documented "no" answer, or raises
``BackendUnavailable`` / another ``BackendError``.
"""

from __future__ import annotations

import abc
import enum
import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from ..errors import UnsupportedServer
from ..options import ConnectionOptions


@dataclass(frozen=True)
class Entry:
    """One request in a queue, as stored in etcd."""

    key: str  # relative to the prefix, e.g. "locks/reports~2Fdaily/00000000000000000042"
    token: int  # creation number: queue order and fencing token
    raw: str = field(repr=False, compare=False, default="")  # the exact stored text (a JSON object)
    ttl: float | None = field(compare=False, default=None)  # seconds left, where the read says

    @cached_property
    def value(self) -> dict[str, Any]:
        # decoded on demand: a waiter reads the whole queue at every turn, but looks at few values
        return decode_json(self.raw)

    @property
    def mode(self) -> str:
        return str(self.value.get("mode", "write"))

    @property
    def limit(self) -> int:
        """A semaphore's limit as its entry records it (1 for anything else)."""
        limit = self.value.get("limit", 1)
        return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else 1


@dataclass(frozen=True)
class Snapshot:
    """A queue read in creation order, and the revision the read saw."""

    entries: list[Entry]
    revision: int  # watch from revision + 1 to miss nothing after this read

    def find(self, token: int) -> Entry | None:
        for entry in self.entries:
            if entry.token == token:
                return entry
        return None


@dataclass(frozen=True)
class Record:
    """A JSON document at a fixed key, with the version a compare-and-swap needs."""

    key: str
    value: dict[str, Any]
    version: int  # modifiedIndex (v2) / mod_revision (v3)
    ttl: float | None = None  # seconds left, for keys that expire (v3: one more request to ask the lease)


@dataclass(frozen=True)
class RecordSet:
    """Every record under a key prefix, read at one revision (watch from ``revision + 1`` to miss nothing)."""

    records: dict[str, Record]  # by key
    revision: int


@dataclass(frozen=True)
class RecordChange:
    """One change of a record under a watched prefix."""

    key: str
    record: Record | None  # None: deleted or expired
    revision: int  # the revision of the change: watch again from revision + 1


class WaitResult(enum.Enum):
    GONE = "gone"  # the watched entry was deleted or expired
    TIMEOUT = "timeout"  # nothing happened within the timeout; watch again from the same revision
    STALE = "stale"  # the revision is too old to watch from (compacted, v2's 1000 events): read again


class LeaseExpired(Exception):
    """The lease an entry was to be created with no longer exists (v3); grant a new one."""


EXPIRY_LAG = 0.5  # etcd removes expired keys (v2) and leases (v3) in a loop that runs twice a second


def server_ttl(ttl: float) -> int:
    """The TTL to ask etcd for (whole seconds) so that a dead holder's entry is gone within ``ttl``.

    etcd's expiry loop lets an entry outlive its TTL by up to ``EXPIRY_LAG``. A session's
    deadline and renewals are reckoned from this number, not from ``ttl``.
    """
    return max(1, math.floor(ttl - EXPIRY_LAG))


class Lease(abc.ABC):
    """What keeps a group of entries alive; created by ``Backend.grant``.

    ``ttl`` is what the caller asked for. ``server_ttl`` is what etcd is asked to keep the entries
    for: ``server_ttl(ttl)``, worked out once, by ``grant``. The backend sends it, and the
    session's deadlines and renewals run on it.
    """

    expired: bool = False  # set by keep_alive when the server no longer knows the lease
    keys: set[str] | None = None  # the keys the server says the lease carries (v3, set by keep_alive)

    def __init__(self, ttl: float, server_ttl: int) -> None:
        self.ttl = ttl
        self.server_ttl = server_ttl

    @property
    @abc.abstractmethod
    def id(self) -> str:
        """A short printable id, for logs."""


class NumberedLease(Lease):
    """A lease the server numbers: etcd v3's, and the memory backend's, which mimics it."""

    def __init__(self, lease_id: int, ttl: float, server_ttl: int) -> None:
        super().__init__(ttl, server_ttl)
        self.lease_id = lease_id

    @property
    def id(self) -> str:
        return f"{self.lease_id:x}"

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} ttl={self.server_ttl} expired={self.expired}>"


# sort_keys: the same document always has the same text, which v2 compares. One encoder for every call:
# json.dumps with options builds a new one each time, which cost more than the encoding of a queue entry.
_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"))


def encode_json(value: dict[str, Any]) -> str:
    return _ENCODER.encode(value)


def decode_json(text: str | bytes | None) -> dict[str, Any]:
    """Decode a stored value; anything that is not a JSON object reads as {}."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except (ValueError, UnicodeDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


def peer_port_error(endpoint: str, status: int, members: bytes) -> UnsupportedServer | None:
    """The error for an endpoint that is an etcd member's peer port, judged by its answer to ``GET /members``.

    A peer port answers every client request with a 404 but serves ``/members`` (a JSON
    list with each member's ``peerURLs`` and ``clientURLs``), which no client port does.
    """
    if status != 200:
        return None
    try:
        found = json.loads(members)
    except ValueError:
        return None
    if not isinstance(found, list) or not all(isinstance(m, dict) and "peerURLs" in m for m in found):
        return None
    client_urls = [str(url) for m in found for url in m.get("clientURLs") or ()]
    hint = f" (the members' client URLs: {', '.join(client_urls)})" if client_urls else ""
    return UnsupportedServer(f"{endpoint} is etcd's peer port; use the client port, usually 2379{hint}")


class Backend(abc.ABC):
    """One etcd API version. Thread-safe; one instance per ``connect()``."""

    endpoints: tuple[str, ...]
    prefix: str

    @abc.abstractmethod
    def __init__(self, options: ConnectionOptions) -> None:
        """Set up from checked options; make no request yet (the first operation connects)."""

    # What the session must do differently on this backend:
    #: each entry has a TTL of its own, renewed one by one, and creating it starts its TTL (v2); else entries ride
    #: on a shared lease, alive as long as the lease's last renewal (v3)
    entries_have_own_ttl: bool = False
    #: a queue's container outlives its last entry (v2 directories), so ``forget_queue`` has work to do
    queues_outlive_entries: bool = False

    # -- leases -------------------------------------------------------------

    @abc.abstractmethod
    def grant(self, ttl: float) -> Lease:
        """A new lease of ``ttl`` seconds (v2: local bookkeeping only)."""

    @abc.abstractmethod
    def keep_alive(self, lease: Lease, entries: list[Entry], timeout: float) -> set[str]:
        """Renew ``lease`` and the ``entries`` it carries, within ``timeout`` seconds.

        Returns the keys of the entries found gone (all of them if the
        lease itself is gone; v3 also lists the lease's keys, so that an
        entry deleted behind its holder's back is reported). Makes a single
        attempt: raises ``retry.Transient`` for a retryable failure (the
        session's renewal policy retries, within its deadline) and
        ``BackendError`` otherwise.
        """

    @abc.abstractmethod
    def revoke(self, lease: Lease, entries: list[Entry]) -> None:
        """Free ``entries`` and ``lease`` at once, rather than when they expire (a closing client).

        v3 revokes the lease, which deletes every key on it; v2 deletes each entry with a
        guarded delete. Each request is made once, with no retry: the entries expire anyway.
        """

    def delete_stray(self, lease: Lease, key: str) -> None:  # noqa: B027 - v2 has no shared leases
        """Delete ``key`` if it still rides on ``lease``: a key no claim owns (a failed delete, an
        interrupted create) would otherwise live as long as the process renews the lease (v3)."""

    # -- queues -------------------------------------------------------------

    @abc.abstractmethod
    def join_queue(self, queue: str, value: dict[str, Any], lease: Lease) -> tuple[Entry, Snapshot]:
        """Append a new entry to ``queue``, kept alive by ``lease``; and the queue read after it (including it).

        Raises ``LeaseExpired`` if the lease is gone on the server. If the entry was
        created but the read fails, the entry is deleted before the error is raised:
        nobody holds it yet, and it must not block the queue until its TTL.
        """

    @abc.abstractmethod
    def join_queue_if_empty(self, queue: str, value: dict[str, Any], lease: Lease) -> tuple[Entry | None, Snapshot]:
        """``join_queue`` only if ``queue`` is empty; else create nothing and return (None, the queue).

        A non-blocking acquire looks before it joins, so that its own short-lived entry never
        makes another request give up. The look decides, so it must be linearizable: a member
        cut off from the others may still list holders long gone.
        """

    @abc.abstractmethod
    def read_queue(self, queue: str, fresh: bool = False) -> Snapshot:
        """The queue's entries in creation order.

        ``fresh=True`` asks for a linearizable read even where a cheaper
        read is normally good enough.
        """

    @abc.abstractmethod
    def wait_any_gone(self, entries: list[Entry], after_revision: int, timeout: float) -> WaitResult:
        """Block until one of ``entries`` (all of one queue) is deleted or expires, or ``timeout`` passes.

        Watches from ``after_revision + 1``, the revision of the read that decided to wait, so
        that no delete in between is missed.
        """

    def wait_gone(self, entry: Entry, after_revision: int, timeout: float) -> WaitResult:
        """Block until ``entry`` is deleted or expires, watching from ``after_revision + 1``."""
        return self.wait_any_gone([entry], after_revision, timeout)

    @abc.abstractmethod
    def delete_entry(self, entry: Entry) -> bool:
        """Delete ``entry`` only if it is still the one we created. False if it was gone."""

    @abc.abstractmethod
    def list_queues(self, namespace: str) -> dict[str, list[Entry]]:
        """Every non-empty queue directly under ``namespace``, keyed by queue key."""

    def forget_queue(self, queue: str) -> None:  # noqa: B027 - optional hook
        """Remove the queue's container if it is empty (v2 directories). Best effort."""

    # -- records ------------------------------------------------------------

    @abc.abstractmethod
    def get_record(self, key: str) -> Record | None:
        """The record at ``key``, or None."""

    @abc.abstractmethod
    def put_record(
        self,
        key: str,
        value: dict[str, Any],
        *,
        expect: Record | None,
        fence: Entry | None = None,
        ttl: float | None = None,
    ) -> Record | None:
        """Compare-and-swap a record.

        Writes only if the key still is ``expect`` (same version), or does
        not exist when ``expect`` is None; in v3 also only if ``fence``
        still exists with its token. ``ttl`` makes the record expire.
        Returns the new record, or None if a compare failed.
        """

    @abc.abstractmethod
    def delete_record(self, key: str, expect: Record | None = None) -> bool:
        """Delete ``key`` (only if unchanged since ``expect``, when given). False if it was not."""

    def read_records(self, prefix: str) -> RecordSet:
        """Every record whose key starts with ``prefix`` + "/" (at any depth), and the revision of the read."""
        raise NotImplementedError(f"{type(self).__name__} cannot list records")

    def watch_records(self, prefix: str, after_revision: int, timeout: float) -> list[RecordChange] | WaitResult:
        """The changes of records under ``prefix`` + "/" after ``after_revision``, once there is one.

        Blocks up to ``timeout`` seconds (then ``WaitResult.TIMEOUT``); ``WaitResult.STALE`` if
        ``after_revision`` is too old to watch from (compacted; v2 keeps 1000 events): read again.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot watch records")

    # -- process life -------------------------------------------------------

    def native_twin(self) -> Backend:
        """A backend for a native OS thread of a gevent process (a session's renewer), with connections of its own.

        Under gevent, this backend's sockets, TLS and locks wait on the hub of the thread that
        uses them, which a task that does not yield starves. The twin makes the same requests
        on unpatched sockets, with OS locks (see ``green.py`` and ``etcd/native.py``); it
        shares nothing with this backend. A backend that makes no network requests may
        return itself.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot renew from a native thread under gevent")

    @abc.abstractmethod
    def after_fork(self) -> None:
        """Drop connections inherited from a parent process; open new ones lazily."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""
