"""``celery etcdlock``: see and manage the locks and beat leaders of a Celery app.

    celery -A proj etcdlock locks              # held locks and their queues
    celery -A proj etcdlock leader             # the beat leader and the standby candidates
    celery -A proj etcdlock release NAME       # force-release a lock (asks first; --yes to skip)

Every sub-command prints a table, or JSON with ``--json``. The app's
``etcdlock_*`` settings say where etcd is. Reading needs no lock and
changes nothing; ``release`` deletes the holder's entry with a guarded
delete, so the holder finds its lock lost at its next renewal (its
``on_lost`` runs, ``held`` turns False) and the next waiter acquires.

The functions ``list_locks``, ``list_elections`` and ``force_release`` are
what the commands print; scripts (and the demo's live view) can call them
with any ``Client``.
"""

from __future__ import annotations

import importlib
import json
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import click
from celery.bin.base import CeleryCommand, handle_preload_options

from . import keys
from .beat.entries import entries_prefix
from .beat.scheduler import STATE_KIND as BEAT_STATE_KIND
from .errors import EtcdLockError
from .etcd.base import Entry
from .locks.client import Client
from .locks.connect import connect
from .locks.queue import QueueState, read_state
from .locks.store import DocumentStore
from .options import DEFAULT_TIMEOUT
from .settings import Settings

#: seconds an interactive command keeps trying etcd (a worker keeps trying for etcdlock_retry_max_delay)
DEFAULT_CLI_TIMEOUT = 3.0

# -- what the commands show -------------------------------------------------


@dataclass(frozen=True)
class Request:
    """One entry of a lock or election queue: a holder, a waiter or a candidate."""

    token: int
    mode: str  # "read" | "write" (locks); "leader" | "candidate" (elections)
    holder: str | None  # a lock holder's "host:pid", an election candidate's identity
    task: str | None  # the Celery task name, when a task holds it
    task_id: str | None
    host: str | None  # the worker's node name (e.g. celery@web-1), when a task recorded it
    ttl: float | None  # seconds left before it expires unless renewed, when the backend reports it
    value: dict[str, Any] = field(default_factory=dict)  # the entry's whole recorded value

    @classmethod
    def from_entry(cls, entry: Entry, mode: str | None = None) -> Request:
        value = entry.value
        recorded = value.get("data")
        data: dict[str, Any] = recorded if isinstance(recorded, dict) else {}
        # an election candidate's identity is in its data; a lock's holder is "host:pid"
        holder = _first_str(data, "identity") or _first_str(value, "holder")
        if not value:  # not one of ours: etcdctl lock/elect or Go's concurrency recipes (docs/interop.md)
            holder = f"foreign: {entry.raw[:80]}" if entry.raw else "foreign (etcdctl or Go)"
        host = _first_str(data, "hostname")
        ttl = getattr(entry, "ttl", None)
        return cls(
            token=entry.token,
            mode=mode or entry.mode,
            holder=holder,
            task=_first_str(data, "task"),
            task_id=_first_str(data, "task_id"),
            host=host,
            ttl=float(ttl) if isinstance(ttl, (int, float)) else None,
            value={k: v for k, v in value.items() if k != "nonce"},
        )


@dataclass(frozen=True)
class LockState:
    name: str
    mode: str  # "write" (a Mutex or RWLock writer), "read" (one or more readers) or "slot" (a Semaphore)
    holders: list[Request]
    waiters: list[Request]
    limit: int | None = None  # a Semaphore's limit (len(holders) of them are used)

    @property
    def kind(self) -> str:
        return "semaphore" if self.mode == "slot" else "lock"


@dataclass(frozen=True)
class ElectionState:
    name: str
    leader: Request | None
    candidates: list[Request]  # standing by, in the order they would take over
    since: str | None = None  # when the leader took over (a beat's state document records it), ISO 8601
    changes: int | None = None  # how many times a process took over from another (the first counts; beat only)
    runtime_entries: int | None = None  # a beat's entries saved at run time (LeaderSchedulerEntry)


def _first_str(mapping: dict[str, Any], *names: str) -> str | None:
    for name in names:
        value = mapping.get(name)
        if value is not None and value != "":
            return str(value)
    return None


def _queue_name(queue_key: str) -> str:
    return keys.decode_name(queue_key.rstrip("/").rsplit("/", 1)[-1])


def list_locks(client: Client) -> list[LockState]:
    """Every lock and semaphore with a holder or a waiter, by name."""
    states = []
    for namespace in (keys.LOCKS, keys.SEMAPHORES):
        for queue_key, entries in client.backend.list_queues(namespace).items():
            state = _lock_state(_queue_name(queue_key), QueueState(entries, 0))
            if state is not None:
                states.append(state)
    return sorted(states, key=lambda s: (s.name, s.kind))


def list_elections(client: Client) -> list[ElectionState]:
    """Every election with a candidate: the leader (the first entry) and the others in order."""
    states = []
    beat_states = DocumentStore(client, BEAT_STATE_KIND)
    for queue_key, entries in client.backend.list_queues(keys.ELECTIONS).items():
        if not entries:
            continue
        name = _queue_name(queue_key)
        since = changes = runtime = None
        if name.startswith("beat/"):  # a beat leader records when it took over, in the schedule's state
            beat = name.removeprefix("beat/")
            record = beat_states.get(beat)
            if record is not None and record.value.get("token") == entries[0].token:
                since, changes = record.value.get("since"), record.value.get("changes")
            runtime = len(client.backend.read_records(entries_prefix(beat)).records)
        states.append(
            ElectionState(
                name=name,
                leader=Request.from_entry(entries[0], "leader"),
                candidates=[Request.from_entry(e, "candidate") for e in entries[1:]],
                since=since,
                changes=changes,
                runtime_entries=runtime,
            )
        )
    return sorted(states, key=lambda s: s.name)


def find_lock(client: Client, name: str) -> LockState | None:
    """The lock (else the semaphore) ``name`` if someone holds it, else None."""
    for namespace in (keys.LOCKS, keys.SEMAPHORES):
        state = _lock_state(name, read_state(client, keys.queue_key(namespace, name), fresh=True))
        if state is not None:
            return state
    return None


def _lock_state(name: str, queue: QueueState) -> LockState | None:
    holders = queue.holders
    if not holders:
        return None
    return LockState(
        name=name,
        mode=holders[0].mode,
        holders=[Request.from_entry(e) for e in holders],
        waiters=[Request.from_entry(e) for e in queue.waiters],
        limit=holders[0].limit if holders[0].mode == "slot" else None,
    )


def force_release(client: Client, name: str, tokens: Sequence[int] | None = None) -> list[int]:
    """Delete the holders' entries of lock (else semaphore) ``name`` (only those of ``tokens`` if given).

    Each delete is guarded by the entry's exact stored value, so a holder
    that released or changed in the meantime is left alone. Returns the
    tokens released.
    """
    holders: list[Entry] = []
    for namespace in (keys.LOCKS, keys.SEMAPHORES):
        holders = read_state(client, keys.queue_key(namespace, name), fresh=True).holders
        if holders:
            break
    released = []
    for entry in holders:
        if tokens is not None and entry.token not in tokens:
            continue
        if client.backend.delete_entry(entry):
            released.append(entry.token)
    return released


# -- rendering ----------------------------------------------------------------


def _ttl_text(ttl: float | None) -> str:
    return "-" if ttl is None else f"{ttl:.0f}s"


def _cell(value: object) -> str:
    return "-" if value is None else str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table with aligned columns."""
    cells = [[_cell(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    for row in cells:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)


def locks_table(states: Sequence[LockState]) -> str:
    rows: list[list[object]] = []
    for state in states:
        for i, holder in enumerate(state.holders):
            first = i == 0
            rows.append(
                [
                    state.name if first else "",
                    f"slot {len(state.holders)}/{state.limit}" if state.limit is not None and first else holder.mode,
                    holder.token,
                    holder.task,
                    holder.task_id,
                    holder.host,
                    holder.holder,
                    _ttl_text(holder.ttl),
                    len(state.waiters) if first else "",
                ]
            )
    return format_table(["NAME", "MODE", "TOKEN", "TASK", "TASK ID", "WORKER", "HOLDER", "TTL", "WAITERS"], rows)


def elections_table(states: Sequence[ElectionState]) -> str:
    rows: list[list[object]] = []
    for state in states:
        if state.leader is not None:
            leader = state.leader
            rows.append(
                [
                    state.name,
                    "leader",
                    leader.holder,
                    leader.token,
                    _ttl_text(leader.ttl),
                    state.since,
                    state.changes,
                    state.runtime_entries,
                ]
            )
        for candidate in state.candidates:
            rows.append(["", "candidate", candidate.holder, candidate.token, _ttl_text(candidate.ttl), "", "", ""])
    headers = ["ELECTION", "ROLE", "IDENTITY", "TOKEN", "TTL", "SINCE", "CHANGES", "RUNTIME ENTRIES"]
    return format_table(headers, rows)


def _json(value: object) -> str:
    return json.dumps(value, indent=2, sort_keys=True, default=str)


# -- the click commands ---------------------------------------------------------

json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
timeout_option = click.option(
    "--timeout",
    type=click.FloatRange(min=0, max=300),
    default=DEFAULT_CLI_TIMEOUT,
    show_default=True,
    metavar="SECONDS",
    help="How long to keep trying to reach etcd before giving up.",
)


@contextmanager
def _etcd_errors() -> Iterator[None]:
    """Turn the package's errors (etcd down, bad settings) into a one-line CLI error."""
    try:
        yield
    except (EtcdLockError, ValueError, TypeError) as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from None


def _client(ctx: click.Context, timeout: float) -> Client:
    """A client of the app's settings, with an interactive retry budget: a command answers at once."""
    with _etcd_errors():
        settings = Settings.from_app(ctx.obj.app)
        return connect(
            settings.url,
            prefix=settings.prefix,
            retry_max_delay=timeout,
            timeout=max(0.5, min(timeout, DEFAULT_TIMEOUT)),
        )


class _LazyGroup(click.Group):
    """A group whose ``schedule`` commands are imported only when used (``cli_schedule`` imports this module)."""

    lazy = {"schedule": ("celery_etcdlock.cli_schedule", "schedule_group")}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *self.lazy])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy:
            module, name = self.lazy[cmd_name]
            command: click.Command = getattr(importlib.import_module(module), name)
            return command
        return super().get_command(ctx, cmd_name)


@click.group(name="etcdlock", cls=_LazyGroup)
@click.pass_context
@handle_preload_options
def etcdlock(ctx: click.Context) -> None:
    """Locks, queues and beat leaders kept in etcd by celery_etcdlock."""


watch_option = click.option(
    "--watch", "interval", type=float, default=None, metavar="SECONDS", help="Redraw every SECONDS."
)


@etcdlock.command(cls=CeleryCommand)
@json_option
@timeout_option
@watch_option
@click.pass_context
def locks(ctx: click.Context, as_json: bool, interval: float | None, timeout: float) -> None:
    """List held locks and semaphores: name, holder task id and host, token, TTL left, waiters."""
    _show(_client(ctx, timeout), list_locks, locks_table, "No lock is held.", as_json, interval)


@etcdlock.command(cls=CeleryCommand)
@json_option
@timeout_option
@watch_option
@click.pass_context
def leader(ctx: click.Context, as_json: bool, interval: float | None, timeout: float) -> None:
    """Show the beat leader (and every other election) with its standby candidates."""
    empty = "No leader: no beat (or other election) is running."
    _show(_client(ctx, timeout), list_elections, elections_table, empty, as_json, interval)


def _show(
    client: Client,
    read: Callable[[Client], Sequence[Any]],
    table: Callable[[Sequence[Any]], str],
    empty: str,
    as_json: bool,
    interval: float | None,
) -> None:
    """Print what ``read`` finds, as ``table`` (or JSON), once or every ``interval`` seconds."""

    def show() -> None:
        with _etcd_errors():
            states = read(client)
        if as_json:
            click.echo(_json([{**asdict(s), "kind": getattr(s, "kind", "election")} for s in states]))
        elif states:
            click.echo(table(states))
        else:
            click.echo(empty)

    _repeat(show, interval)


@etcdlock.command(cls=CeleryCommand)
@click.argument("name")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@click.option("--token", "tokens", type=int, multiple=True, help="Release only the holder with this token (repeatable)")
@json_option
@timeout_option
@click.pass_context
def release(ctx: click.Context, name: str, yes: bool, tokens: tuple[int, ...], as_json: bool, timeout: float) -> None:
    """Force-release the lock or semaphore NAME, whoever holds it (one slot's holder with --token).

    The holder learns at its next renewal that the lock is lost; the next
    waiter acquires it with a higher token. Use it for a lock whose holder
    is stuck, not one that died (a dead holder's lock expires by itself).
    """
    client = _client(ctx, timeout)
    with _etcd_errors():
        state = find_lock(client, name)
        if state is None and not name.startswith(TASK_LOCKS):
            task_lock = find_lock(client, TASK_LOCKS + name)  # a task's name: the lock of a task without a key
            if task_lock is not None:
                name, state = task_lock.name, task_lock
    if state is not None and tokens:
        unknown = sorted(set(tokens) - {h.token for h in state.holders})
        if unknown:
            raise click.ClickException(f"{name!r} has no holder with token {', '.join(map(str, unknown))}")
        state = LockState(state.name, state.mode, [h for h in state.holders if h.token in tokens], [], state.limit)
    if state is None:
        if as_json:
            click.echo(_json({"name": name, "released": []}))
            ctx.exit(1)
        raise click.ClickException(_not_held(client, name))
    if not yes:
        if as_json:
            raise click.UsageError("--json needs --yes: there is no one to confirm")
        click.echo(locks_table([state]))
        click.confirm(f"Force-release lock {name!r}? Its holder will lose it", abort=True)
    with _etcd_errors():
        released = force_release(client, name, tokens=[h.token for h in state.holders])
    if as_json:
        click.echo(_json({"name": name, "released": released}))
    elif released:
        click.echo(f"Released lock {name!r} (token {', '.join(map(str, released))}).")
    else:
        click.echo(f"Lock {name!r} changed hands meanwhile; nothing released.")
    if not released:
        ctx.exit(1)


#: how a task's locks are named: task/<task name>, or task/<task name>/<key> (tasks/options.py)
TASK_LOCKS = "task/"
SHOWN_MATCHES = 5


def _not_held(client: Client, name: str) -> str:
    """Why ``release NAME`` found nothing, with the held locks of the task ``name`` if there are any."""
    task = name.removeprefix(TASK_LOCKS)
    with _etcd_errors():
        held = [s.name for s in list_locks(client) if s.name.startswith(f"{TASK_LOCKS}{task}/")]
    if held:
        listed = ", ".join(repr(n) for n in held[:SHOWN_MATCHES]) + (" ..." if len(held) > SHOWN_MATCHES else "")
        return f"lock {name!r} is not held; the task's held locks are {listed}: release one of them by its name"
    return (
        f"lock {name!r} is not held (a task's lock is named task/<task name>, or task/<task name>/<key> "
        "with a key; `celery etcdlock locks` lists the held ones)"
    )


def _repeat(show: Callable[[], None], interval: float | None) -> None:
    if interval is None:
        show()
        return
    if interval <= 0:
        raise click.BadParameter("must be a positive number of seconds", param_hint="--watch")
    try:
        while True:
            click.clear()
            click.echo(time.strftime("%H:%M:%S"))
            show()
            time.sleep(interval)
    except KeyboardInterrupt:
        pass
