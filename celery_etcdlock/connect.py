"""``connect(url)``: parse an etcd URL and choose the backend for its scheme.

    client = connect("etcd://127.0.0.1:2379")                 # etcd v2 keys API
    client = connect("etcd3s://user:pw@h1:2379,h2:2379?ca=/etc/ca.pem")

The URL is checked at once (a malformed one raises ``ValueError`` naming the
bad part); the server is not contacted until the first operation.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote

from .client import Client

DEFAULT_PREFIX = "/celery-etcdlock"
DEFAULT_PORT = 2379
DEFAULT_TIMEOUT = 5.0
DEFAULT_RETRY_MAX_DELAY = 30.0

_SCHEMES = {
    "etcd": ("v2", False),
    "etcds": ("v2", True),
    "etcd3": ("v3", False),
    "etcd3s": ("v3", True),
}
_QUERY_OPTIONS = ("prefix", "timeout", "retry_max_delay", "ca", "cert", "key")


@dataclass(frozen=True)
class ConnectionOptions:
    """Everything a backend needs to know, parsed and checked."""

    api: str  # "v2" or "v3"
    tls: bool
    endpoints: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None
    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    prefix: str = DEFAULT_PREFIX
    timeout: float = DEFAULT_TIMEOUT
    retry_max_delay: float = DEFAULT_RETRY_MAX_DELAY

    @property
    def endpoint_urls(self) -> tuple[str, ...]:
        scheme = "https" if self.tls else "http"
        return tuple(f"{scheme}://{_host_for_url(h)}:{p}" for h, p in self.endpoints)


def connect(
    url: str = "etcd://127.0.0.1:2379",
    *,
    retry_max_delay: float | None = None,
    timeout: float | None = None,
    prefix: str | None = None,
) -> Client:
    """A client for the etcd cluster at ``url``; keyword arguments override the URL's query."""
    options = parse_url(url, retry_max_delay=retry_max_delay, timeout=timeout, prefix=prefix)
    if options.api == "v2":
        from .backends.etcd2 import Etcd2Backend

        return Client(Etcd2Backend(options), options)
    from .backends.etcd3 import Etcd3Backend

    return Client(Etcd3Backend(options), options)


def parse_url(
    url: str,
    *,
    retry_max_delay: float | None = None,
    timeout: float | None = None,
    prefix: str | None = None,
) -> ConnectionOptions:
    if not isinstance(url, str):
        raise TypeError(f"etcd URL must be a str, not {type(url).__name__}")
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"etcd URL {url!r} has no scheme: expected etcd://, etcds://, etcd3:// or etcd3s://")
    if scheme not in _SCHEMES:
        raise ValueError(
            f"unknown scheme {scheme!r} in etcd URL {_redact(url)!r}: expected etcd:// or etcds:// "
            "(etcd v2 API), etcd3:// or etcd3s:// (etcd v3 API)"
        )
    api, tls = _SCHEMES[scheme]
    netloc, _, query = rest.partition("?")
    netloc, _, path = netloc.partition("/")
    if path:
        raise ValueError(f"etcd URL {_redact(url)!r} has a path {'/' + path!r}; set the key prefix with ?prefix=")
    credentials, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, pw = credentials.partition(":")
        if not user or not colon:
            raise ValueError("etcd URL credentials must be given as user:password@")
        username, password = unquote(user), unquote(pw)
    endpoints = tuple(_parse_endpoint(h) for h in hosts.split(","))

    params: dict[str, str] = {}
    for name, value in parse_qsl(query, keep_blank_values=True, strict_parsing=False):
        if name not in _QUERY_OPTIONS:
            raise ValueError(f"unknown option {name!r} in etcd URL; known options: {', '.join(_QUERY_OPTIONS)}")
        params[name] = value

    ca, cert, key = params.get("ca"), params.get("cert"), params.get("key")
    if not tls and (ca or cert or key):
        raise ValueError(f"TLS options (ca, cert, key) need the TLS scheme {scheme}s://, not {scheme}://")
    if key and not cert:
        raise ValueError("etcd URL option key= needs cert= too")
    for option, filename in (("ca", ca), ("cert", cert), ("key", key)):
        if filename is not None and not os.path.isfile(filename):
            raise ValueError(f"etcd URL option {option}={filename!r}: no such file")

    return ConnectionOptions(
        api=api,
        tls=tls,
        endpoints=endpoints,
        username=username,
        password=password,
        ca=ca,
        cert=cert,
        key=key,
        prefix=check_prefix(prefix if prefix is not None else params.get("prefix", DEFAULT_PREFIX)),
        timeout=_positive("timeout", timeout if timeout is not None else params.get("timeout", DEFAULT_TIMEOUT)),
        retry_max_delay=_non_negative(
            "retry_max_delay",
            retry_max_delay if retry_max_delay is not None else params.get("retry_max_delay", DEFAULT_RETRY_MAX_DELAY),
        ),
    )


def check_prefix(prefix: str) -> str:
    """A prefix is an absolute key path of plain segments, e.g. ``/celery-etcdlock``."""
    if not isinstance(prefix, str) or not prefix.startswith("/"):
        raise ValueError(f"prefix {prefix!r} must be an absolute key path such as /celery-etcdlock")
    prefix = prefix.rstrip("/")
    segments = prefix.split("/")[1:]
    if not segments:
        raise ValueError("prefix must not be the root '/': give the package a directory of its own")
    for segment in segments:
        if segment in ("", ".", "..") or not all(c.isalnum() or c in "-_." for c in segment):
            raise ValueError(f"prefix {prefix!r} has an invalid segment {segment!r} (letters, digits, - _ . only)")
    return prefix


def _parse_endpoint(text: str) -> tuple[str, int]:
    if not text:
        raise ValueError("etcd URL has an empty host (check for stray commas)")
    if text.startswith("["):  # [::1]:2379
        host, bracket, port_text = text[1:].partition("]")
        if not bracket or (port_text and not port_text.startswith(":")):
            raise ValueError(f"etcd URL host {text!r} is not a valid [IPv6]:port")
        port_text = port_text[1:]
    else:
        host, _, port_text = text.partition(":")
    if not host or any(c in host for c in " /\\?#"):
        raise ValueError(f"etcd URL host {text!r} is not a valid host name")
    if not port_text:
        return host, DEFAULT_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"etcd URL port {port_text!r} (in {text!r}) is not a port number")
    return host, int(port_text)


def _number(name: str, value: object) -> float:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number of seconds, not {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number of seconds, not {value!r}")
    return number


def _positive(name: str, value: object) -> float:
    number = _number(name, value)
    if number <= 0:
        raise ValueError(f"{name} must be positive, not {value!r}")
    return number


def _non_negative(name: str, value: object) -> float:
    number = _number(name, value)
    if number < 0:
        raise ValueError(f"{name} must not be negative, not {value!r}")
    return number


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _redact(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    credentials, at, hosts = rest.partition("@")
    if at and "/" not in credentials and "?" not in credentials:
        return f"{scheme}{sep}***@{hosts}"
    return url
