"""The ``etcdlock_*`` settings, read from a Celery app's configuration.

    app.conf.etcdlock_url = "etcd3://etcd-1:2379,etcd-2:2379"
    client = client_for(app)      # one per process and configuration, created lazily

| setting                      | default                                                         |
| ---------------------------- | --------------------------------------------------------------- |
| ``etcdlock_url``             | ``etcd3://127.0.0.1:2379``                                      |
| ``etcdlock_prefix``          | the URL's ``?prefix=``, else ``/celery-etcdlock``               |
| ``etcdlock_ttl``             | ``30`` (seconds)                                                |
| ``etcdlock_beat_ttl``        | ``10`` (seconds)                                                |
| ``etcdlock_retry_max_delay`` | the URL's ``?retry_max_delay=``, else ``30`` s (``5`` s while   |
|                              | ``etcdlock_url`` is not set: a first try should fail fast)      |
| ``etcdlock_beat_name``       | the app's main name                                             |
| ``etcdlock_metrics``         | ``True``: Prometheus metrics on in workers and beats when       |
|                              | prometheus_client is installed; ``False``: never                |
| ``etcdlock_metrics_registry``| ``None``: prometheus_client's default ``REGISTRY``; or a        |
|                              | ``CollectorRegistry`` to register them on                       |

With Django's ``CELERY`` namespace the same settings are ``CELERY_ETCDLOCK_URL``
and so on. The client is shared by every task and the beat scheduler of the
process; it rebuilds its connections and sessions by itself in a forked child.

A worker turns the metrics on at its start (``worker_init``, before its pool
forks: tasks/worker.py holds every hook), a ``LeaderScheduler`` beat when it is created; see
``celery_etcdlock.metrics``. Without prometheus_client, nothing is imported.

Importing the package teaches Celery to mask the password of ``etcdlock_url``
wherever it shows settings (``celery report``, ``celery inspect conf``,
``app.bugreport()``), as it masks ``broker_url``: see masking.py.
"""

from __future__ import annotations

import difflib
import logging
import os
import socket
import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, NoReturn

from . import masking, metrics
from .errors import BackendUnavailable, InvalidUse
from .locks.client import Client
from .locks.connect import connect
from .options import DEFAULT_URL, check_prefix, check_seconds, check_ttl, parse_url, redact

DEFAULTS: dict[str, Any] = {
    "etcdlock_url": DEFAULT_URL,
    "etcdlock_prefix": None,  # the URL's ?prefix=, else DEFAULT_PREFIX
    "etcdlock_ttl": 30,
    "etcdlock_beat_ttl": 10,
    "etcdlock_retry_max_delay": None,  # the URL's ?retry_max_delay=, else DEFAULT_RETRY_MAX_DELAY
    "etcdlock_beat_name": None,  # the app's main name, else "celery"
    "etcdlock_metrics": True,  # when prometheus_client is installed
    "etcdlock_metrics_registry": None,  # prometheus_client.REGISTRY
}

#: how long to keep trying the default etcd when no etcdlock_url is set: a first try on a laptop should fail fast
UNSET_URL_RETRY_MAX_DELAY = 5.0

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Settings:
    url: str = field(repr=False)  # may hold a password: shown only through redact()
    url_is_set: bool
    prefix: str | None
    ttl: float
    beat_ttl: float
    retry_max_delay: float | None
    beat_name: str

    @classmethod
    def from_app(cls, app: Any) -> Settings:
        conf = app.conf

        def get(name: str) -> Any:
            value = conf.get(name)
            return DEFAULTS[name] if value is None else value

        url = conf.get("etcdlock_url")
        if url is not None and not isinstance(url, str):
            raise TypeError(f"etcdlock_url must be a str such as 'etcd3://host:2379', not {type(url).__name__}")
        retry_max_delay = _seconds(get("etcdlock_retry_max_delay"), "etcdlock_retry_max_delay")
        if url is None and retry_max_delay is None:
            retry_max_delay = UNSET_URL_RETRY_MAX_DELAY
        return cls(
            url=url if url is not None else DEFAULT_URL,
            url_is_set=url is not None,
            prefix=None if get("etcdlock_prefix") is None else str(get("etcdlock_prefix")),
            ttl=check_ttl(get("etcdlock_ttl"), "etcdlock_ttl"),
            beat_ttl=check_ttl(get("etcdlock_beat_ttl"), "etcdlock_beat_ttl"),
            retry_max_delay=retry_max_delay,
            beat_name=str(get("etcdlock_beat_name") or app.main or "celery"),
        )

    @property
    def shown_url(self) -> str:
        return redact(self.url)

    def explain(self, error: BackendUnavailable) -> BackendUnavailable:
        """``error`` with the setting that says where etcd is named in it."""
        if self.url_is_set:
            hint = f"etcdlock_url is {self.shown_url}"
        else:
            hint = (
                f"etcdlock_url is not set, so the default {DEFAULT_URL} was tried: set app.conf.etcdlock_url "
                "(CELERY_ETCDLOCK_URL with Django) to your etcd, or 'memory://' in tests"
            )
        explained = BackendUnavailable(f"{error} ({hint})", endpoints=error.endpoints)
        explained.__cause__ = error.__cause__
        return explained


def _seconds(value: object, name: str) -> float | None:
    return None if value is None else check_seconds(value, name)


_clients: dict[tuple[str, str | None, float | None], Client] = {}
_clients_lock = threading.Lock()
_loaded_in = os.getpid()  # a pool process forked from the worker that loaded this module has another pid
_pool_child_pid: int | None = None  # this process's pid once Celery started it as a (forked) pool process


def note_pool_process() -> None:
    """Called when Celery starts a pool process (``worker_process_init``, see tasks/worker.py)."""
    global _pool_child_pid
    if os.getpid() != _loaded_in:  # the solo pool sends the signal too, in the worker's own process
        _pool_child_pid = os.getpid()


def client_for(app: Any, settings: Settings | None = None) -> Client:
    """The process's client for ``app``'s settings, created on first use."""
    settings = settings or Settings.from_app(app)
    if _pool_child_pid == os.getpid() and settings.url.startswith("memory:"):
        # each pool process would have a memory:// of its own, and their locks would not exclude each other
        raise InvalidUse(
            f"etcdlock_url is {settings.shown_url}, which lives in one process, and this is a prefork pool "
            f"process (pid {_pool_child_pid}): its locks would not exclude those of the other pool processes. "
            "Use a real etcd (celery_etcdlock.testing's etcd_server fixture starts one), or the solo or threads pool"
        )
    key = (settings.url, settings.prefix, settings.retry_max_delay)
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            try:
                client = connect(settings.url, prefix=settings.prefix, retry_max_delay=settings.retry_max_delay)
            except (ValueError, TypeError) as exc:
                raise type(exc)(f"etcdlock_url / etcdlock_prefix: {exc}") from None
            _clients[key] = client
        return client


# -- keeping the password out of Celery's settings dumps (masking.py; the package's import installs it too) --

masking.install()


# -- a beat without the leader scheduler ---------------------------------------------------------


def uses_etcdlock(app: Any) -> bool:
    """Whether ``app`` is configured for celery_etcdlock or has tasks of ours (this package may just be installed)."""
    if any(isinstance(key, str) and "etcdlock" in key.lower() for key in app.conf.without_defaults()):
        return True
    return any(getattr(type(task), "etcdlock_locked", False) for task in app.tasks.values())


LEADER_SCHEDULER = "celery_etcdlock.beat:LeaderScheduler"


# -- the check at a worker's and a beat's start ---------------------------------------------------

#: settings of the libraries this package replaces (docs/migrating.md), and what to set instead
REPLACED: dict[str, str] = {
    "singleton_backend_url": "etcdlock_url",
    "singleton_key_prefix": "etcdlock_prefix",
    "singleton_lock_expiry": "the task option lock_ttl= (or etcdlock_ttl for every task)",
    "singleton_raise_on_duplicate": 'the task option on_conflict="raise"',
    "once": "etcdlock_url (celery-once's ONCE; its task options map to singleton_task's, see docs/migrating.md)",
    "redbeat_redis_url": "etcdlock_url, with beat_scheduler = 'celery_etcdlock.beat:LeaderScheduler'",
    "redbeat_key_prefix": "etcdlock_prefix, and etcdlock_beat_name to run several beats apart",
    "redbeat_lock_key": "etcdlock_beat_name",
    "redbeat_lock_timeout": "etcdlock_beat_ttl",
}

#: a start check's probe: seconds to wait for each endpoint to accept a connection
PROBE_TIMEOUT = 1.0


class SettingsError(ValueError):
    """A setting that makes every locked task fail: a worker or beat that has it does not start."""


def _bare(key: str, namespace: str | None) -> str:
    """``CELERY_ETCDLOCK_TTL`` (Django's namespace) as ``etcdlock_ttl``."""
    name = key.lower()
    prefix = f"{namespace.lower()}_" if namespace else ""
    return name[len(prefix) :] if prefix and name.startswith(prefix) else name


def check(app: Any) -> tuple[Settings, list[str]]:
    """``app``'s settings, checked as a worker's or beat's start checks them, and the warnings to log.

    Refused (``SettingsError`` naming the setting, no etcd contacted): a wrong type or value
    (``etcdlock_ttl="30"``), a bad ``etcdlock_url``, and a name one typo away from one of ours
    (``etcdlock_tll``): each would leave every locked task failing, or running with a setting the
    user did not mean, while the worker looks healthy. Warned about: an ``etcdlock_*`` name close
    to none of ours (a newer version's setting in a shared configuration must not stop older
    workers during a rolling upgrade), and the settings of celery-singleton, celery-once and
    RedBeat, named with their replacement (a migration may run both libraries for a while).
    """
    namespace = getattr(app, "namespace", None)
    warnings = []
    for key in app.conf.without_defaults():
        if not isinstance(key, str):
            continue
        name = _bare(key, namespace)
        if name in DEFAULTS:
            continue
        if name in REPLACED:
            warnings.append(f"{key} is a setting of another library, not of celery_etcdlock: use {REPLACED[name]}")
        elif name.startswith("etcdlock_") or difflib.get_close_matches(name, DEFAULTS, n=1, cutoff=0.85):
            near = difflib.get_close_matches(name, DEFAULTS, n=1, cutoff=0.8)
            if near:
                raise SettingsError(f"{key} is not a setting of celery_etcdlock: did you mean {near[0]}?")
            warnings.append(f"{key} is not a setting of this version of celery_etcdlock; ignored")
    try:
        settings = Settings.from_app(app)
        enabled = app.conf.get("etcdlock_metrics")
        if enabled is not None and not isinstance(enabled, bool):
            raise TypeError(f"etcdlock_metrics must be True or False, not {enabled!r}")
        if settings.prefix is not None:
            check_prefix(settings.prefix)
        parse_url(settings.url, prefix=settings.prefix, retry_max_delay=settings.retry_max_delay)
    except (TypeError, ValueError) as exc:
        raise SettingsError(str(exc) if str(exc).startswith("etcdlock_") else f"etcdlock_url: {exc}") from None
    return settings, warnings


def unreachable(settings: Settings, timeout: float = PROBE_TIMEOUT) -> str | None:
    """Why no endpoint of ``settings.url`` accepts a connection, or None if one does (or it is memory://)."""
    options = parse_url(settings.url, prefix=settings.prefix)
    if options.api == "memory":
        return None
    failures = []
    for host, port in options.endpoints:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            return None
        except OSError as exc:
            failures.append(f"{host}:{port}: {exc.strerror or exc}")
    return "; ".join(failures)


_checked: weakref.WeakSet[Any] = weakref.WeakSet()  # the apps checked (a LeaderScheduler checks, then beat_init)


#: the exit status of a start refused for its configuration (sysexits.h's EX_CONFIG)
EX_CONFIG = getattr(os, "EX_CONFIG", 78)


def refuse_start(line: str) -> NoReturn:
    """Stop a worker's or beat's start with ``line`` (what is wrong, what to do) and status 78, no traceback."""
    if logging.getLogger().handlers:
        logger.error("%s", line)
    else:  # a beat creates its scheduler once before it sets up logging (for its banner)
        print(line, file=sys.stderr, flush=True)
    raise SystemExit(EX_CONFIG) from None


def check_at_start(app: Any, role: str) -> Settings | None:
    """Check ``app``'s settings as ``role`` (``"worker"``, ``"beat"``) starts: log the warnings, or refuse to start.

    A refused start logs one ERROR line naming the setting and exits with status 78
    (``EX_CONFIG``), without a traceback. Apps that do not use this package are left alone.
    """
    if app in _checked or not uses_etcdlock(app):
        return None
    _checked.add(app)
    try:
        settings, warnings = check(app)
    except SettingsError as exc:
        refuse_start(f"celery_etcdlock: the {role} does not start: {exc}")
    for warning in warnings:
        logger.warning("celery_etcdlock: %s", warning)
    return settings


def probe(settings: Settings, role: str) -> None:
    """One line if no endpoint of etcd accepts a connection, at a worker's start.

    In the worker's main process before its pool forks, so no thread: a thread of ours alive at
    the fork is what prefork must never see (tests/test_fork_safety.py). A refused connection
    answers at once; a black-holed endpoint costs at most ``PROBE_TIMEOUT`` of the start.
    """
    why = unreachable(settings)
    if why is None:
        logger.debug("celery_etcdlock: etcd at %s accepts connections", settings.shown_url)
        return
    logger.warning(
        "celery_etcdlock: etcd is unreachable at this %s's start (etcdlock_url is %s: %s); locked tasks fail "
        "until it answers, and the %s goes on serving its other tasks",
        role,
        settings.shown_url,
        why,
        role,
    )


# -- metrics: on in workers and beats, as the settings say ----------------------------------------


def enable_metrics(app: Any) -> bool:
    """Turn the metrics on in this process if ``app``'s settings want them and prometheus_client is installed."""
    conf = app.conf
    wanted = conf.get("etcdlock_metrics")
    wanted = DEFAULTS["etcdlock_metrics"] if wanted is None else wanted
    if not isinstance(wanted, bool):
        raise TypeError(f"etcdlock_metrics must be True or False, not {wanted!r}")
    if not wanted:
        return False
    try:
        metrics.enable(registry=conf.get("etcdlock_metrics_registry"))
    except ImportError:
        logger.debug("prometheus_client is not installed: no celery_etcdlock metrics")
        return False
    except TypeError as exc:
        raise TypeError(f"etcdlock_metrics_registry: {exc}") from None
    return True
