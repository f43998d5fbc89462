"""The ``etcdlock_*`` settings, read from a Celery app's configuration.

    app.conf.etcdlock_url = "etcd3://etcd-1:2379,etcd-2:2379"
    client = client_for(app)      # one per process and configuration, created lazily

| setting                    | default                 |
| -------------------------- | ----------------------- |
| ``etcdlock_url``           | ``etcd3://127.0.0.1:2379`` |
| ``etcdlock_prefix``        | the URL's ``?prefix=``, else ``/celery-etcdlock`` |
| ``etcdlock_ttl``           | ``30`` (seconds)        |
| ``etcdlock_beat_ttl``      | ``10`` (seconds)        |
| ``etcdlock_retry_max_delay`` | the URL's ``?retry_max_delay=``, else ``30`` (seconds) |
| ``etcdlock_beat_name``     | the app's main name     |

The client is shared by every task and the beat scheduler of the process; it
rebuilds its connections and sessions by itself in a forked child.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from .client import Client
from .connect import connect
from .options import DEFAULT_URL, check_seconds, check_ttl

DEFAULTS: dict[str, Any] = {
    "etcdlock_url": DEFAULT_URL,
    "etcdlock_prefix": None,  # the URL's ?prefix=, else DEFAULT_PREFIX
    "etcdlock_ttl": 30,
    "etcdlock_beat_ttl": 10,
    "etcdlock_retry_max_delay": None,  # the URL's ?retry_max_delay=, else DEFAULT_RETRY_MAX_DELAY
    "etcdlock_beat_name": None,  # the app's main name, else "celery"
}


@dataclass(frozen=True)
class Settings:
    url: str
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

        return cls(
            url=str(get("etcdlock_url")),
            prefix=None if get("etcdlock_prefix") is None else str(get("etcdlock_prefix")),
            ttl=check_ttl(get("etcdlock_ttl"), "etcdlock_ttl"),
            beat_ttl=check_ttl(get("etcdlock_beat_ttl"), "etcdlock_beat_ttl"),
            retry_max_delay=_seconds(get("etcdlock_retry_max_delay"), "etcdlock_retry_max_delay"),
            beat_name=str(get("etcdlock_beat_name") or app.main or "celery"),
        )


def _seconds(value: object, name: str) -> float | None:
    return None if value is None else check_seconds(value, name)


_clients: dict[tuple[str, str | None, float | None], Client] = {}
_clients_lock = threading.Lock()


def client_for(app: Any) -> Client:
    """The process's client for ``app``'s settings, created on first use."""
    settings = Settings.from_app(app)
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
