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

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any

from . import masking, metrics
from .errors import BackendUnavailable, InvalidUse
from .locks.client import Client
from .locks.connect import connect
from .options import DEFAULT_URL, check_seconds, check_ttl, redact

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
    if any(masking.is_etcdlock_url(key) for key in app.conf.without_defaults()):
        return True
    return any(getattr(type(task), "etcdlock_locked", False) for task in app.tasks.values())


LEADER_SCHEDULER = "celery_etcdlock.beat:LeaderScheduler"


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
