"""The lock options of a singleton or read-write locked task, and the lock name each call takes.

    check_options({"key": ["customer_id"], "on_conflict": "retry"}, "singleton_task")
    lock_name_for(sync_customer, (42,), {})     # "task/app.sync_customer/customer_id=42"

Options are checked when the task is declared (or its class registered), so
a mistake fails at import, naming the option, not at the first run. A lock
name is ``lock_name`` rendered for the call if the task has one, else
``task/<task name>``, followed by ``/<key>`` if it has a ``key``. ``key`` and
``lock_name`` are a list of argument names (rendered ``name=<json>,...``),
a format string over the arguments, or ``callable(args, kwargs) -> str``;
arguments are bound through the task's signature, so a key names an
argument however the caller passed it. With ``hash_key=True`` the part
rendered from the arguments is replaced by its SHA-256, so that argument
values (a customer's e-mail, say) appear in no etcd key, log line or CLI table.

Names that users bring from celery-singleton or celery-once (``unique_on``,
``lock_expiry``, ``once=``...) and close misspellings of ours fail at
definition with the option to use instead: silently accepted, they would
give a task another lock than the one its author meant.
"""

from __future__ import annotations

import difflib
import hashlib
import inspect
import json
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from ..options import check_seconds, check_ttl

ON_CONFLICT = ("skip", "raise", "retry", "wait", "reschedule")
HASHED = "sha256:"  # what a hashed key starts with
MODES = ("read", "write")
LOCK_OPTIONS = (
    "limit",
    "key",
    "lock_ttl",
    "on_conflict",
    "lock_timeout",
    "retry_countdown",
    "dedupe_enqueue",
    "dedupe_ttl",
    "lock_name",
    "lock_mode",
    "hash_key",
    "reschedule_countdown",
    "reschedule_max_countdown",
    "reschedule_for",
)
#: the decorators' names for options the task classes keep under another name
DECORATOR_NAMES = {"lock": "lock_name", "mode": "lock_mode"}

#: options of the libraries people migrate from, and what to write instead
MIGRATION_HINTS = {
    "unique_on": "celery-singleton's unique_on: use key=[...argument names...]",
    "lock_expiry": "celery-singleton's lock_expiry: use lock_ttl= (a lock here is renewed while the task runs; "
    "lock_ttl only bounds how long a dead worker keeps it)",
    "raise_on_duplicate": "celery-singleton's raise_on_duplicate: use on_conflict='raise' (and dedupe_enqueue=True "
    "to refuse duplicates at enqueue time)",
    "once": "celery-once's once={...}: use key=[...] for once['keys'], on_conflict='skip' for graceful=True or "
    "'raise' for graceful=False, lock_ttl= for timeout, and dedupe_enqueue=True to refuse duplicates at enqueue",
    "keys": "celery-once's keys: use key=[...argument names...]",
    "graceful": "celery-once's graceful: use on_conflict='skip' (graceful=True) or on_conflict='raise'",
    "unlock_before_run": "celery-once's unlock_before_run: locks here are taken when the task runs, not at enqueue",
}

NameFunction = Callable[[tuple[Any, ...], dict[str, Any]], str]
KeySpec = str | Sequence[str] | NameFunction | None


# -- checks -------------------------------------------------------------------------------


def check_options(options: dict[str, Any], where: str) -> None:
    """Raise TypeError/ValueError naming the first bad lock option of ``options``."""
    key = options.get("key")
    if key is not None and not (isinstance(key, str) or callable(key) or _is_names(key)):
        raise TypeError(
            f"{where}: key must be None, a list of argument names, a format string or a callable, not {key!r}"
        )
    if isinstance(key, str) and not key:
        raise ValueError(f"{where}: key must not be an empty string")
    if options.get("lock_ttl") is not None:
        check_ttl(options["lock_ttl"], f"{where}: lock_ttl")
    on_conflict = options.get("on_conflict", "skip")
    if on_conflict not in ON_CONFLICT:
        choices = ", ".join(map(repr, ON_CONFLICT))
        raise ValueError(f"{where}: on_conflict must be one of {choices}, not {on_conflict!r}")
    if options.get("lock_timeout") is not None:
        check_seconds(options["lock_timeout"], f"{where}: lock_timeout")
    if "retry_countdown" in options:
        check_seconds(options["retry_countdown"], f"{where}: retry_countdown")
    if "dedupe_ttl" in options:
        check_ttl(options["dedupe_ttl"], f"{where}: dedupe_ttl")
    if not isinstance(options.get("dedupe_enqueue", False), bool):
        raise TypeError(f"{where}: dedupe_enqueue must be True or False, not {options['dedupe_enqueue']!r}")
    if "lock_name" in options:
        lock_name = options["lock_name"]
        if not (isinstance(lock_name, str) and lock_name) and not callable(lock_name) and lock_name is not None:
            raise TypeError(f"{where}: lock must be a non-empty name, a format string or a callable, not {lock_name!r}")
    mode = options.get("lock_mode")
    if mode is not None and mode not in MODES:
        raise ValueError(f"{where}: mode must be 'read' or 'write', not {mode!r}")
    if options.get("dedupe_enqueue") and mode is not None:
        raise ValueError(f"{where}: dedupe_enqueue is for singleton tasks, not read-write locked ones")
    limit = options.get("limit", 1)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"{where}: limit must be a positive whole number, not {limit!r}")
    if limit > 1 and mode is not None:
        raise ValueError(f"{where}: limit is for limited tasks, not read-write locked ones")
    if limit > 1 and options.get("dedupe_enqueue"):
        raise ValueError(f"{where}: dedupe_enqueue is for singleton tasks (limit 1), not limit {limit}")
    for name in ("reschedule_countdown", "reschedule_max_countdown", "reschedule_for"):
        if name in options:
            check_ttl(options[name], f"{where}: {name}")
    if not isinstance(options.get("hash_key", False), bool):
        raise TypeError(f"{where}: hash_key must be True or False, not {options['hash_key']!r}")


def check_option_names(names: Sequence[str], known: set[str], where: str) -> None:
    """Refuse options from celery-singleton/celery-once and near misses of ours, naming what to use.

    ``known`` holds every other name that may legitimately appear (Celery's own task options).
    """
    ours = [*LOCK_OPTIONS, *DECORATOR_NAMES]
    for name in names:
        if name in MIGRATION_HINTS:
            raise TypeError(f"{where}: {name}= is {MIGRATION_HINTS[name]}")
        if name in ours or name in known or name.startswith("_"):
            continue
        close = difflib.get_close_matches(name, ours, n=1, cutoff=0.8)
        if close:
            raise TypeError(f"{where}: unknown option {name!r}; did you mean {close[0]!r}?")


_checked_classes: weakref.WeakSet[type] = weakref.WeakSet()


def check_class_options(cls: type[Any]) -> None:
    """Check the lock options of a task class (once per class, options inherited or not)."""
    if cls in _checked_classes:
        return
    where = f"task {cls.name or cls.__name__}"
    check_options({k: option(cls, k) for k in LOCK_OPTIONS}, where)
    run = cls.__dict__.get("run")
    if run is not None:
        function = run.__func__ if isinstance(run, staticmethod) else run
        check_key_names(function, not isinstance(run, staticmethod), option(cls, "key"), where)
    _checked_classes.add(cls)


def check_key_names(function: Callable[..., Any], bound: bool, key: Any, where: str) -> None:
    """A ``key`` list must name arguments of ``function`` (after ``self`` if ``bound``)."""
    if not _is_names(key):
        return
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return
    if bound and parameters:
        parameters = parameters[1:]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return
    known = {p.name for p in parameters if p.kind is not inspect.Parameter.VAR_POSITIONAL}
    missing = [n for n in key if n not in known]
    if missing:
        raise ValueError(
            f"{where}: key names {', '.join(map(repr, missing))} that are not arguments of "
            f"{getattr(function, '__qualname__', function)} (it takes {', '.join(sorted(known)) or 'none'})"
        )


def option(owner: object, name: str) -> Any:
    """An option as given: a callable stored as a class attribute must not become a method."""
    value = inspect.getattr_static(owner, name)
    return value.__func__ if isinstance(value, staticmethod) else value


def _is_names(value: object) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(n, str) and n for n in value)


# -- lock names ------------------------------------------------------------------------------


def lock_name_for(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The name of the lock ``task`` takes for a call with these arguments."""
    hashed = bool(option(task, "hash_key"))
    lock_name = option(task, "lock_name")
    if lock_name is not None:
        if isinstance(lock_name, str) and "{" not in lock_name:
            return lock_name  # a fixed name, no arguments in it
        return _hashed(_render(lock_name, task, args, kwargs, "lock"), hashed)
    base = f"task/{task.name}"
    key = option(task, "key")
    if key is None:
        return base
    return f"{base}/{_hashed(_render(key, task, args, kwargs, 'key'), hashed)}"


def _hashed(text: str, hashed: bool) -> str:
    return f"{HASHED}{hashlib.sha256(text.encode('utf-8')).hexdigest()}" if hashed else text


def _render(spec: Any, task: Any, args: tuple[Any, ...], kwargs: dict[str, Any], what: str) -> str:
    """The text of a ``key``/``lock`` option for one call's arguments."""
    if callable(spec) and not isinstance(spec, str):
        text = spec(args, kwargs)
        if not isinstance(text, str) or not text:
            raise TypeError(f"task {task.name}: the {what} callable must return a non-empty str, not {text!r}")
        return text
    arguments = _bind(task, args, kwargs)
    if isinstance(spec, str):
        try:
            text = spec.format(*args, **arguments)
        except (KeyError, IndexError, AttributeError) as exc:
            raise ValueError(f"task {task.name}: {what} {spec!r} names {exc} that the call does not have") from None
        if not text:
            raise ValueError(f"task {task.name}: {what} {spec!r} rendered to an empty name")
        return text
    parts = []
    for name in spec or ():
        if name not in arguments:
            raise ValueError(f"task {task.name}: {what} names argument {name!r} that the call does not have")
        parts.append(f"{name}={json.dumps(arguments[name], sort_keys=True, default=str)}")
    return ",".join(parts)


def _bind(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by parameter name, defaults applied, extra keywords flattened in."""
    signature = _signature(task)
    if signature is None:
        return dict(kwargs)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"task {task.name} called with arguments that do not fit its signature: {exc}") from None
    bound.apply_defaults()
    arguments: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(value)
        elif kind is not inspect.Parameter.VAR_POSITIONAL:
            arguments[name] = value
    return arguments


_signatures: weakref.WeakKeyDictionary[type, inspect.Signature | None] = weakref.WeakKeyDictionary()


def _signature(task: Any) -> inspect.Signature | None:
    cls = type(task)
    if cls not in _signatures:
        try:
            _signatures[cls] = inspect.signature(task.run)
        except (TypeError, ValueError):
            _signatures[cls] = None
    return _signatures[cls]
