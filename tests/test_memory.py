"""memory://: its URLs and namespaces, its refusal to be shared across a fork, eager tasks and the beat on it.

How the primitives behave on memory:// is the contract of test_contract.py, which runs on etcd too;
this module tests what is memory://'s own.
"""

from __future__ import annotations

import multiprocessing
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, signals
from celery._state import _set_task_join_will_block

from celery_etcdlock import InvalidUse, Mutex, TaskLocked, connect
from celery_etcdlock.beat import LeaderScheduler
from celery_etcdlock.keys import LOCKS, queue_key
from celery_etcdlock.locks.queue import read_state
from celery_etcdlock.options import parse_url
from celery_etcdlock.settings import client_for
from celery_etcdlock.tasks import limited_task, rwlock_task, singleton_task
from tests.procs import REPO_ROOT, Proc
from tests.support import EtcdServer, wait_until


def unique() -> str:
    return uuid.uuid4().hex[:10]


def start(target: Callable[[], Any]) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


# -- URLs and namespaces ---------------------------------------------------------------------------


def test_memory_urls() -> None:
    default = parse_url("memory://")
    assert (default.api, default.namespace, default.endpoints, default.tls) == ("memory", "", (), False)
    assert default.endpoint_urls == ("memory://",)
    assert default.url == "memory://?prefix=/celery-etcdlock"
    named = parse_url("memory://unit-1.a_b?prefix=/app&timeout=2&retry_max_delay=3")
    assert (named.namespace, named.prefix, named.timeout, named.retry_max_delay) == ("unit-1.a_b", "/app", 2, 3)
    assert parse_url("memory://x", prefix="/other").prefix == "/other"
    client = connect("memory://unit-1")
    assert client.api == "memory" and "memory://unit-1" in repr(client)


@pytest.mark.parametrize(
    ("url", "complaint"),
    [
        ("memory://h:2379", "namespace 'h:2379' may hold only"),
        ("memory://a,b", "namespace 'a,b' may hold only"),
        ("memory://a/b", "namespace 'a/b' may hold only"),
        ("memory://user:secret@x", "has credentials"),
        ("memory://x?ca=/etc/ca.pem", "memory:// has no TLS"),
        ("memory://x?prefx=/a", "unknown option 'prefx'"),
        ("memory://x?prefix=relative", "prefix"),
        ("memory://x?timeout=0", "timeout must be a positive number"),
    ],
)
def test_bad_memory_urls_name_the_bad_part(url: str, complaint: str) -> None:
    with pytest.raises(ValueError) as raised:
        connect(url)
    assert complaint in str(raised.value)
    assert "secret" not in str(raised.value)


def test_clients_of_one_namespace_share_their_locks_and_no_one_else_does() -> None:
    name = unique()
    first, second = connect(f"memory://{name}"), connect(f"memory://{name}")
    elsewhere, other_prefix = connect(f"memory://{name}-other"), connect(f"memory://{name}?prefix=/other")
    try:
        with Mutex(first, "x", ttl=5):
            assert not Mutex(second, "x", ttl=5).acquire(blocking=False)
            assert Mutex(elsewhere, "x", ttl=5).acquire(blocking=False)  # another namespace
            assert Mutex(other_prefix, "x", ttl=5).acquire(blocking=False)  # another prefix, as on etcd
    finally:
        for client in (first, second, elsewhere, other_prefix):
            client.close()


# -- fork --------------------------------------------------------------------------------------------


def _try_in_child(use: Callable[[], Any], conn: Any) -> None:
    try:
        use()
        conn.send("no error")
    except InvalidUse as exc:
        conn.send(str(exc))


def _in_a_forked_child(use: Callable[[], Any], hold: threading.Lock | None = None) -> str:
    """What ``use()`` says in a forked child (its InvalidUse message), with ``hold`` held across the fork."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_try_in_child, args=(use, child))
    if hold is not None:
        with hold:
            proc.start()
    else:
        proc.start()
    try:
        assert parent.poll(30), "the child did not answer (it hangs)"
        return str(parent.recv())
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def test_a_forked_child_gets_a_clear_error_not_a_copy() -> None:
    name = unique()
    client = connect(f"memory://{name}")
    try:
        held = Mutex(client, "parent's", ttl=5)
        assert held.acquire(timeout=5)
        said = _in_a_forked_child(lambda: Mutex(client, "child's", ttl=5).acquire(timeout=1))
        assert "memory:// lives in one process" in said and "etcd_server" in said, said
        # a client made in the child on the inherited namespace is refused too
        said = _in_a_forked_child(lambda: Mutex(connect(f"memory://{name}"), "x", ttl=5).acquire(timeout=1))
        assert "memory:// lives in one process" in said, said
        # while a parent's thread held the namespace at the fork: the child still answers, it does not hang
        said = _in_a_forked_child(lambda: client.backend.read_queue("locks/x"), hold=client.backend._store.lock)
        assert "memory:// lives in one process" in said, said
        # a namespace the child makes for itself is its own: nothing there to part from
        assert _in_a_forked_child(lambda: Mutex(connect(f"memory://{unique()}"), "x", ttl=5).acquire()) == "no error"
        assert held.held  # the parent's lock and client are untouched
        assert Mutex(client, "parent's", ttl=5).holders()[0]["token"] == held.token
        held.release()
    finally:
        client.close()


PREFORK_APP = """
import os
from celery import Celery
from celery_etcdlock import singleton_task

app = Celery("memapp", broker=os.environ["BROKER"], backend=os.environ["BROKER"])
app.conf.update(etcdlock_url="memory://", task_default_queue=os.environ["QUEUE"])
app.conf.broker_connection_retry_on_startup = True

@singleton_task(app=app, name="memapp.job")
def job():
    return "ran"
"""


def test_a_prefork_pool_process_refuses_memory_urls(redis_url: str, tmp_path: Path) -> None:
    (tmp_path / "memapp.py").write_text(PREFORK_APP)
    queue = f"q-{unique()}"
    env = {"BROKER": redis_url, "QUEUE": queue, "PYTHONPATH": f"{tmp_path}:{REPO_ROOT}"}
    args = ["-A", "memapp", "worker", "--pool=prefork", "--concurrency=1", "-l", "info", "--without-mingle",
            "--without-gossip", "-n", f"memory-{unique()}@%h"]  # fmt: skip
    with Proc.module("celery", *args, env=env, cwd=tmp_path, name="prefork-worker") as worker:
        worker.expect(r" ready\.", timeout=90)
        caller = Celery("caller", broker=redis_url, backend=redis_url, set_as_current=False)
        result = caller.send_task("memapp.job", queue=queue)
        result.get(timeout=60, propagate=False)
        assert result.failed()
        assert "prefork pool process" in str(result.result) and "etcd_server" in str(result.result)


# -- eager tasks ---------------------------------------------------------------------------------------


@pytest.fixture(params=["memory", "v3"])
def lock_url(request: pytest.FixtureRequest) -> str:
    """``memory://``, as users will set it, and etcd3:// with a prefix of the test's own, to compare."""
    if request.param == "memory":
        return "memory://"
    server: EtcdServer = request.getfixturevalue("etcd35_server")
    return server.url(prefix=f"/t-{unique()}")


@pytest.fixture
def eager_app(lock_url: str) -> Iterator[Celery]:
    """An app with ``task_always_eager=True``: tasks run at once, in the caller's thread."""
    app = Celery("eager", set_as_current=False)
    app.conf.update(task_always_eager=True, etcdlock_url=lock_url, etcdlock_ttl=5)
    # Finalized, the app makes each task at its decorator. Unfinalized, it hands out a proxy that two
    # threads' first delay() may evaluate at once, and Celery then lets one of them run the task before
    # bind() has given it a request stack (AttributeError: 'NoneType' object has no attribute 'push')
    app.finalize()
    yield app
    # Celery marks "inside a task" for an eager run in a flag of the process, not of the thread, and puts back
    # what it found: two eager runs in two threads may leave it set, and every later result.get() refused
    _set_task_join_will_block(False)


def outcome(result: Any) -> Any:
    """``result.get()``, also while another thread runs an eager task (which sets Celery's flag for the process)."""
    return result.get(disable_sync_subtasks=False)


def test_eager_singleton_runs_at_once_and_skips_while_another_thread_runs_it(eager_app: Celery) -> None:
    started, gate = threading.Event(), threading.Event()

    @singleton_task(app=eager_app, name=f"eager.single.{unique()}")
    def job(wait: bool) -> str:
        if wait:
            started.set()
            gate.wait(30)
        return "ran"

    first: list[Any] = []
    thread = start(lambda: first.append(outcome(job.delay(True))))
    assert started.wait(10)
    assert outcome(job.delay(False)) is None  # skipped: the other thread's run holds the lock
    gate.set()
    thread.join(30)
    assert first == ["ran"]
    assert outcome(job.delay(False)) == "ran"  # free again


def test_eager_singleton_raises_on_conflict(eager_app: Celery) -> None:
    started, gate = threading.Event(), threading.Event()

    @singleton_task(app=eager_app, name=f"eager.raising.{unique()}", on_conflict="raise")
    def job(wait: bool) -> str:
        if wait:
            started.set()
            gate.wait(30)
        return "ran"

    thread = start(lambda: job.delay(True))
    assert started.wait(10)
    with pytest.raises(TaskLocked):
        outcome(job.delay(False))
    gate.set()
    thread.join(30)


def test_eager_rwlock_readers_share_and_a_writer_waits_for_them(eager_app: Celery) -> None:
    name, order, gate = f"index-{unique()}", [], threading.Event()
    both_in = threading.Barrier(2, timeout=20)

    @rwlock_task(app=eager_app, name=f"eager.read.{unique()}", lock=name, mode="read")
    def read() -> None:
        both_in.wait()  # fails unless both readers hold the lock at once
        gate.wait(30)
        order.append("read")

    @rwlock_task(app=eager_app, name=f"eager.write.{unique()}", lock=name, mode="write")
    def write() -> None:
        order.append("write")

    readers = [start(lambda: outcome(read.delay())) for _ in range(2)]
    client = client_for(eager_app)
    wait_until(lambda: len(read_state(client, queue_key(LOCKS, name)).holders) == 2, 10, "both readers to hold")
    writer = start(lambda: outcome(write.delay()))  # on_conflict="wait": it queues behind the readers
    wait_until(lambda: len(read_state(client, queue_key(LOCKS, name)).waiters) == 1, 10, "the writer to queue")
    assert order == []
    gate.set()
    for thread in [*readers, writer]:
        thread.join(30)
    assert order == ["read", "read", "write"]


def test_eager_limited_task_lets_limit_runs_in(eager_app: Celery) -> None:
    inside, gate = threading.Barrier(3, timeout=20), threading.Event()

    @limited_task(app=eager_app, name=f"eager.limited.{unique()}", limit=2, on_conflict="skip")
    def job(wait: bool) -> str:
        if wait:
            inside.wait()  # the two runs and the test meet here: both are inside at once
            gate.wait(30)
        return "ran"

    results: list[Any] = []
    threads = [start(lambda: results.append(outcome(job.delay(True)))) for _ in range(2)]
    inside.wait()
    assert outcome(job.delay(False)) is None  # a third run finds both slots taken
    gate.set()
    for thread in threads:
        thread.join(30)
    assert results == ["ran", "ran"]
    assert outcome(job.delay(False)) == "ran"


# -- the beat ---------------------------------------------------------------------------------------------


def tick_until(scheduler: LeaderScheduler, predicate: Callable[[], bool], what: str) -> None:
    wait_until(lambda: scheduler.tick() is not None and predicate(), 20, what)


def test_only_the_leading_beat_sends_and_a_closing_one_hands_over(lock_url: str) -> None:
    task = f"beat.job.{unique()}"
    app = Celery("beat", broker="memory://", set_as_current=False)  # kombu's in-process broker
    app.conf.update(
        etcdlock_url=lock_url,
        etcdlock_beat_name=f"beat-{unique()}",
        beat_schedule={"every": {"task": task, "schedule": 0.1}},
        task_default_queue=f"q-{unique()}",
    )
    senders: list[str] = []

    @signals.before_task_publish.connect(weak=False)
    def sent(sender: str | None = None, **_: Any) -> None:
        if sender == task:
            senders.append(threading.current_thread().name)

    a = LeaderScheduler(app, etcd_client=connect(lock_url), identity="a:1")  # a client each, as two hosts
    b = LeaderScheduler(app, etcd_client=connect(lock_url), identity="b:2")
    try:
        tick_until(a, lambda: a.is_leader, "a to lead")
        b.tick()
        tick_until(a, lambda: len(senders) >= 3, "a to send 3 runs")
        sent_by_a = len(senders)
        for _ in range(3):
            b.tick()
        assert not b.is_leader and len(senders) == sent_by_a  # a follower sends nothing
        a.close()  # resigns: b leads at its next tick
        tick_until(b, lambda: b.is_leader, "b to take over")
        tick_until(b, lambda: len(senders) > sent_by_a, "b to send")
    finally:
        signals.before_task_publish.disconnect(sent)
        a.close()
        b.close()
