"""connect(): URL checks, unreachable and wrong servers, fail-over, TLS and auth, all against real servers."""

from __future__ import annotations

import time

import pytest

from celery_etcdlock import (
    AuthenticationFailed,
    BackendUnavailable,
    Mutex,
    UnsupportedServer,
    connect,
)
from celery_etcdlock.connect import parse_url
from tests.servers import EtcdServer, free_port


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
        ("etcd://h?timeout=0", "timeout must be positive"),
        ("etcd://h?timeout=soon", "timeout must be a number"),
        ("etcd://h?retry_max_delay=-1", "retry_max_delay must not be negative"),
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


def test_password_never_appears_in_errors():
    with pytest.raises(ValueError) as info:
        connect("ftp://user:secret@h")
    assert "secret" not in str(info.value)


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


def test_fails_over_to_the_next_endpoint(etcd_server):
    dead = free_port()
    client = connect(f"etcd://127.0.0.1:{dead},{etcd_server.endpoint}?prefix=/failover", retry_max_delay=10)
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
