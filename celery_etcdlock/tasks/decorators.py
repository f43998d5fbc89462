"""The task decorators: ``singleton_task``, ``limited_task`` and ``rwlock_task``.

    from celery_etcdlock import singleton_task, limited_task, rwlock_task

    @singleton_task                                       # one run at a time, cluster-wide
    def rebuild_cache(): ...

    @singleton_task(key=["customer_id"], on_conflict="retry", dedupe_enqueue=True)
    def sync_customer(customer_id, full=False): ...       # one run (and one queued) per customer

    @limited_task(limit=3, key=["tenant"])                # at most 3 at once per tenant
    def render_pdf(tenant, document): ...

    @rwlock_task(lock="search-index", mode="read")        # many readers at once, no writer
    def query_index(q): ...

Each accepts every option ``celery.shared_task`` accepts, ``app=`` to register
on that app, ``base=`` (a Celery task class, which the lock then wraps), and
the lock options; their signatures and docs in ``help()`` come from
``LockOptions``, so they list every option with its default.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar, overload

import celery
from celery import shared_task

from .options import LIMITED, LOCK_OPTIONS, RWLOCK, SINGLETON, LockOptions, check_arguments, check_option_names
from .task import CELERY_NAMES, LimitedTask, RWLockTask, SingletonTask

F = TypeVar("F", bound=Callable[..., Any])


@overload
def singleton_task(fun: F) -> Any: ...
@overload
def singleton_task(
    *, app: celery.Celery | None = None, base: type[celery.Task] | None = None, **options: Any
) -> Callable[[F], Any]: ...
def singleton_task(fun: Callable[..., Any] | None = None, **options: Any) -> Any:
    """Register ``fun`` as a task of which one run (per key) happens at a time, cluster-wide."""
    return _decorator(fun, SingletonTask, options, SINGLETON)


@overload
def limited_task(fun: F) -> Any: ...
@overload
def limited_task(
    *, limit: int, app: celery.Celery | None = None, base: type[celery.Task] | None = None, **options: Any
) -> Callable[[F], Any]: ...
def limited_task(fun: Callable[..., Any] | None = None, **options: Any) -> Any:
    """Register ``fun`` as a task of which at most ``limit`` runs (per key) happen at once, cluster-wide."""
    if fun is not None or "limit" not in options:
        raise TypeError("limited_task needs limit=: use @limited_task(limit=3, ...)")
    return _decorator(None, LimitedTask, options, LIMITED)


@overload
def rwlock_task(fun: F) -> Any: ...
@overload
def rwlock_task(
    *, lock: Any, mode: str, app: celery.Celery | None = None, base: type[celery.Task] | None = None, **options: Any
) -> Callable[[F], Any]: ...
def rwlock_task(fun: Callable[..., Any] | None = None, **options: Any) -> Any:
    """Register ``fun`` as a task that runs under the ``mode`` side of the read-write lock ``lock``."""
    if fun is not None:
        raise TypeError("rwlock_task needs lock= and mode=: use @rwlock_task(lock=..., mode=...)")
    for required in ("lock", "mode"):
        if required not in options:
            raise TypeError(f"rwlock_task() missing the {required}= argument")
    if "dedupe_enqueue" in options:
        raise TypeError("rwlock_task does not take dedupe_enqueue (readers with one lock are not duplicates)")
    options["lock_name"] = options.pop("lock")
    options["lock_mode"] = options.pop("mode")
    return _decorator(None, RWLockTask, options, RWLOCK)


def _decorator(
    fun: Callable[..., Any] | None, default_base: type[LimitedTask], options: dict[str, Any], what: str
) -> Any:
    app = options.pop("app", None)
    base = options.pop("base", None) or default_base
    if not isinstance(base, type) or not issubclass(base, celery.Task):
        raise TypeError(f"{what}(base=...) must be a celery Task subclass, not {base!r}")
    if not issubclass(base, LimitedTask):
        # keep the user's base behaviour and add the lock around it
        base = type(f"{default_base.__name__}{base.__name__}", (default_base, base), {})
    check_option_names(list(options), CELERY_NAMES, what)
    lock_options = LockOptions.checked({k: options[k] for k in LOCK_OPTIONS if k in options}, what)

    def register(function: Callable[..., Any]) -> Any:
        if not callable(function):
            raise TypeError(f"{what} decorates a function, not {function!r}")
        check_arguments(function, bool(options.get("bind")), lock_options, what)
        if app is not None:
            return app.task(base=base, **options)(function)
        return shared_task(base=base, **options)(function)

    return register(fun) if fun is not None else register


# -- what help() shows: derived from LockOptions -------------------------------------------------------


def _derive(decorator: Callable[..., Any], base: type[LimitedTask], takes_fun: bool, required: set[str]) -> None:
    """Give ``decorator`` the signature and docs of the lock options it shows, with ``base``'s defaults."""
    parameter = inspect.Parameter
    defaults = {name: getattr(base, name) for name in LOCK_OPTIONS}
    shown = [
        p.replace(default=parameter.empty) if p.name in required else p
        for p in LockOptions.parameters(decorator.__name__, defaults)
    ]
    shown.sort(key=lambda p: p.default is not parameter.empty)  # the required ones first
    extra = [
        parameter("app", parameter.KEYWORD_ONLY, default=None, annotation="celery.Celery | None"),
        parameter("base", parameter.KEYWORD_ONLY, default=None, annotation="type[celery.Task] | None"),
        parameter("options", parameter.VAR_KEYWORD, annotation="Any"),
    ]
    fun = [parameter("fun", parameter.POSITIONAL_ONLY, default=None)] if takes_fun else []
    decorator.__signature__ = inspect.Signature([*fun, *shown, *extra])  # type: ignore[attr-defined]
    decorator.__doc__ = (
        f"{decorator.__doc__}\n\n"
        f"Accepts every option ``celery.shared_task`` accepts, ``app=`` to register on that app,\n"
        f"``base=`` (a Celery task class, which the lock then wraps), and these lock options\n"
        f"(the others of ``{LimitedTask.__name__}`` are accepted too):\n\n"
        f"{LockOptions.documented(decorator.__name__)}\n"
    )


_derive(singleton_task, SingletonTask, takes_fun=True, required=set())
_derive(limited_task, LimitedTask, takes_fun=False, required={"limit"})
_derive(rwlock_task, RWLockTask, takes_fun=False, required={"lock", "mode"})
