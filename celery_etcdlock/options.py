"""What a user can give us, checked: etcd URLs, connection options, and seconds.

This module imports nothing else of the package, so every layer may use it:
``connect()`` and the backends take their ``ConnectionOptions`` from here,
and every number of seconds (TTLs, timeouts, settings, task options, URL
query parameters) goes through ``check_seconds``, so one mistake gets one
error everywhere:

- not a number (a string, ``True``, ``None`` where a number is needed): ``TypeError``;
- a number out of range (negative, zero where it must be positive, NaN,
  infinite, above ``MAX_SECONDS``): ``ValueError``.

A value is checked where a user hands it over: a setting when the app's
settings are read, a task option when the task is declared, an argument in
the constructor of a primitive or a store. It travels inward as the float
that check returned, and nothing below (the session, the backends) checks it
again. A TTL becomes the whole seconds etcd is asked for once, where its lease
is granted (``Lease.server_ttl``).

    parse_url("etcd3s://app:secret@h1:2379,h2?ca=/etc/ca.pem&timeout=2")
    parse_url("memory://unit-tests?prefix=/app")   # the in-process backend, namespace "unit-tests"
    check_seconds(10, "ttl", positive=True)     # 10.0
    redact("etcd3://app:secret@h1:2379")        # 'etcd3://app:***@h1:2379'
"""

from __future__ import annotations

import math
import numbers
import os
import re
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote

DEFAULT_URL = "etcd3://127.0.0.1:2379"
DEFAULT_PREFIX = "/celery-etcdlock"
DEFAULT_PORT = 2379
DEFAULT_TIMEOUT = 5.0
DEFAULT_RETRY_MAX_DELAY = 30.0

#: the longest TTL or timeout we accept: etcd v2 stores a TTL of 7.4e9 s or more as one that never expires, and a
#: renewer thread cannot wait 1e11 s; a week is far above any lock a worker holds unrenewed.
MAX_SECONDS = 7 * 24 * 3600.0


@dataclass(frozen=True)
class Scheme:
    """One URL scheme: the etcd API it speaks (``"memory"``: none, in-process), whether over TLS, and the backend
    class (``module:Class``)."""

    api: str
    tls: bool
    backend: str


#: every URL scheme, and the backend each one builds (imported by ``connect()`` only when used)
SCHEMES: dict[str, Scheme] = {
    "etcd": Scheme("v2", False, "celery_etcdlock.etcd.etcd2:Etcd2Backend"),
    "etcds": Scheme("v2", True, "celery_etcdlock.etcd.etcd2:Etcd2Backend"),
    "etcd3": Scheme("v3", False, "celery_etcdlock.etcd.etcd3:Etcd3Backend"),
    "etcd3s": Scheme("v3", True, "celery_etcdlock.etcd.etcd3:Etcd3Backend"),
    "memory": Scheme("memory", False, "celery_etcdlock.etcd.memory:MemoryBackend"),
}
_QUERY_OPTIONS = ("prefix", "timeout", "retry_max_delay", "ca", "cert", "key")
_MEMORY_QUERY_OPTIONS = ("prefix", "timeout", "retry_max_delay")
_NAMESPACE = re.compile(r"[A-Za-z0-9_.\-]*\Z")  # memory://NAME: a plain name, or none (the default namespace)


@dataclass(frozen=True)
class ConnectionOptions:
    """Everything a backend needs to know, parsed and checked. Its ``repr`` never shows the password."""

    scheme: str
    endpoints: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    prefix: str = DEFAULT_PREFIX
    timeout: float = DEFAULT_TIMEOUT
    retry_max_delay: float = DEFAULT_RETRY_MAX_DELAY
    namespace: str = ""  # memory:// only: which in-process store ("" is the default one)

    @property
    def api(self) -> str:
        """``"v2"``, ``"v3"`` or ``"memory"``."""
        return SCHEMES[self.scheme].api

    @property
    def tls(self) -> bool:
        return SCHEMES[self.scheme].tls

    @property
    def endpoint_urls(self) -> tuple[str, ...]:
        """``http(s)://host:port`` of each endpoint: what errors and logs name (never with credentials)."""
        if self.api == "memory":
            return (f"memory://{self.namespace}",)
        scheme = "https" if self.tls else "http"
        return tuple(f"{scheme}://{_host_for_url(h)}:{p}" for h, p in self.endpoints)

    @property
    def url(self) -> str:
        """The URL again, with the password masked."""
        if self.api == "memory":
            return f"memory://{self.namespace}?prefix={self.prefix}"
        credentials = f"{self.username}:***@" if self.username is not None else ""
        hosts = ",".join(f"{_host_for_url(h)}:{p}" for h, p in self.endpoints)
        return f"{self.scheme}://{credentials}{hosts}?prefix={self.prefix}"


def parse_url(
    url: str,
    *,
    retry_max_delay: float | None = None,
    timeout: float | None = None,
    prefix: str | None = None,
) -> ConnectionOptions:
    """Check ``url`` and return its options; keyword arguments override the URL's query.

    Every error names the bad part and shows the URL with its password masked.
    """
    if not isinstance(url, str):
        raise TypeError(f"etcd URL must be a str, not {type(url).__name__}")
    shown = redact(url)
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"etcd URL {shown!r} has no scheme: expected {_scheme_list()}")
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r} in etcd URL {shown!r}: expected {_scheme_list()}")
    if SCHEMES[scheme].api == "memory":
        return _parse_memory_url(scheme, rest, shown, retry_max_delay=retry_max_delay, timeout=timeout, prefix=prefix)
    end = _credentials_end(rest, conservative=False)
    credentials, rest = (rest[:end], rest[end + 1 :]) if end >= 0 else ("", rest)
    netloc, _, query = rest.partition("?")
    hosts, _, path = netloc.partition("/")
    if path:
        raise ValueError(f"etcd URL {shown!r} has a path {'/' + path!r}; set the key prefix with ?prefix=")
    username = password = None
    if end >= 0:
        user, colon, secret = credentials.partition(":")
        if not user or not colon:
            raise ValueError(f"etcd URL {shown!r}: credentials must be given as user:password@")
        username, password = unquote(user), unquote(secret)
    endpoints = tuple(_parse_endpoint(h, shown) for h in hosts.split(","))

    params: dict[str, str] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name not in _QUERY_OPTIONS:
            known = ", ".join(_QUERY_OPTIONS)
            raise ValueError(f"unknown option {name!r} in etcd URL {shown!r}; known options: {known}")
        params[name] = value

    tls = SCHEMES[scheme].tls
    ca, cert, key = params.get("ca"), params.get("cert"), params.get("key")
    if not tls and (ca or cert or key):
        raise ValueError(f"TLS options (ca, cert, key) need the TLS scheme {scheme}s://, not {scheme}://")
    if key and not cert:
        raise ValueError("etcd URL option key= needs cert= too")
    for option, filename in (("ca", ca), ("cert", cert), ("key", key)):
        if filename is not None and not os.path.isfile(filename):
            raise ValueError(f"etcd URL option {option}={filename!r}: no such file")

    return ConnectionOptions(
        scheme=scheme,
        endpoints=endpoints,
        username=username,
        password=password,
        ca=ca,
        cert=cert,
        key=key,
        prefix=check_prefix(prefix if prefix is not None else params.get("prefix", DEFAULT_PREFIX)),
        timeout=_given_or_query("timeout", timeout, params, DEFAULT_TIMEOUT, positive=True),
        retry_max_delay=_given_or_query("retry_max_delay", retry_max_delay, params, DEFAULT_RETRY_MAX_DELAY),
    )


def _parse_memory_url(
    scheme: str,
    rest: str,
    shown: str,
    *,
    retry_max_delay: float | None,
    timeout: float | None,
    prefix: str | None,
) -> ConnectionOptions:
    """``memory://`` or ``memory://NAME``, with the query options that mean something in-process."""
    namespace, _, query = rest.partition("?")
    if "@" in namespace:
        raise ValueError(f"memory URL {shown!r} has credentials: memory:// has no users, leave them out")
    if not _NAMESPACE.match(namespace):
        raise ValueError(
            f"memory URL {shown!r}: the namespace {namespace!r} may hold only letters, digits, '-', '_' and '.' "
            "(memory://NAME, or memory:// for the default one; no port, host list or path)"
        )
    params: dict[str, str] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name in _QUERY_OPTIONS and name not in _MEMORY_QUERY_OPTIONS:
            raise ValueError(f"memory URL {shown!r}: option {name}= is for TLS to etcd; memory:// has no TLS")
        if name not in _MEMORY_QUERY_OPTIONS:
            known = ", ".join(_MEMORY_QUERY_OPTIONS)
            raise ValueError(f"unknown option {name!r} in memory URL {shown!r}; known options: {known}")
        params[name] = value
    return ConnectionOptions(
        scheme=scheme,
        endpoints=(),
        namespace=namespace,
        prefix=check_prefix(prefix if prefix is not None else params.get("prefix", DEFAULT_PREFIX)),
        timeout=_given_or_query("timeout", timeout, params, DEFAULT_TIMEOUT, positive=True),
        retry_max_delay=_given_or_query("retry_max_delay", retry_max_delay, params, DEFAULT_RETRY_MAX_DELAY),
    )


def check_prefix(prefix: object) -> str:
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


# -- seconds ----------------------------------------------------------------------------------


def check_seconds(value: object, name: str, *, positive: bool = False) -> float:
    """``value`` as a float number of seconds: finite, at most ``MAX_SECONDS``, and > 0 if ``positive`` else >= 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds, not {value!r}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number of seconds, not {value!r}")
    if number < 0 or (positive and number == 0):
        kind = "positive" if positive else "non-negative"
        raise ValueError(f"{name} must be a {kind} number of seconds, not {value!r}")
    if number > MAX_SECONDS:
        raise ValueError(f"{name} must be at most {MAX_SECONDS:.0f} seconds (7 days), not {value!r}")
    return number


def check_ttl(value: object, name: str = "ttl") -> float:
    """A TTL: a positive number of seconds, at most ``MAX_SECONDS``."""
    return check_seconds(value, name, positive=True)


def check_timeout(value: object, name: str = "timeout") -> float | None:
    """A timeout: None (no limit) or a non-negative number of seconds."""
    return None if value is None else check_seconds(value, name)


def _given_or_query(
    name: str, given: object, params: dict[str, str], default: float, *, positive: bool = False
) -> float:
    if given is not None:
        return check_seconds(given, name, positive=positive)
    text = params.get(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"etcd URL option {name}={text!r} is not a number of seconds") from None
    return check_seconds(value, f"etcd URL option {name}", positive=positive)


# -- showing URLs --------------------------------------------------------------------------------

_HOSTS = re.compile(r"[A-Za-z0-9_.\-\[\]:%,]*\Z")  # a list of host[:port], and nothing else


def redact(url: object) -> str:
    """``url`` (any string, even malformed or without a scheme) with its password masked.

    A password may contain ``@``, ``/``, ``:``, ``?`` or %-escapes; where the
    credentials end is unclear, everything up to the last ``@`` is masked:
    showing too little beats showing a password.
    """
    text = str(url)
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "", text
    end = _credentials_end(rest, conservative=True)
    if end < 0:
        return text
    user, colon, _ = rest[:end].partition(":")
    masked = f"{user}:***" if colon and not any(c in user for c in "/?#") else "***"
    return f"{scheme}{sep}{masked}{rest[end:]}"


def _credentials_end(rest: str, *, conservative: bool) -> int:
    """The index of the ``@`` that ends the credentials in ``rest`` (the URL after ``://``), or -1.

    Credentials come before the query, so the last ``@`` before the first ``?`` ends them
    (a password may contain ``@``, ``/`` or ``:``). An ``@`` only after a ``?`` is either
    in the query (a path ``ca=/home/me@corp/ca.pem``) or in a password with a ``?``: it
    is taken for the query when what comes before the ``?`` is a plain list of hosts,
    unless ``conservative`` (for masking), which then treats it as credentials anyway.
    """
    query_at = rest.find("?")
    head = rest if query_at < 0 else rest[:query_at]
    if "@" in head:
        return head.rindex("@")
    if "@" not in rest or (not conservative and _HOSTS.match(head)):
        return -1
    return rest.rindex("@")


# -- helpers --------------------------------------------------------------------------------------


def _scheme_list() -> str:
    return ", ".join(f"{s}://" for s in SCHEMES)


def _parse_endpoint(text: str, shown: str) -> tuple[str, int]:
    if not text:
        raise ValueError(f"etcd URL {shown!r} has an empty host (check for stray commas)")
    if text.startswith("["):  # [::1]:2379
        host, bracket, port_text = text[1:].partition("]")
        if not bracket or (port_text and not port_text.startswith(":")):
            raise ValueError(f"etcd URL host {text!r} is not a valid [IPv6]:port")
        port_text = port_text[1:]
    else:
        host, _, port_text = text.partition(":")
    if not host or any(c in host for c in " /\\?#@") or not host.isprintable():  # no CR, LF, tab, NUL...
        raise ValueError(f"etcd URL host {text!r} is not a valid host name")
    if not host.isascii():  # it goes into the Host header and TLS's server name as it is
        raise ValueError(f"etcd URL host {text!r} is not ASCII: give an internationalised name in its xn-- form")
    if not port_text:
        return host, DEFAULT_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"etcd URL port {port_text!r} (in {text!r}) is not a port number")
    return host, int(port_text)


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host else host
