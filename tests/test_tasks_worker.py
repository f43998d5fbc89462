"""Singleton and read-write locked tasks through a real Celery worker.

One real ``celery -A tests.taskapp worker --pool=prefork --concurrency=2``
process for the module, with Redis as broker and result backend and a real
etcd. The tasks record their runs in Redis (see ``tests.taskapp``); each test
uses its own tag, so its keys and locks are its own. Processes are killed and
stopped for real; waits are polls with deadlines.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery.exceptions import SoftTimeLimitExceeded

from celery_etcdlock import LockLost, Mutex, TaskLocked, connect
from tests import taskapp
from tests.procs import Proc
from tests.support import RedisServer, etcd_versions, wait_until

RESULT_TIMEOUT = 60  # generous: 2 loaded cores


class Worker:
    """A real ``celery worker`` process and what a test needs to observe it."""

    def __init__(self, etcd_url: str, redis_url: str, concurrency: int = 2) -> None:
        self.etcd_url = etcd_url
        self.redis_url = redis_url
        self.proc = Proc.module(
            "celery", "-A", "tests.taskapp", "worker", "--pool=prefork", f"--concurrency={concurrency}", "-O", "fair",
            "-l", "info", "--without-mingle", "--without-gossip", "-n", f"taskworker-{uuid.uuid4().hex[:6]}@%h",
            env={"ETCDLOCK_TEST_ETCD_URL": etcd_url, "ETCDLOCK_TEST_REDIS_URL": redis_url},
            name="celery-worker",
        )  # fmt: skip
        try:
            self.proc.expect(r" ready\.", timeout=90)
        except BaseException:
            self.proc.kill()
            raise
        self.client = connect(etcd_url)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def text(self) -> str:
        return self.proc.output

    def stop(self) -> None:
        self.proc.terminate(timeout=30)
        self.client.close()

    def holders(self, name: str) -> list[dict[str, Any]]:
        return Mutex(self.client, name, ttl=5).holders()


@pytest.fixture(scope="module")
def redis_for_workers() -> Iterator[str]:
    """One Redis for the module: the test side's result backend keeps its connection across workers."""
    redis = RedisServer().start()
    yield redis.url()
    redis.close()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``worker`` on each API's default etcd kind, or on every kind for a test marked ``every_etcd``."""
    if "worker" in metafunc.fixturenames:
        every = metafunc.definition.get_closest_marker("every_etcd") is not None
        kinds = etcd_versions.selected_kinds(["v2", "v3"], every)
        ids = [k.name if every else k.api for k in kinds]
        metafunc.parametrize("worker", kinds, ids=ids, indirect=True, scope="module")


@pytest.fixture(scope="module")
def worker(request: pytest.FixtureRequest, redis_for_workers: str) -> Iterator[Worker]:
    """A prefork worker on an etcd test kind: v2 (etcd 3.4) or v3 (the newest), or every kind."""
    server = request.getfixturevalue("etcd_kind_servers")(request.param)
    etcd_url = server.url(prefix=f"/tasks-worker-{uuid.uuid4().hex[:8]}")
    taskapp.configure(etcd_url, redis_for_workers)
    started = Worker(etcd_url, redis_for_workers)
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
def tag() -> str:
    return uuid.uuid4().hex[:10]


def events(tag: str, event: str | None = None) -> list[dict[str, Any]]:
    lines = [json.loads(x) for x in taskapp.store().lrange(f"events:{tag}", 0, -1)]
    return [e for e in lines if event is None or e["event"] == event]


def max_concurrency(tag: str) -> int:
    return max((int(x) for x in taskapp.store().lrange(f"concurrency:{tag}", 0, -1)), default=0)


def started(tag: str, count: int = 1, timeout: float = 30) -> list[dict[str, Any]]:
    runs = wait_until(lambda: len(events(tag, "start")) >= count and events(tag, "start"), timeout, f"{count} runs")
    return list(runs)


def results(handles: list[Any]) -> list[Any]:
    return [h.get(timeout=RESULT_TIMEOUT, propagate=False) for h in handles]


# -- one run at a time ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.every_etcd  # a small part of the task tests on every etcd kind
def test_five_submissions_one_run_others_skip(worker: Worker, tag: str) -> None:
    handles = [taskapp.skip_task.delay(tag, 2.0) for _ in range(5)]
    values = results(handles)
    assert sorted(values, key=lambda v: v is None) == [2.0, None, None, None, None]
    assert len(events(tag, "start")) == 1
    assert max_concurrency(tag) == 1
    assert "skipped" in worker.text()
    assert worker.holders(taskapp.skip_task.lock_name_for((tag,))) == []


def test_base_class_task_is_a_singleton(worker: Worker, tag: str) -> None:
    values = results([taskapp.base_task.delay(tag, 1.5) for _ in range(3)])
    assert sorted(values, key=lambda v: v is None) == [1.5, None, None]
    assert len(events(tag, "start")) == 1


def test_duplicate_delivery_of_a_running_task_does_not_run_twice(worker: Worker, tag: str) -> None:
    # what a broker does after a visibility timeout: the same message (same task id) again
    task_id = f"dup-{tag}"
    first = taskapp.skip_task.apply_async((tag, 1.5), task_id=task_id)
    started(tag)
    taskapp.skip_task.apply_async((tag, 1.5), task_id=task_id)
    assert first.get(timeout=RESULT_TIMEOUT) == 1.5
    wait_until(lambda: "duplicate delivery" in worker.text(), 30, "the duplicate to be dropped")
    assert len(events(tag, "start")) == 1
    assert first.get(timeout=RESULT_TIMEOUT) == 1.5  # the duplicate stored nothing over the result


def test_lock_value_records_task_and_worker_and_bound_task_sees_token(worker: Worker, tag: str) -> None:
    handle = taskapp.skip_task.delay(tag, 1.5)
    (start,) = started(tag)
    (holder,) = worker.holders(taskapp.skip_task.lock_name_for((tag,)))
    assert holder["data"]["task_id"] == handle.id
    assert holder["data"]["task"] == "tests.taskapp.skip_task"
    assert holder["data"]["hostname"].startswith("taskworker-")
    assert holder["holder"].endswith(f":{start['pid']}")
    assert start["token"] == holder["token"]
    handle.get(timeout=RESULT_TIMEOUT)


@pytest.mark.slow
def test_per_key_same_key_serialised_positional_and_keyword_alike(worker: Worker, tag: str) -> None:
    same, different = f"{tag}-same", f"{tag}-diff"
    # different keys first: with two pool slots, they can only overlap if neither waits
    handles = [
        taskapp.wait_task.delay(different, 1, 1.0),
        taskapp.wait_task.delay(different, 2, 1.0),
        taskapp.wait_task.delay(same, 1, 1.0),
        taskapp.wait_task.delay(tag=same, k=1, seconds=1.0),
    ]
    assert results(handles) == [1.0, 1.0, 1.0, 1.0]
    assert max_concurrency(different) == 2
    assert max_concurrency(same) == 1
    assert len(events(same, "start")) == 2
    assert (
        taskapp.wait_task.lock_name_for((same, 1))
        == taskapp.wait_task.lock_name_for((), {"tag": same, "k": 1})
        == taskapp.wait_task.lock_name_for((same,), {"k": 1, "seconds": 5})
    )


# -- on_conflict ------------------------------------------------------------------------------


def test_on_conflict_raise(worker: Worker, tag: str) -> None:
    first = taskapp.raise_task.delay(tag, 2.0)
    started(tag)
    second = taskapp.raise_task.delay(tag, 2.0)
    with pytest.raises(TaskLocked, match=first.id):
        second.get(timeout=RESULT_TIMEOUT)
    assert first.get(timeout=RESULT_TIMEOUT) == 2.0
    assert len(events(tag, "start")) == 1


def test_on_conflict_retry_runs_after_the_holder(worker: Worker, tag: str) -> None:
    first = taskapp.retry_task.delay(tag, 1.5)
    started(tag)
    second = taskapp.retry_task.delay(tag, 0.1)
    assert results([first, second]) == [1.5, 0.1]
    runs = events(tag, "start")
    assert [r["task_id"] for r in runs] == [first.id, second.id]
    assert runs[1]["retries"] >= 1
    assert runs[1]["wall"] >= events(tag, "end")[0]["wall"]
    assert max_concurrency(tag) == 1


@pytest.mark.slow
def test_on_conflict_wait_gives_up_after_lock_timeout(worker: Worker, tag: str) -> None:
    first = taskapp.short_wait_task.delay(tag, 3.0)
    started(tag)
    second = taskapp.short_wait_task.delay(tag, 0.1)
    with pytest.raises(TaskLocked, match="gave up waiting"):
        second.get(timeout=RESULT_TIMEOUT)
    assert first.get(timeout=RESULT_TIMEOUT) == 3.0


def test_self_retry_of_a_running_singleton_does_not_conflict_with_itself(worker: Worker, tag: str) -> None:
    handle = taskapp.self_retry_task.delay(tag, 2)
    assert handle.get(timeout=RESULT_TIMEOUT) == 2
    runs = events(tag, "start")
    assert [(r["task_id"], r["retries"]) for r in runs] == [(handle.id, 0), (handle.id, 1), (handle.id, 2)]
    assert worker.holders(taskapp.self_retry_task.lock_name_for((tag,))) == []


# -- enqueue-time dedupe ------------------------------------------------------------------------


def test_dedupe_enqueue_returns_the_queued_then_running_instance(worker: Worker, tag: str) -> None:
    first = taskapp.dedupe_task.delay(tag, 2.0)
    queued = taskapp.dedupe_task.delay(tag, 2.0)
    assert queued.id == first.id
    started(tag)
    running = taskapp.dedupe_task.apply_async((tag,), {"seconds": 2.0})
    assert running.id == first.id
    assert first.get(timeout=RESULT_TIMEOUT) == 2.0
    after = taskapp.dedupe_task.delay(tag, 0.1)
    assert after.id != first.id
    assert after.get(timeout=RESULT_TIMEOUT) == 0.1
    assert [e["task_id"] for e in events(tag, "start")] == [first.id, after.id]


@pytest.mark.slow
def test_countdown_task_is_deduped_but_holds_no_lock_while_waiting(worker: Worker, tag: str) -> None:
    later = taskapp.dedupe_task.apply_async((tag, 0.1), countdown=3)
    again = taskapp.dedupe_task.delay(tag, 0.1)
    assert again.id == later.id
    name = taskapp.dedupe_task.lock_name_for((tag,))
    assert worker.holders(name) == []
    # the lock is free while it waits: a plain singleton on the same name runs now
    with Mutex(worker.client, name, ttl=5) as lock:
        assert lock.held
    assert later.get(timeout=RESULT_TIMEOUT) == 0.1
    assert len(events(tag, "start")) == 1


# -- read-write locked tasks -----------------------------------------------------------------


@pytest.mark.slow
def test_rwlock_readers_overlap_writer_runs_alone(worker: Worker, tag: str) -> None:
    handles = [taskapp.read_task.delay(tag, 1.5), taskapp.read_task.delay(tag, 1.5)]
    started(tag, 2)
    handles += [taskapp.write_task.delay(tag, 0.5), taskapp.read_task.delay(tag, 0.5)]
    assert results(handles) == [1.5, 1.5, 0.5, 0.5]
    runs = {e["task_id"]: e for e in events(tag, "start")}
    ends = {e["task_id"]: e for e in events(tag, "end")}
    intervals = {tid: (runs[tid]["wall"], ends[tid]["wall"], runs[tid]["mode"]) for tid in runs}
    readers = [(s, e) for s, e, m in intervals.values() if m == "read"]
    (writer,) = [(s, e) for s, e, m in intervals.values() if m == "write"]
    assert max_concurrency(tag) == 2  # the two first readers overlapped
    for start, end in readers:
        assert end <= writer[0] or start >= writer[1], "a reader ran while the writer did"


# -- processes: fork safety, crashes, stops, terminations ---------------------------------------


def _etcd_connections(pid: int, port: int) -> int:
    """How many TCP connections process ``pid`` has open to ``port`` on loopback."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        remote_port = int(fields[2].split(":")[1], 16)
        if remote_port == port and fields[9] in inodes:
            count += 1
    return count


def test_each_pool_child_has_its_own_client_and_the_parent_none(worker: Worker, tag: str) -> None:
    a, b = taskapp.process_info.delay(f"{tag}-a", 1.5), taskapp.process_info.delay(f"{tag}-b", 1.5)
    infos = [a.get(timeout=RESULT_TIMEOUT), b.get(timeout=RESULT_TIMEOUT)]
    assert {i["ppid"] for i in infos} == {worker.pid}
    assert infos[0]["pid"] != infos[1]["pid"]
    for info in infos:
        assert info["clients"] == 1  # one client per process, whatever the number of task calls
        (holder,) = info["holders"]
        assert holder["holder"].endswith(f":{info['pid']}")
    port = int(worker.etcd_url.split("//")[1].split("?")[0].rsplit(":", 1)[1])
    assert _etcd_connections(worker.pid, port) == 0


@pytest.mark.slow
@pytest.mark.every_etcd  # a small part of the task tests on every etcd kind
def test_sigkilled_worker_frees_the_lock_within_ttl(worker: Worker, tag: str) -> None:
    handle = taskapp.fragile_task.delay(tag, 60)
    (start,) = started(tag)
    name = taskapp.fragile_task.lock_name_for((tag,))
    assert worker.holders(name)
    os.kill(start["pid"], signal.SIGKILL)
    killed = time.monotonic()
    wait_until(lambda: worker.holders(name) == [], taskapp.SHORT_TTL + 10, "the dead worker's lock to expire")
    assert time.monotonic() - killed <= taskapp.SHORT_TTL + 1
    assert handle.get(timeout=RESULT_TIMEOUT, propagate=False) is not None  # WorkerLostError
    assert taskapp.fragile_task.delay(tag, 0.1).get(timeout=RESULT_TIMEOUT) == 0.1


@pytest.mark.slow
def test_stopped_past_ttl_loses_lock_is_reported_and_next_run_not_blocked(worker: Worker, tag: str) -> None:
    stopped = taskapp.fragile_task.delay(tag, 3.0)
    (start,) = started(tag)
    os.kill(start["pid"], signal.SIGSTOP)
    try:
        successor = taskapp.fragile_task.delay(tag, 0.5)
        # runs on the other pool child once the stopped holder's entry expires
        wait_until(lambda: len(events(tag, "start")) == 2, 30, "the next run to start")
        assert not events(tag, "end")
    finally:
        os.kill(start["pid"], signal.SIGCONT)
    assert successor.get(timeout=RESULT_TIMEOUT) == 0.5
    with pytest.raises(LockLost, match="lost its lock"):
        stopped.get(timeout=RESULT_TIMEOUT)
    ends = {e["task_id"]: e for e in events(tag, "end")}
    assert ends[stopped.id]["held"] is False
    wait_until(lambda: re.search(rf"\[{stopped.id}\].*lost its lock", worker.text()), 10, "the loss in the log")
    assert taskapp.fragile_task.delay(tag, 0.1).get(timeout=RESULT_TIMEOUT) == 0.1


def test_revoke_with_terminate_releases_at_once(worker: Worker, tag: str) -> None:
    handle = taskapp.long_ttl_task.delay(tag, 60)
    started(tag)
    name = taskapp.long_ttl_task.lock_name_for((tag,))
    assert worker.holders(name)
    taskapp.app.control.revoke(handle.id, terminate=True)
    # well before its 60 s TTL: SIGTERM exits the child through the task's finally
    wait_until(lambda: worker.holders(name) == [], 20, "the terminated task's lock to be released")
    assert handle.get(timeout=RESULT_TIMEOUT, propagate=False) is not None
    assert handle.state == "REVOKED"


def test_soft_time_limit_releases_the_lock(worker: Worker, tag: str) -> None:
    handle = taskapp.soft_limit_task.delay(tag, 30)
    with pytest.raises(SoftTimeLimitExceeded):
        handle.get(timeout=RESULT_TIMEOUT)
    assert worker.holders(taskapp.soft_limit_task.lock_name_for((tag,))) == []


# -- at most N at once -------------------------------------------------------------------


@pytest.mark.slow
def test_limited_task_of_two_on_five_children_runs_two_at_once_and_all_of_them(worker: Worker, tag: str) -> None:
    wide = Worker(worker.etcd_url, worker.redis_url, concurrency=5)  # five children: only the limit holds them back
    try:
        handles = [taskapp.limited_task_of_two.delay(tag, 1.0) for _ in range(6)]
        assert results(handles) == [1.0] * 6  # all of them ran (they waited for a slot)
        assert max_concurrency(tag) == 2, "more than the limit ran at once, or the limit was never reached"
        assert len({e["token"] for e in events(tag, "start")}) == 6
    finally:
        wide.stop()


def test_events_switched_on_at_run_time_reach_the_pool_processes(worker: Worker, tag: str) -> None:
    """Issue 24.16: task-skipped followed -E only, not `celery control enable_events` (as Flower sends it)."""
    received: list[dict[str, Any]] = []
    receivers: list[Any] = []

    def listen() -> None:
        with taskapp.app.connection_for_read() as connection:
            receiver = taskapp.app.events.Receiver(connection, handlers={"*": received.append})
            receivers.append(receiver)
            receiver.capture(limit=None, timeout=60, wakeup=False)

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    holder = Mutex(worker.client, taskapp.skip_task.lock_name_for((tag,)), ttl=10, data={"task_id": "holder"})
    assert holder.acquire()
    skipped_ids: list[str] = []

    def a_skip_sends_its_event() -> bool:  # the pool sees the switch within a second: each try skips once more
        handle = taskapp.skip_task.delay(tag)
        assert handle.get(timeout=RESULT_TIMEOUT) is None
        skipped_ids.append(handle.id)
        return any(e["type"] == "task-skipped" and e["uuid"] in skipped_ids for e in received)

    try:
        wait_until(lambda: receivers, 20, "the event receiver")
        a_skip_sends_its_event()  # with events off: its task-skipped must never come (checked below)
        off = skipped_ids[0]
        replies = taskapp.app.control.enable_events(reply=True, timeout=10, limit=1)
        assert replies, "no worker answered enable_events"
        wait_until(a_skip_sends_its_event, 30, "a task-skipped event after enable_events", interval=0.3)
        assert off not in [e.get("uuid") for e in received if e["type"] == "task-skipped"], "sent with events off"
    finally:
        taskapp.app.control.disable_events(reply=True, timeout=10, limit=1)
        holder.release()
        for receiver in receivers:
            receiver.should_stop = True
        listener.join(timeout=20)
