"""RWLock against a real etcd: sharing, exclusion, fairness, crashes, long waits."""

from __future__ import annotations

import threading

import pytest

from celery_etcdlock import Mutex, RWLock
from celery_etcdlock.keys import LOCKS
from tests.agents import agent
from tests.support import wait_until


def queued(client) -> int:
    return sum(map(len, client.backend.list_queues(LOCKS).values()))


def test_readers_overlap(client):
    rw = RWLock(client, "index", ttl=5)
    readers = [rw.read() for _ in range(3)]
    for r in readers:
        assert r.acquire(timeout=5)
    assert all(r.held for r in readers)
    assert len(readers[0].holders()) == 3
    for r in readers:
        r.release()


def test_writer_excludes_readers_and_writers(client):
    rw = RWLock(client, "index", ttl=5)
    with rw.write() as writer:
        assert writer.held
        assert not rw.read().acquire(timeout=0.2)
        assert not rw.write().acquire(timeout=0.2)
        assert not Mutex(client, "index", ttl=5).acquire(blocking=False)  # a Mutex is the write side
    with rw.read():
        assert not rw.write().acquire(timeout=0.2)
        assert rw.read().acquire(blocking=False)


def test_reader_after_a_queued_writer_waits_for_it(client):
    rw = RWLock(client, "fair", ttl=5)
    first_reader = rw.read()
    first_reader.acquire()
    order: list[str] = []
    writer, late_reader = rw.write(), rw.read()

    def run(lock, label):
        with lock:
            order.append(label)

    tw = threading.Thread(target=run, args=(writer, "writer"))
    tw.start()
    wait_until(lambda: queued(client) == 2, 10)
    tr = threading.Thread(target=run, args=(late_reader, "late reader"))
    tr.start()
    wait_until(lambda: queued(client) == 3, 10)
    assert not late_reader.held  # readers hold now, but this one must not leapfrog the writer
    first_reader.release()
    tw.join(20)
    tr.join(20)
    assert order == ["writer", "late reader"]


def test_readers_behind_a_writer_proceed_together(client):
    rw = RWLock(client, "batch", ttl=5)
    writer = rw.write()
    writer.acquire()
    readers = [rw.read() for _ in range(3)]
    all_in = threading.Barrier(3, timeout=20)
    results = []

    def read(lock):
        with lock:
            all_in.wait()  # fails unless all three hold at once
            results.append(lock.token)

    threads = [threading.Thread(target=read, args=(r,)) for r in readers]
    for t in threads:
        t.start()
    wait_until(lambda: queued(client) == 4, 10)
    writer.release()
    for t in threads:
        t.join(30)
    assert len(results) == 3


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
