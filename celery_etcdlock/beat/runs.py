"""The fenced record of every run a leader-only beat sends: one JSON document in etcd.

    runs = RunRecords(DocumentStore(client, STATE_KIND), "proj", identity="host:4242")
    found = runs.take_over(election, token, {"every": (now, 0)}, now=now, tz=app.timezone)
    if runs.record(election, "every", last_run_at, total_run_count):
        ...  # recorded before it is sent: now send it

The document (kind ``beat-state``, named like the election) keeps each entry's
last run time and run count, who leads (``leader``), since when (``since``),
with which election token (``token``) and how many times leadership moved
(``changes``). Its layout is the one of 0.2, so beats of both versions share it.

Every write is a compare-and-swap on the version this leader last read or
wrote, fenced by the election, so that successful writes form one chain and a
run one write records is never due again in a later one. Why that gives "no
run sent twice", and what it costs, is in docs/beat.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from celery.utils.log import get_logger
from celery.utils.time import maybe_make_aware

from ..etcd.base import Record
from ..locks.election import Election
from ..locks.store import DocumentStore

logger = get_logger(__name__)

STATE_KIND = "beat-state"
STATE_FORMAT = 1

#: one entry's stored state: (last_run_at, total_run_count)
RunState = tuple[datetime, int]


def encode_time(value: datetime) -> str:
    return maybe_make_aware(value).astimezone(timezone.utc).isoformat()


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def decode_state(name: str, state: object, tz: Any) -> RunState | None:
    """One entry's (last_run_at, total_run_count) as stored, or None if unusable."""
    try:
        if not isinstance(state, dict):
            raise TypeError("not an object")
        last_run_at = datetime.fromisoformat(state["last_run_at"])
        if last_run_at.tzinfo is None:
            raise ValueError("last_run_at has no time zone")
        count = state.get("total_run_count", 0)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"bad total_run_count {count!r}")
        return last_run_at.astimezone(tz), count
    except (KeyError, TypeError, ValueError) as exc:
        logger.warning("beat: ignoring unusable stored state of entry %r (%s): %r", name, exc, state)
        return None


class RunRecords:
    """The state document of one beat name, as this process last read or wrote it.

    ``take_over`` and ``record`` raise ``FenceLost`` and ``BackendError`` as
    ``DocumentStore.put`` does; None / False means another writer came first.
    """

    def __init__(self, store: DocumentStore, name: str, identity: str) -> None:
        self.store = store
        self.name = name
        self.identity = identity
        self.state: Record | None = None  # None: not taken over (or given up)
        self.previous: dict[str, Any] = {}  # the document as the last take-over found it

    def forget(self) -> None:
        self.state = None

    def stored(self, name: str, tz: Any) -> RunState | None:
        """The last recorded run of entry ``name``, as this leader last wrote or read it."""
        if self.state is None:
            return None
        entries = self.state.value.get("entries")
        if not isinstance(entries, dict) or name not in entries:
            return None
        return decode_state(name, entries[name], tz)

    def take_over(
        self, election: Election, token: int, initial: Mapping[str, RunState], now: datetime, tz: Any
    ) -> dict[str, RunState | None] | None:
        """Record our token in the document; each entry's stored state (None: new). None if it changed meanwhile.

        ``initial`` names the scheduled entries, with the state an entry new to the document starts from.
        """
        stored = self.store.get(self.name)
        previous = stored.value if stored is not None else {}
        stored_token = previous.get("token")
        if isinstance(stored_token, int) and stored_token > token:
            # A later leader's token, or a state copied from another cluster (tokens are revisions of the
            # cluster that wrote them). Not a reason to stand down: the compare-and-swap on the version
            # below is what keeps two leaders from both recording a run.
            logger.warning(
                "beat %s: beat/%s was last written by %s with token %s > ours %s",
                self.identity,
                self.name,
                previous.get("leader"),
                stored_token,
                token,
            )
        stored_entries = previous.get("entries")
        if not isinstance(stored_entries, dict):
            stored_entries = {}
        names = list(initial)
        found = {
            name: decode_state(name, stored_entries[name], tz) if name in stored_entries else None for name in names
        }
        removed = sorted(set(stored_entries) - set(names))
        if removed:
            logger.info(
                "beat %s: dropping the state of entries no longer scheduled: %s", self.identity, ", ".join(removed)
            )
        adopted = {name: state if state is not None else initial[name] for name, state in found.items()}
        document = {
            "format": STATE_FORMAT,
            "leader": self.identity,
            "token": token,
            "since": encode_time(now),
            # take-overs: a leader after another one (the first election, or a leader's own return, is none)
            "changes": _count(previous.get("changes")) + (previous.get("leader") not in (None, self.identity)),
            "entries": {
                name: {"last_run_at": encode_time(last), "total_run_count": count}
                for name, (last, count) in adopted.items()
            },
        }
        written = self.store.put(self.name, document, expect=stored, fence=election)
        if written is None:
            return None
        self.state, self.previous = written, previous
        return found

    def record(self, election: Election, name: str, last_run_at: datetime, count: int) -> bool:
        """Record a run of entry ``name``. False if another writer came first (or the fence is gone)."""
        if self.state is None:
            return False
        document = dict(self.state.value)
        document["entries"] = dict(document.get("entries") or {})
        document["entries"][name] = {"last_run_at": encode_time(last_run_at), "total_run_count": count}
        written = self.store.put(self.name, document, expect=self.state, fence=election)
        if written is None:
            return False
        self.state = written
        return True
