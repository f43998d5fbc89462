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
import re
import string
import weakref
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any, TypeGuard, TypeVar

from ..options import check_seconds, check_ttl
from .conflict import POLICIES, Policy

T = TypeVar("T")

HASHED = "sha256:"  # what a hashed key starts with
MODES = ("read", "write")

NameFunction = Callable[[tuple[Any, ...], dict[str, Any]], str]
KeySpec = str | Sequence[str] | NameFunction | None

#: which decorator shows an option in its signature and docstring (every one accepts them all)
SINGLETON, LIMITED, RWLOCK = "singleton_task", "limited_task", "rwlock_task"
EVERY = frozenset({SINGLETON, LIMITED, RWLOCK})


# -- checks of one option --------------------------------------------------------------------------

Check = Callable[[Any, str], None]  # (value, "where: name") -> None, or TypeError/ValueError naming it


def _key(key: object, where: str) -> None:
    if key is not None and not (isinstance(key, str) or callable(key) or _is_names(key)):
        raise TypeError(f"{where} must be None, a list of argument names, a format string or a callable, not {key!r}")
    if isinstance(key, str) and not key:
        raise ValueError(f"{where} must not be an empty string")


def _ttl_or_none(value: object, where: str) -> None:
    if value is not None:
        check_ttl(value, where)


def _seconds_or_none(value: object, where: str) -> None:
    if value is not None:
        check_seconds(value, where)


def _seconds(value: object, where: str) -> None:
    check_seconds(value, where)


def _ttl(value: object, where: str) -> None:
    check_ttl(value, where)


def _on_conflict(value: object, where: str) -> None:
    if value not in ON_CONFLICT:
        raise ValueError(f"{where} must be one of {', '.join(map(repr, ON_CONFLICT))}, not {value!r}")


def _flag(value: object, where: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{where} must be True or False, not {value!r}")


def _limit(value: object, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where} must be a positive whole number, not {value!r}")


def _lock_name(value: object, where: str) -> None:
    if not (isinstance(value, str) and value) and not callable(value) and value is not None:
        raise TypeError(f"{where} must be a non-empty name, a format string or a callable, not {value!r}")


def _mode(value: object, where: str) -> None:
    if value is not None and value not in MODES:
        raise ValueError(f"{where} must be 'read' or 'write', not {value!r}")


def _option(default: Any, check: Check, doc: str, shown: AbstractSet[str] = EVERY, given_as: str = "") -> Any:
    """A field of ``LockOptions``: its default, its check, one line of docs, and which decorators show it."""
    return field(
        default=default, metadata={"check": check, "doc": doc, "shown": frozenset(shown), "given_as": given_as}
    )


# -- the one list of lock options --------------------------------------------------------------------


@dataclass(frozen=True)
class LockOptions:
    """The lock options of a locked task: the one list that the task classes' attributes and
    defaults, the decorators' signatures and docs, and every check derive from.

        options = options_of(type(task))           # checked, once per task class
        options.on_conflict, options.lock_ttl

    Adding an option is adding a field here (its default, its check, its line of docs);
    the run life cycle then reads it from ``options``.
    """

    limit: int = _option(
        1, _limit, "how many runs at once (1: a singleton, under a ``Mutex``; more: under a ``Semaphore``)", {LIMITED}
    )
    key: KeySpec = _option(
        None,
        _key,
        "None (the lock holds for the whole task), a list of argument names, a format string over the "
        "arguments, or ``callable(args, kwargs) -> str``",
        {SINGLETON, LIMITED},
    )
    lock_ttl: float | None = _option(
        None, _ttl_or_none, "seconds a dead worker keeps its lock (default ``etcdlock_ttl``)"
    )
    on_conflict: str = _option(
        "wait",
        _on_conflict,
        'what a run that finds the lock taken does: ``"skip"``, ``"raise"`` (``TaskLocked``), '
        '``"retry"``, ``"wait"`` or ``"reschedule"``',
    )
    lock_timeout: float | None = _option(
        None, _seconds_or_none, 'how long ``"wait"`` waits (None: as long as it takes)'
    )
    retry_countdown: float = _option(5.0, _seconds, 'the countdown of ``"retry"``, in seconds')
    reschedule_countdown: float = _option(
        1.0, _ttl, '``"reschedule"`` sends the task again after this many seconds, doubling (with jitter)'
    )
    reschedule_max_countdown: float = _option(60.0, _ttl, "... up to this many")
    reschedule_for: float = _option(
        3600.0,
        _ttl,
        "... for at most this many seconds since the first attempt (a reschedule does not count towards "
        "``max_retries``)",
    )
    dedupe_enqueue: bool = _option(
        False,
        _flag,
        "return the queued or running instance's AsyncResult instead of queueing another (singletons only)",
        {SINGLETON},
    )
    dedupe_ttl: float = _option(
        3600.0, _ttl, "the queued marker expires after this many seconds (plus any countdown/ETA)", {SINGLETON}
    )
    lock_name: str | NameFunction | None = _option(
        None,
        _lock_name,
        "the lock's name: a name, a format string over the arguments, or ``callable(args, kwargs) -> str``",
        {RWLOCK},
        given_as="lock",
    )
    lock_mode: str | None = _option(
        None, _mode, '``"read"`` (many at once) or ``"write"`` (alone); None: exclusive', {RWLOCK}, "mode"
    )
    hash_key: bool = _option(False, _flag, "put the SHA-256 of the key in the lock's name, not the argument values")

    @cached_property
    def policy(self) -> Policy:
        """What a run does when it finds its lock taken, chosen once from ``on_conflict``."""
        return POLICIES[self.on_conflict]

    @classmethod
    def checked(cls, options: Mapping[str, Any], where: str) -> LockOptions:
        """``options`` (a subset of the fields; the rest default) as ``LockOptions``, or the error naming
        the first bad one, by the name its user gave it (``lock=``, ``mode=`` for ``lock_name``, ``lock_mode``)."""
        for f in fields(cls):
            if f.name in options:
                f.metadata["check"](options[f.name], f"{where}: {f.metadata['given_as'] or f.name}")
        checked = cls(**options)
        checked._check_together(where)
        return checked

    def _check_together(self, where: str) -> None:
        if self.dedupe_enqueue and self.lock_mode is not None:
            raise ValueError(f"{where}: dedupe_enqueue is for singleton tasks, not read-write locked ones")
        if self.limit > 1 and self.lock_mode is not None:
            raise ValueError(f"{where}: limit is for limited tasks, not read-write locked ones")
        if self.limit > 1 and self.dedupe_enqueue:
            raise ValueError(f"{where}: dedupe_enqueue is for singleton tasks (limit 1), not limit {self.limit}")

    @classmethod
    def documented(cls, shown: str | None = None) -> str:
        """The options as a docstring list: those the decorator ``shown`` shows, by the names it takes them
        under; else all of them, by their names as class attributes."""
        lines = []
        for f in fields(cls):
            given_as = f.metadata["given_as"]
            if shown is None:
                also = f" (``{given_as}=`` of ``rwlock_task``)" if given_as else ""
                lines.append(f"- ``{f.name}``{also}: {f.metadata['doc']}")
            elif shown in f.metadata["shown"]:
                lines.append(f"- ``{given_as or f.name}``: {f.metadata['doc']}")
        return "\n".join(lines)

    @classmethod
    def parameters(cls, shown: str, defaults: Mapping[str, Any]) -> list[inspect.Parameter]:
        """The keyword parameters a decorator shows in ``help()``, with its own ``defaults``."""
        keyword = inspect.Parameter.KEYWORD_ONLY
        return [
            inspect.Parameter(
                f.metadata["given_as"] or f.name,
                keyword,
                default=defaults.get(f.name, f.default),
                annotation=f.type,
            )
            for f in fields(cls)
            if shown in f.metadata["shown"]
        ]


ON_CONFLICT = tuple(POLICIES)  # "skip", "raise", "retry", "wait", "reschedule"
LOCK_OPTIONS = tuple(f.name for f in fields(LockOptions))
#: the decorators' names for options the task classes keep under another name
DECORATOR_NAMES = {f.metadata["given_as"]: f.name for f in fields(LockOptions) if f.metadata["given_as"]}


def with_lock_options(cls: type[T]) -> type[T]:
    """Give a task class every lock option as a class attribute, at its default (a class decorator)."""
    for f in fields(LockOptions):
        if f.name not in cls.__dict__:
            setattr(cls, f.name, f.default)
    return cls


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


# -- checks ---------------------------------------------------------------------------------------------


def check_options(options: dict[str, Any], where: str) -> None:
    """Raise TypeError/ValueError naming the first bad lock option of ``options``."""
    LockOptions.checked(options, where)


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


_options_of: weakref.WeakKeyDictionary[type, LockOptions] = weakref.WeakKeyDictionary()


def options_of(cls: type[Any]) -> LockOptions:
    """The lock options of a task class (inherited or not), checked once per class."""
    options = _options_of.get(cls)
    if options is None:
        where = f"task {cls.name or cls.__name__}"
        options = LockOptions.checked({k: option(cls, k) for k in LOCK_OPTIONS}, where)
        run = cls.__dict__.get("run")
        if run is not None:
            function = run.__func__ if isinstance(run, staticmethod) else run
            check_arguments(function, not isinstance(run, staticmethod), options, where)
        _options_of[cls] = options
    return options


def check_class_options(cls: type[Any]) -> None:
    """Check the lock options of a task class (once per class, options inherited or not)."""
    options_of(cls)


def check_arguments(function: Callable[..., Any], bound: bool, options: LockOptions, where: str) -> None:
    """The arguments ``key`` and ``lock_name`` name must be arguments of ``function`` (after ``self`` if
    ``bound``), and a plain string ``key`` must not be an argument's name: it would be a constant."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return
    if bound and parameters:
        parameters = parameters[1:]
    arguments = _Arguments(function, parameters)
    key = options.key
    if _is_names(key):
        arguments.check(list(key), f"{where}: key names")
    elif isinstance(key, str) and "{" not in key:
        arguments.refuse_constant(key, where)
    if isinstance(key, str) and "{" in key:
        arguments.check_format(key, f"{where}: key")
    if isinstance(options.lock_name, str) and "{" in options.lock_name:
        arguments.check_format(options.lock_name, f"{where}: lock")


class _Arguments:
    """The parameters of a task's function, as ``key`` and ``lock`` may name them."""

    def __init__(self, function: Callable[..., Any], parameters: list[inspect.Parameter]) -> None:
        self.function = getattr(function, "__qualname__", function)
        kinds = {p.kind for p in parameters}
        self.any_keyword = inspect.Parameter.VAR_KEYWORD in kinds
        self.any_positional = inspect.Parameter.VAR_POSITIONAL in kinds
        self.names = {p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        self.positional = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters)

    def check(self, names: list[str], what: str) -> None:
        missing = [n for n in names if n not in self.names]
        if missing and not self.any_keyword:
            raise ValueError(
                f"{what} {', '.join(map(repr, missing))} that are not arguments of {self.function} "
                f"(it takes {', '.join(sorted(self.names)) or 'none'})"
            )

    def check_format(self, spec: str, what: str) -> None:
        try:
            fields_ = [name for _, name, _, _ in string.Formatter().parse(spec) if name is not None]
        except ValueError as exc:
            raise ValueError(f"{what} {spec!r} is not a valid format string: {exc}") from None
        names, automatic = [], 0
        for name in fields_:
            first = re.split(r"[.\[]", name, maxsplit=1)[0]
            if first == "" or first.isdigit():
                index = int(first) if first else automatic
                automatic += not first
                if index >= self.positional and not self.any_positional:
                    raise ValueError(
                        f"{what} {spec!r} names positional argument {index}, but {self.function} takes "
                        f"{self.positional} positional argument{'s' if self.positional != 1 else ''}"
                    )
            else:
                names.append(first)
        self.check(names, f"{what} {spec!r} names")

    def refuse_constant(self, key: str, where: str) -> None:
        """``key="customer_id"`` locks every call under one key: it is surely meant per argument."""
        named = [n for n in re.split(r"[\s,]+", key.strip()) if n]
        if named and all(n in self.names for n in named):
            as_list = "[" + ", ".join(f'"{n}"' for n in named) + "]"
            as_format = ":".join(f"{{{n}}}" for n in named)
            raise ValueError(
                f"{where}: key {key!r} is a constant, the same for every call, but names "
                f"{'an argument' if len(named) == 1 else 'arguments'} of {self.function}: to lock per "
                f'{" and ".join(named)}, write key={as_list} or key="{as_format}"'
            )


def option(owner: object, name: str) -> Any:
    """An option as given: a callable stored as a class attribute must not become a method."""
    value = inspect.getattr_static(owner, name)
    return value.__func__ if isinstance(value, staticmethod) else value


def _is_names(value: object) -> TypeGuard[Sequence[str]]:
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
