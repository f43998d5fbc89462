"""connect(): URL checks, unreachable and wrong servers, fail-over, TLS and auth, all against real servers."""

from __future__ import annotations

import time
from urllib.parse import quote

import pytest

from celery_etcdlock import (
    AuthenticationFailed,
    BackendUnavailable,
    Mutex,
    UnsupportedServer,
    connect,
    singleton_task,
)
from celery_etcdlock.options import MAX_SECONDS, check_timeout, check_ttl, parse_url, redact
from tests.support import EtcdServer, free_port


def test_parse_full_url(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    options = parse_url(
        f"etcds://us%40er:p%3Ass@h1:2380,h2,[::1]:2390?prefix=/my/app&timeout=2.5&retry_max_delay=7&ca={ca}"
    )
    assert options.api == "v2" and options.tls
    assert options.endpoints == (("h1", 2380), ("h2", 2379), ("::1", 2390))
    assert options.endpoint_urls == ("https://h1:2380", "https://h2:2379", "https://[::1]:2390")
    assert (options.username, options.password) == ("us@er", "p:ss")
    assert options.prefix == "/my/app" and options.timeout == 2.5 and options.retry_max_delay == 7
    assert parse_url("etcd3://h").api == "v3"
    assert parse_url("etcd://h", retry_max_delay=1).retry_max_delay == 1


@pytest.mark.parametrize(
    ("url", "complaint"),
    [
        ("http://127.0.0.1:2379", "unknown scheme 'http'"),
        ("127.0.0.1:2379", "no scheme"),
        ("etcd://", "empty host"),
        ("etcd://h1,,h2", "empty host"),
        ("etcd://h:abc", "port 'abc'"),
        ("etcd://h:70000", "port '70000'"),
        ("etcd://h/path", "path"),
        ("etcd://h?prefx=/x", "unknown option 'prefx'"),
        ("etcd://h?prefix=relative", "prefix"),
        ("etcd://h?prefix=/a/../b", "invalid segment"),
        ("etcd://h?timeout=0", "timeout must be a positive number"),
        ("etcd://h?timeout=soon", "timeout='soon' is not a number"),
        ("etcd://h?timeout=nan", "timeout must be a finite number"),
        ("etcd://h?timeout=1e11", "at most 604800 seconds"),
        ("etcd://h?retry_max_delay=-1", "retry_max_delay must be a non-negative number"),
        ("etcd://h?ca=/x.pem", "TLS options"),
        ("etcds://h?ca=/no/such/file.pem", "no such file"),
        ("etcds://h?key=/k.pem", "needs cert"),
        ("etcd://user@h", "user:password"),
    ],
)
def test_malformed_urls_name_the_bad_part(url, complaint):
    with pytest.raises(ValueError) as info:
        connect(url)
    assert complaint in str(info.value)


@pytest.mark.parametrize(
    "url",
    [
        "ftp://user:secret@h",
        "user:secret@h:2379",  # no scheme
        "etcd3://user:sec/ret@h/path",  # a password with a slash, and a path
        "etcd3://user:sec@ret@h?prefx=1",  # an @ in the password, a bad option
        "etcd3://user:sec:ret@h:99999",  # a colon in the password, a bad port
        "etcd3://user:sec?ret@h",  # a question mark in the password
        "etcd3://user:sec%40ret@h,,h2",  # an escape, an empty host
        "etcd3://user:secret@h?timeout=-1",
        "etcd3s://user:secret@h?ca=/no/such/ca.pem",
        "etcd://user:secret@h?ca=/x.pem",
        "etcd3://user:secret@h?prefix=relative",
        "etcd3://:secret@h:abc",
    ],
)
def test_password_never_appears_in_errors(url):
    with pytest.raises(ValueError) as info:
        connect(url)
    message = str(info.value)
    for fragment in ("secret", "sec/ret", "sec@ret", "sec:ret", "sec?ret", "sec%40ret", "ret@h"):
        assert fragment not in message, message


@pytest.mark.parametrize("password", ["secret", "se/cr@t", "s:e?c#r%40et"])
def test_password_never_appears_in_a_repr(password):
    url = f"etcd3://user:{quote(password, safe='')}@h1:2379,h2?prefix=/app"
    client = connect(url)
    shown = [repr(client), repr(client.options), str(client.options), client.options.url]
    for text in shown:
        assert password not in text and quote(password, safe="") not in text, text
    assert client.options.password == password  # kept, only never shown
    assert client.options.url == "etcd3://user:***@h1:2379,h2:2379?prefix=/app"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("etcd3://app:s3cr/t@h:2379", "etcd3://app:***@h:2379"),
        ("etcd3://app:p@ss@h1:1,h2?prefix=/x", "etcd3://app:***@h1:1,h2?prefix=/x"),
        ("app:pw@host:2379", "app:***@host:2379"),
        ("etcd3://u:p?ss@host", "etcd3://u:***@host"),
        ("etcd3://u:p%40ss@host", "etcd3://u:***@host"),
        ("etcd3://h1:2379?prefix=/x", "etcd3://h1:2379?prefix=/x"),
        ("nothing to hide", "nothing to hide"),
    ],
)
def test_redact_masks_only_the_password(url, shown):
    assert redact(url) == shown


@pytest.mark.parametrize(
    ("value", "error"),
    [(0, ValueError), (-1, ValueError), (float("nan"), ValueError), (float("inf"), ValueError), (1e11, ValueError),
     (10**400, ValueError), ("3", TypeError), (True, TypeError), ([1], TypeError)],
)  # fmt: skip
def test_one_rule_for_every_number_of_seconds(value, error):
    """A TTL, a task option and a connect() argument: the same mistake gets the same error type."""
    with pytest.raises(error, match="^ttl"):
        check_ttl(value)
    with pytest.raises(error, match="lock_ttl"):
        singleton_task(lock_ttl=value)
    if value != 0:  # 0 is a valid delay
        with pytest.raises(error, match="retry_max_delay"):
            connect("etcd3://h", retry_max_delay=value)


def test_seconds_at_the_edges_are_accepted():
    assert check_ttl(MAX_SECONDS) == MAX_SECONDS
    assert check_timeout(None) is None and check_timeout(0) == 0.0
    assert connect("etcd3://h", retry_max_delay=0).options.retry_max_delay == 0


def test_connect_does_not_contact_the_server():
    started = time.monotonic()
    connect(f"etcd://127.0.0.1:{free_port()}")
    connect(f"etcd3://127.0.0.1:{free_port()}")
    assert time.monotonic() - started < 1


def test_unreachable_server_gets_backend_unavailable_naming_it():
    port = free_port()
    client = connect(f"etcd://127.0.0.1:{port}", retry_max_delay=0.3)
    with pytest.raises(BackendUnavailable) as info:
        Mutex(client, "x", ttl=5).acquire()
    assert f"127.0.0.1:{port}" in str(info.value)
    assert info.value.endpoints == (f"http://127.0.0.1:{port}",)


def test_fails_over_to_the_next_endpoint(etcd34_server):
    dead = free_port()
    client = connect(f"etcd://127.0.0.1:{dead},{etcd34_server.endpoint}?prefix=/failover", retry_max_delay=10)
    with Mutex(client, "x", ttl=5) as lock:
        assert lock.held


def test_server_without_the_v2_api_says_to_use_etcd3():
    with EtcdServer(version="3.5", enable_v2=False) as server:
        client = connect(f"etcd://{server.endpoint}")
        with pytest.raises(UnsupportedServer, match="etcd3://"):
            Mutex(client, "x", ttl=5).acquire()


def test_tls_and_auth():
    with EtcdServer(version="3.4", enable_v2=True, tls=True, auth=True, api="v2") as server:
        url = server.url("etcds")
        with Mutex(connect(url), "secure", ttl=5) as lock:
            assert lock.held
        wrong = server.url("etcds", password="wrong")
        with pytest.raises(AuthenticationFailed, match="refused user 'app'"):
            Mutex(connect(wrong, retry_max_delay=1), "secure", ttl=5).acquire()
