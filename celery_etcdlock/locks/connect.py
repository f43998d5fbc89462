"""``connect(url)``: check an etcd URL and build the client for its scheme.

    client = connect("etcd3://127.0.0.1:2379")                # etcd v3 API (the default)
    client = connect("etcd3s://user:pw@h1:2379,h2:2379?ca=/etc/ca.pem")
    client = connect("etcd://127.0.0.1:2379")                 # etcd v2 keys API
    client = connect("memory://")                             # in-process, for tests (memory://NAME: a namespace)

The URL is checked at once (a malformed one raises ``ValueError`` naming the
bad part, with the password masked); the server is not contacted until the
first operation. ``options.SCHEMES`` names the backend of each scheme; it is
imported only when used, so a v3 user never loads the v2 client library.
"""

from __future__ import annotations

import importlib

from ..etcd.base import Backend
from ..options import DEFAULT_URL, SCHEMES, ConnectionOptions, parse_url
from .client import Client


def connect(
    url: str = DEFAULT_URL,
    *,
    retry_max_delay: float | None = None,
    timeout: float | None = None,
    prefix: str | None = None,
) -> Client:
    """A client for the etcd cluster at ``url``; keyword arguments override the URL's query."""
    options = parse_url(url, retry_max_delay=retry_max_delay, timeout=timeout, prefix=prefix)
    return Client(backend_for(options), options)


def backend_for(options: ConnectionOptions) -> Backend:
    module_name, _, class_name = SCHEMES[options.scheme].backend.partition(":")
    backend_class: type[Backend] = getattr(importlib.import_module(module_name), class_name)
    return backend_class(options)
