"""RWLock against a real etcd: sharing, exclusion, fairness, crashes, long waits."""

from __future__ import annotations

import pytest

from celery_etcdlock import RWLock
from celery_etcdlock.keys import LOCKS
from tests.agents import agent
from tests.support import wait_until


def queued(client) -> int:
    return sum(map(len, client.backend.list_queues(LOCKS).values()))


def test_killed_queued_writer_leaves_the_queue_within_ttl(etcd_url, client):
    ttl = 2
    rw = RWLock(client, "crashq", ttl=ttl)
    reader = rw.read()
    reader.acquire()
    with agent("acquire", url=etcd_url, name="crashq", ttl=ttl, mode="write", timeout=60) as writer:
        writer.expect("QUEUEING", timeout=15)
        wait_until(lambda: queued(client) == 2, 15)
        writer.kill()
    late = rw.read()
    # the late reader is behind the dead writer: it gets in once the writer's entry expires
    assert late.acquire(timeout=ttl + 1)
    late.release()
    reader.release()


@pytest.mark.slow_but_newest
def test_waiter_can_wait_far_longer_than_its_ttl(etcd_url, client):
    ttl = 1
    rw = RWLock(client, "patience", ttl=ttl)
    with agent("acquire", url=etcd_url, name="patience", ttl=ttl, mode="write", timeout=60) as waiter:
        with rw.read():
            waiter.expect("QUEUEING", timeout=15)
            wait_until(lambda: queued(client) == 2, 15)
            # hold for 4 TTLs: the waiter's entry must stay queued, renewed like a held lock
            assert not rw.write().acquire(timeout=4 * ttl)
            assert queued(client) == 2
        waiter.expect("ACQUIRED", timeout=10)


def test_bad_mode_and_ttl(client):
    with pytest.raises(ValueError, match="ttl"):
        RWLock(client, "x", ttl=0)
    with pytest.raises(ValueError, match="name"):
        RWLock(client, "", ttl=1)


def test_the_sides_are_public_types_and_data_is_keyword_only(client):
    """help(RWLock) leads to ReadLock and WriteLock, and holders() lists Holder dicts (issue 25.8)."""
    from celery_etcdlock import Holder, Mutex, ReadLock, WriteLock

    rw = RWLock(client, "typed-sides", ttl=5)
    reader, writer = rw.read(data={"who": "r"}), rw.write()
    assert isinstance(reader, ReadLock) and isinstance(writer, WriteLock)
    assert (reader.kind, writer.kind) == ("read", "write")
    with pytest.raises(TypeError):
        rw.read(None, {"who": "r"})  # type: ignore[misc]
    with pytest.raises(TypeError):
        Mutex(client, "typed-sides", 5, None, {"who": "m"})  # type: ignore[misc]
    with ReadLock(client, "typed-sides", ttl=5, data={"who": "alone"}), reader:
        holders: list[Holder] = Mutex(client, "typed-sides").holders()
        assert sorted(h["data"]["who"] for h in holders) == ["alone", "r"]
        assert {h["mode"] for h in holders} == {"read"} and all(isinstance(h["token"], int) for h in holders)
    assert not writer.held and writer.acquire(timeout=5)
    writer.release()
    from celery_etcdlock.locks.queue import QueueLock

    for public in (Mutex, RWLock, ReadLock, WriteLock, Holder):  # help() shows each its own docs, not QueueLock's
        assert public.__doc__ and public.__doc__ != QueueLock.__doc__, public
