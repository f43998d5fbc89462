"""What only the v2 backend does, against a real etcd 3.4 with v2: its event window, its queue
directories, and its answers to mistakes it cannot retry away.

- a request too large for etcd: v2 puts the key in the URL, and etcd's plain-HTTP client port
  resets a connection whose request line is over 4096 bytes (it reads that much to tell HTTP/1
  from gRPC); a form over 10 MB gets "http: POST too large";
- an etcd:// URL that points at etcd's peer port instead of its client port.
"""

from __future__ import annotations

import itertools
import logging
import threading
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from celery_etcdlock import Mutex
from celery_etcdlock.errors import BackendError, BackendUnavailable, UnsupportedServer
from celery_etcdlock.etcd.base import WaitResult
from celery_etcdlock.etcd.etcd2 import Etcd2Backend
from celery_etcdlock.keys import LOCKS
from celery_etcdlock.locks.connect import parse_url
from tests.support import EtcdServer, etcd_versions, wait_until


def make(url: str, **kwargs: Any) -> Etcd2Backend:
    return Etcd2Backend(parse_url(url, **kwargs))


V2_KINDS = etcd_versions.selected_kinds(["v2"], every=True)


@pytest.fixture(params=V2_KINDS, ids=[k.name for k in V2_KINDS])
def backend(request: pytest.FixtureRequest) -> Etcd2Backend:
    """A v2 backend on each v2 kind: etcd 3.4, and 3.5 with --enable-v2."""
    server: EtcdServer = request.getfixturevalue("etcd_kind_servers")(request.param)
    return make(server.url(prefix=f"/v2-{uuid.uuid4().hex[:10]}"), retry_max_delay=60)


@pytest.mark.parametrize("length", [4100, 2_000_000])
def test_a_key_too_long_for_a_url_fails_at_once(backend: Etcd2Backend, length: int) -> None:
    with pytest.raises(BackendError, match="refuses a request this large.*URL is .* over the 4 KB") as caught:
        backend.put_record("records/k/" + "k" * length, {}, expect=None)
    assert not isinstance(caught.value, BackendUnavailable)
    with pytest.raises(BackendError, match="refuses a request this large"):
        backend.join_queue("locks/" + "q" * length, {}, backend.grant(10))
    assert backend.put_record("records/k/" + "k" * 4000, {}, expect=None) is not None  # what fits still works


@pytest.mark.slow_but_newest
def test_a_value_too_large_for_a_form_fails_at_once(backend: Etcd2Backend) -> None:
    with pytest.raises(BackendError, match="refuses a request this large.*POST too large") as caught:
        backend.put_record("records/k/big", {"v": "x" * 11_000_000}, expect=None)
    assert not isinstance(caught.value, BackendUnavailable)


def test_the_peer_port_is_named(etcd34_server: EtcdServer) -> None:
    b = make(f"etcd://127.0.0.1:{etcd34_server.peer_port}", retry_max_delay=5)
    expected = f"127.0.0.1:{etcd34_server.peer_port} is etcd's peer port; use the client port, usually 2379"
    with pytest.raises(UnsupportedServer, match=f"{expected}.*{etcd34_server.client_url}"):
        b.read_queue("locks/q")


# -- v2's event window and directories, seen through a Mutex --------------------------------------


@pytest.mark.slow_but_newest
@pytest.mark.every_etcd("v2")
def test_watch_from_a_cleared_index_is_stale(client):
    """v2 keeps 1000 events: a watch from an older index must say so, not hang or fail."""
    lock = Mutex(client, "cleared", ttl=5)
    lock.acquire()
    snapshot = client.backend.read_queue(lock.queue)
    _make_noise(client, 1100)
    result = client.backend.wait_gone(snapshot.entries[0], snapshot.revision, timeout=2)
    assert result is WaitResult.STALE
    lock.release()


@pytest.mark.slow_but_newest
@pytest.mark.every_etcd("v2")
def test_waiter_recovers_when_its_watch_index_is_cleared(client, caplog):
    """More than 1000 events while a waiter waits: its next watch gets error 401 and it reads again."""
    caplog.set_level(logging.DEBUG, logger="celery_etcdlock.locks.queue")
    holder = Mutex(client, "cleared", ttl=1)
    holder.acquire()
    waiter = Mutex(client, "cleared", ttl=1)
    acquired = threading.Event()
    thread = threading.Thread(target=lambda: waiter.acquire(timeout=60) and acquired.set())
    thread.start()
    wait_until(lambda: sum(map(len, client.backend.list_queues(LOCKS).values())) == 2, 10)
    # keep writing until the waiter's watch chunk lapses and its next watch finds the index cleared
    wait_until(lambda: _make_noise(client, 200) or "cannot watch from index" in caplog.text, 60)
    holder.release()
    assert acquired.wait(20), "the waiter did not recover from the cleared event index"
    thread.join(5)
    waiter.release()


@pytest.mark.every_etcd("v2")
def test_a_probe_reads_the_queue_again_when_anything_was_written_after_its_look(client, monkeypatch):
    """join_queue_if_empty skips its second read only if its create is the very next write after the look."""
    backend = client.backend
    lease = backend.grant(30)
    create = backend._create_entry
    cut_in: list[Any] = []

    def create_after_another(queue: str, value: dict[str, Any], lease: Any) -> Any:
        if not cut_in:  # someone else joins between the look that found the queue empty and our create
            cut_in.append(create(queue, {"who": "other"}, lease))
        return create(queue, value, lease)

    monkeypatch.setattr(backend, "_create_entry", create_after_another)
    entry, snapshot = backend.join_queue_if_empty("locks/probe", {"who": "me"}, lease)
    assert entry is not None
    assert [e.token for e in snapshot.entries] == [cut_in[0].token, entry.token]  # read again: not first
    monkeypatch.undo()
    quiet: list[Any] = []
    for attempt in range(5):  # the server is shared: another test's renewal may write in between, now and then
        joined, snapshot = backend.join_queue_if_empty(f"locks/quiet{attempt}", {"who": "me"}, lease)
        assert joined is not None and snapshot.entries == [joined]
        quiet.append(joined)
        if snapshot.entries[0].ttl is None:  # the create's own answer (a read gives the TTL): no second read
            assert snapshot.revision == joined.token
            break
    else:
        pytest.fail("a create right after the look that found the queue empty still read the queue again")
    backend.revoke(lease, [cut_in[0], entry, *quiet])


_noise = itertools.count()


def _make_noise(client, events: int) -> None:
    for _ in range(events):
        i = next(_noise)
        client.backend.put_record(f"records/noise/{i}", {"i": i}, expect=None, ttl=30)


@pytest.mark.slow_but_newest
@pytest.mark.every_etcd("v2")
def test_an_unused_queue_directory_is_removed(client):
    """v2 queues are directories, which outlive their last entry (v3 queues are key ranges)."""
    from celery_etcdlock.locks import session

    with Mutex(client, "per-customer/42", ttl=5) as lock:
        queue = lock.queue
    # the release leaves an empty v2 directory; the renewer removes it once it stays unused
    wait_until(lambda: client.backend.get_record(queue) is None and _dir_gone(client, queue), session.TIDY_DELAY + 10)


def _dir_gone(client, queue) -> bool:
    import etcd

    raw = etcd.Client(*client.options.endpoints[0])
    try:
        raw.read(f"{client.prefix}/{queue}")
    except etcd.EtcdKeyNotFound:
        return True
    return False


@pytest.mark.parametrize("kind", [k for k in etcd_versions.selected_kinds(["v3"], every=True)], ids=lambda k: k.name)
def test_an_etcd_without_v2_is_refused_at_once_naming_etcd3(
    kind: etcd_versions.EtcdKind, etcd_kind_servers: Callable[[etcd_versions.EtcdKind], EtcdServer]
) -> None:
    """etcd:// against 3.5 without --enable-v2, or 3.6 and 3.7 (which have no v2 at all): not retried."""
    server = etcd_kind_servers(kind)
    b = make(f"etcd://{server.endpoint}?prefix=/no-v2", retry_max_delay=600)  # a retry would hit the test timeout
    with pytest.raises(UnsupportedServer, match=r"does not serve the v2 keys API.*use an etcd3:// URL"):
        b.read_queue(f"{LOCKS}/q")
