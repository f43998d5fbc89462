"""JSON documents in etcd, written by compare-and-swap, optionally fenced by a lock.

The beat scheduler keeps its schedule state here, and singleton tasks their
enqueue markers. A fenced write succeeds only while the fencing lock (or
leadership) is still held: in v3 the write is one transaction that compares
the holder's key and create revision; in v2, which has no multi-key
transactions, the caller makes the document itself the fence by recording
its token in it and always writing with a compare on the version it read.

    store = DocumentStore(client, "beat-state")
    doc = store.get("proj")                        # Record or None
    store.put("proj", {"entries": {}}, expect=doc, fence=election)   # Record or None
"""

from __future__ import annotations

from typing import Any, Protocol

from ..etcd.base import Entry, Record
from ..keys import record_key
from ..options import check_ttl
from .client import Client, check_client


class Fence(Protocol):
    """Anything holding a queue entry: a held Mutex, RWLock side or a leading Election."""

    @property
    def fence_entry(self) -> Entry | None: ...


class FenceLost(Exception):
    """Raised by ``DocumentStore.put`` when the fence is no longer held locally."""


class DocumentStore:
    def __init__(self, client: Client, kind: str) -> None:
        self.client = check_client(client)
        self.kind = kind
        self._backend = client.backend

    def _key(self, name: str) -> str:
        return record_key(self.kind, name)

    def get(self, name: str) -> Record | None:
        return self._backend.get_record(self._key(name))

    def put(
        self,
        name: str,
        value: dict[str, Any],
        *,
        expect: Record | None,
        fence: Fence | None = None,
        ttl: float | None = None,
    ) -> Record | None:
        """Write ``value`` if the document is still ``expect`` (absent if None). None if it was not."""
        fence_entry = None
        if fence is not None:
            fence_entry = fence.fence_entry
            if fence_entry is None:
                raise FenceLost(f"cannot write {self.kind}/{name}: the fence is not held")
        return self._backend.put_record(
            self._key(name),
            value,
            expect=expect,
            fence=fence_entry,
            ttl=None if ttl is None else check_ttl(ttl),
        )

    def delete(self, name: str, expect: Record | None = None) -> bool:
        return self._backend.delete_record(self._key(name), expect=expect)
