"""The v2 backend's answers to mistakes it cannot retry away, against a real etcd 3.4 with v2.

- a request too large for etcd: v2 puts the key in the URL, and etcd's plain-HTTP client port
  resets a connection whose request line is over 4096 bytes (it reads that much to tell HTTP/1
  from gRPC); a form over 10 MB gets "http: POST too large";
- an etcd:// URL that points at etcd's peer port instead of its client port.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from celery_etcdlock.backends.etcd2 import Etcd2Backend
from celery_etcdlock.connect import parse_url
from celery_etcdlock.errors import BackendError, BackendUnavailable, UnsupportedServer

from .servers import EtcdServer


def make(url: str, **kwargs: Any) -> Etcd2Backend:
    return Etcd2Backend(parse_url(url, **kwargs))


@pytest.fixture
def backend(etcd_server: EtcdServer) -> Etcd2Backend:
    return make(etcd_server.url(prefix=f"/v2-{uuid.uuid4().hex[:10]}"), retry_max_delay=60)


@pytest.mark.parametrize("length", [4100, 2_000_000])
def test_a_key_too_long_for_a_url_fails_at_once(backend: Etcd2Backend, length: int) -> None:
    with pytest.raises(BackendError, match="refuses a request this large.*URL is .* over the 4 KB") as caught:
        backend.put_record("records/k/" + "k" * length, {}, expect=None)
    assert not isinstance(caught.value, BackendUnavailable)
    with pytest.raises(BackendError, match="refuses a request this large"):
        backend.join_queue("locks/" + "q" * length, {}, backend.grant(10))
    assert backend.put_record("records/k/" + "k" * 4000, {}, expect=None) is not None  # what fits still works


def test_a_value_too_large_for_a_form_fails_at_once(backend: Etcd2Backend) -> None:
    with pytest.raises(BackendError, match="refuses a request this large.*POST too large") as caught:
        backend.put_record("records/k/big", {"v": "x" * 11_000_000}, expect=None)
    assert not isinstance(caught.value, BackendUnavailable)


def test_the_peer_port_is_named(etcd_server: EtcdServer) -> None:
    b = make(f"etcd://127.0.0.1:{etcd_server.peer_port}", retry_max_delay=5)
    expected = f"127.0.0.1:{etcd_server.peer_port} is etcd's peer port; use the client port, usually 2379"
    with pytest.raises(UnsupportedServer, match=f"{expected}.*{etcd_server.client_url}"):
        b.read_queue("locks/q")
