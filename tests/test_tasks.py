"""Singleton and read-write locked tasks, in-process: options, keys, conflicts, loss, dedupe.

Fast tests against a real etcd (both APIs) and a real Redis, with tasks
called directly or run by Celery's own in-process worker (the ``celery_worker``
fixture of ``celery.contrib.pytest``, on this module's app) on the threads and
solo pools. The real prefork worker is in test_tasks_worker.py.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, urlsplit

import celery
import pytest
from celery.contrib.testing.worker import start_worker

from celery_etcdlock import LockLost, Mutex, RWLock, TaskLocked
from celery_etcdlock.keys import encode_name
from celery_etcdlock.tasks import RWLockTask, SingletonTask, limited_task, rwlock_task, singleton_task
from tests.support import RedisServer

app = celery.Celery("inproc", set_as_current=False)
app.conf.update(
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    etcdlock_ttl=5,
    etcdlock_retry_max_delay=5,
    broker_connection_retry_on_startup=True,
)
app.loader.import_task_module("celery.contrib.testing.tasks")  # the ping of start_worker

calls: list[dict[str, Any]] = []  # what the task bodies saw, in order
gate = threading.Event()  # a body that waits on it runs until the test sets it


def record(task: Any, **seen: Any) -> None:
    lock = task.lock
    calls.append({"id": task.request.id, "token": lock.token, "held": lock.held, "name": lock.name, **seen})


@singleton_task(app=app, bind=True)
def plain_singleton(self: SingletonTask) -> str:
    record(self, holders=self.lock.holders())
    return "ran"


@singleton_task(app=app, bind=True, key=["customer_id"], on_conflict="skip")
def sync_customer(self: SingletonTask, customer_id: Any, full: bool = False) -> str:
    record(self, customer_id=customer_id)
    return "ran"


@singleton_task(app=app, bind=True, key=["customer_id"], on_conflict="raise")
def raising(self: SingletonTask, customer_id: Any) -> str:
    record(self)
    return "ran"


@singleton_task(app=app, bind=True, key=["customer_id"], on_conflict="wait", lock_timeout=0.3)
def impatient(self: SingletonTask, customer_id: Any) -> str:
    record(self)
    return "ran"


@singleton_task(app=app, bind=True, key=["customer_id"], on_conflict="wait", lock_timeout=30)
def patient(self: SingletonTask, customer_id: Any) -> str:
    record(self)
    return "ran"


@singleton_task(app=app, bind=True, key=["customer_id"], lock_ttl=2)
def fragile(self: SingletonTask, customer_id: Any) -> str:
    record(self)
    entry = self.lock.fence_entry
    assert entry is not None
    self.lock.client.backend.delete_entry(entry)  # an operator force-releases it mid-run
    deadline = time.monotonic() + 10
    while self.lock.held and time.monotonic() < deadline:
        time.sleep(0.05)
    calls.append({"held_after_delete": self.lock.held})
    return "ran"


@singleton_task(app=app, bind=True, key=["tag"])
def gated(self: SingletonTask, tag: str) -> str:
    record(self, tag=tag)
    assert gate.wait(30)
    return "ran"


@singleton_task(app=app, key="{tag}", dedupe_enqueue=True, dedupe_ttl=1)
def deduped(tag: str) -> str:
    return "ran"


@rwlock_task(app=app, bind=True, lock="index-{name}", mode="read")
def reader(self: SingletonTask, name: str) -> str:
    record(self, mode="read")
    return "read"


@rwlock_task(app=app, bind=True, lock="index-{name}", mode="write", on_conflict="skip")
def writer(self: SingletonTask, name: str) -> str:
    record(self, mode="write")
    return "written"


def _prefix(url: str) -> str:
    return parse_qs(urlsplit(url).query)["prefix"][0]


@pytest.fixture(autouse=True)
def fresh_calls() -> Iterator[None]:
    """Forget what earlier bodies saw; never leave a body waiting at the gate."""
    calls.clear()
    gate.clear()
    yield
    gate.set()


@pytest.fixture
def etcd(etcd_url: str, client: Any) -> Any:
    """Point the app at this test's etcd prefix (each API in turn); the test's own client to it."""
    app.conf.update(etcdlock_url=etcd_url, etcdlock_prefix=_prefix(etcd_url))
    return client


@pytest.fixture(scope="module")
def broker() -> Iterator[str]:
    """One real Redis for the module's broker and result backend (the app caches its connections)."""
    server = RedisServer().start()
    app.conf.update(broker_url=server.url(), result_backend=server.url())
    yield server.url()
    server.close()


@pytest.fixture
def celery_app(broker: str) -> celery.Celery:
    """What celery.contrib.pytest's ``celery_worker`` runs: this module's app, whose tasks are declared at import."""
    return app


@pytest.fixture
def celery_worker_pool() -> str:
    return "threads"


@pytest.fixture
def celery_worker_parameters() -> dict[str, Any]:
    return {"concurrency": 4, "shutdown_timeout": 30}


# -- decorators and options ---------------------------------------------------------------------


def test_decorator_forms_register_tasks_with_celery_options() -> None:
    local = celery.Celery("forms", set_as_current=False)

    @singleton_task(app=local, shared=False)
    def bare_with_app() -> None: ...

    @singleton_task(
        app=local, shared=False, name="custom.name", max_retries=7, bind=True, lock_ttl=12, on_conflict="raise"
    )
    def with_options(self: Any) -> None: ...

    class Audited(celery.Task):
        audited = True

    @singleton_task(app=local, shared=False, base=Audited)
    def with_base() -> None: ...

    @local.task(shared=False, base=SingletonTask, key=["x"], on_conflict="wait")
    def through_base(x: int) -> None: ...

    @rwlock_task(app=local, shared=False, lock="idx", mode="read", lock_timeout=3)
    def read_idx() -> None: ...

    assert isinstance(bare_with_app, SingletonTask) and bare_with_app.on_conflict == "skip"
    assert local.tasks["custom.name"].name == with_options.name == "custom.name"
    assert with_options.max_retries == 7 and with_options.lock_ttl == 12 and with_options.on_conflict == "raise"
    assert isinstance(with_base, Audited) and isinstance(with_base, SingletonTask) and with_base.audited
    assert through_base.lock_name_for((3,)) == f"task/{through_base.name}/x=3"
    assert read_idx.lock_mode == "read" and read_idx.on_conflict == "wait" and read_idx.lock_timeout == 3
    assert read_idx.lock_name_for() == "idx"


@singleton_task
def shared_rebuild() -> str:
    return "ok"


def test_bare_decorator_is_a_shared_task() -> None:
    local = celery.Celery("shared", set_as_current=False)
    local.finalize()
    task = local.tasks[f"{__name__}.shared_rebuild"]
    assert isinstance(task, SingletonTask)
    assert task.lock_name_for() == f"task/{__name__}.shared_rebuild"


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"on_conflict": "ignore"}, ValueError, "on_conflict must be one of 'skip', 'raise', 'retry', 'wait'"),
        ({"key": ["customer"]}, ValueError, "key names 'customer' that are not arguments"),
        ({"key": 5}, TypeError, "key must be None, a list of argument names"),
        ({"key": ""}, ValueError, "key must not be an empty string"),
        ({"lock_ttl": 0}, ValueError, "lock_ttl must be a positive number"),
        ({"lock_ttl": "30"}, TypeError, "lock_ttl must be a number"),
        ({"lock_timeout": -1}, ValueError, "lock_timeout must be a non-negative number"),
        ({"dedupe_enqueue": "yes"}, TypeError, "dedupe_enqueue must be True or False"),
        ({"dedupe_ttl": 0}, ValueError, "dedupe_ttl must be a positive number"),
    ],
)
def test_bad_singleton_options_are_named(options: dict[str, Any], error: type[Exception], match: str) -> None:
    local = celery.Celery("bad", set_as_current=False)
    with pytest.raises(error, match=match):

        @singleton_task(app=local, shared=False, **options)
        def sync(customer_id: int) -> None: ...


@pytest.mark.parametrize(
    ("key", "match"),
    [
        ("customer_id", r'is a constant.*write key=\["customer_id"\] or key="\{customer_id\}"'),
        ("customer_id, region", r'key=\["customer_id", "region"\] or key="\{customer_id\}:\{region\}"'),
        ("{customer}:{region}", r"key '\{customer\}:\{region\}' names 'customer' that are not arguments"),
        ("{2}", "names positional argument 2, but .* takes 2 positional arguments"),
        ("{customer_id", "is not a valid format string"),
    ],
    ids=["argument-name", "argument-names", "missing-name", "missing-index", "malformed"],
)
def test_a_string_key_naming_an_argument_or_a_missing_one_is_refused_at_definition(key: str, match: str) -> None:
    """key="customer_id" would lock every customer's runs under one key (issue 24.12)."""
    local = celery.Celery("keys", set_as_current=False)
    with pytest.raises(ValueError, match=match):

        @singleton_task(app=local, shared=False, key=key)
        def sync(customer_id: int, region: str = "eu") -> None: ...

    @local.task(shared=False, base=SingletonTask, key=key)
    def through_base(customer_id: int, region: str = "eu") -> None: ...

    with pytest.raises(ValueError, match=match):
        through_base.lock_name_for((1,))  # the class is checked when registered, at its first use
    with pytest.raises(ValueError, match="lock '{missing}' names 'missing'"):
        rwlock_task(app=local, shared=False, lock="{missing}", mode="read")(lambda customer_id: None)

    @singleton_task(app=local, shared=False, key="nightly")  # a constant that names no argument is fine
    def constant(customer_id: int) -> None: ...

    @singleton_task(app=local, shared=False, key="{}:{region}")
    def formatted(customer_id: int, region: str = "eu") -> None: ...

    assert constant.lock_name_for((1,)) == f"task/{constant.name}/nightly"
    assert formatted.lock_name_for((1,)) == f"task/{formatted.name}/1:eu"


def test_the_lock_options_have_one_list() -> None:
    """Class attributes, decorator signatures and docs all derive from LockOptions (issue 25.2)."""
    import dataclasses
    import inspect

    from celery_etcdlock.tasks.options import LOCK_OPTIONS, LockOptions

    names = [f.name for f in dataclasses.fields(LockOptions)]
    assert list(LOCK_OPTIONS) == names
    for name in names:
        assert hasattr(SingletonTask, name) and f"``{name}``" in (SingletonTask.__mro__[1].__doc__ or "")
    shown = inspect.signature(singleton_task).parameters
    assert shown["on_conflict"].default == "skip" and shown["key"].default is None and "lock_mode" not in shown
    assert inspect.signature(limited_task).parameters["limit"].default is inspect.Parameter.empty
    assert {"lock", "mode"} <= set(inspect.signature(rwlock_task).parameters)
    assert "``dedupe_enqueue``" in (singleton_task.__doc__ or "")


def test_bad_rwlock_options_are_named() -> None:
    local = celery.Celery("bad", set_as_current=False)
    with pytest.raises(ValueError, match="mode must be 'read' or 'write', not 'exclusive'"):
        rwlock_task(app=local, shared=False, lock="x", mode="exclusive")
    with pytest.raises(TypeError, match="missing the lock= argument"):
        rwlock_task(app=local, shared=False, mode="read")
    with pytest.raises(TypeError, match="does not take dedupe_enqueue"):
        rwlock_task(app=local, shared=False, lock="x", mode="write", dedupe_enqueue=True)
    with pytest.raises(TypeError, match="base=.* must be a celery Task subclass"):
        singleton_task(app=local, shared=False, base=dict)


def test_bad_base_class_options_fail_when_registered() -> None:
    local = celery.Celery("bad", set_as_current=False)

    @local.task(shared=False, base=SingletonTask, key=["nope"])
    def job(x: int) -> None: ...

    with pytest.raises(ValueError, match="key names 'nope'"):
        job.lock_name_for((1,))  # registration is lazy: the first use of the task checks


# -- keys ------------------------------------------------------------------------------------------


def test_key_by_argument_names_binds_through_the_signature() -> None:
    name = sync_customer.lock_name_for
    assert name((1,)) == name((), {"customer_id": 1}) == name((1, True)) == name((), {"full": True, "customer_id": 1})
    assert name((1,)) == f"task/{sync_customer.name}/customer_id=1"
    assert name((1,)) != name(("1",))  # JSON-typed: 1 and "1" are different customers
    assert name(("a/b é",)) == f'task/{sync_customer.name}/customer_id="a/b \\u00e9"'
    with pytest.raises(TypeError, match="do not fit its signature"):
        name((), {"other": 1})


def test_key_format_string_and_callable() -> None:
    local = celery.Celery("keys", set_as_current=False)

    @singleton_task(app=local, shared=False, key="{region}:{0}")
    def fmt(customer_id: int, region: str = "eu") -> None: ...

    @singleton_task(app=local, shared=False, key=lambda args, kwargs: f"c{kwargs.get('customer_id') or args[0]}")
    def by_callable(customer_id: int) -> None: ...

    @singleton_task(app=local, shared=False, key=lambda args, kwargs: 42)
    def bad_callable(customer_id: int) -> None: ...

    assert fmt.lock_name_for((7,)) == f"task/{fmt.name}/eu:7"
    assert fmt.lock_name_for((7,), {"region": "us"}) == f"task/{fmt.name}/us:7"
    assert by_callable.lock_name_for((3,)) == by_callable.lock_name_for((), {"customer_id": 3})
    with pytest.raises(TypeError, match="must return a non-empty str, not 42"):
        bad_callable.lock_name_for((1,))


# -- running (called directly: same code path as in a worker) -------------------------------------


def test_bound_task_sees_its_lock_and_token_and_the_lock_records_the_holder(etcd: Any) -> None:
    assert plain_singleton() == "ran"
    (seen,) = calls
    assert seen["held"] and isinstance(seen["token"], int)
    (holder,) = seen["holders"]
    assert holder["token"] == seen["token"]
    assert holder["data"]["task"] == plain_singleton.name and holder["data"]["hostname"]
    assert plain_singleton.lock is None  # outside a run
    assert Mutex(etcd, seen["name"], ttl=5).holders() == []  # released


def test_conflict_skip_raise_and_wait(etcd: Any) -> None:
    with Mutex(etcd, sync_customer.lock_name_for((1,)), ttl=5, data={"task_id": "other"}):
        assert sync_customer(1) is None
        assert sync_customer(2) == "ran"  # another key
    assert sync_customer(customer_id=1) == "ran"

    with Mutex(etcd, raising.lock_name_for((1,)), ttl=5, data={"task_id": "t-1", "task": "x", "hostname": "h"}):
        with pytest.raises(TaskLocked, match=r"held by task x\[t-1\] on h") as raised:
            raising(1)
        assert raised.value.lock_name == raising.lock_name_for((1,))
        assert raised.value.holder is not None and raised.value.holder["data"]["task_id"] == "t-1"
    with Mutex(etcd, impatient.lock_name_for((1,)), ttl=5), pytest.raises(TaskLocked, match="gave up waiting"):
        impatient(1)
    assert [c["name"] for c in calls] == [sync_customer.lock_name_for((2,)), sync_customer.lock_name_for((1,))]


def test_wait_runs_once_the_holder_releases(etcd: Any) -> None:
    holder = Mutex(etcd, patient.lock_name_for((1,)), ttl=5)
    holder.acquire()
    releaser = threading.Timer(0.5, holder.release)
    releaser.start()
    started = time.monotonic()
    assert patient(1) == "ran"
    assert time.monotonic() - started >= 0.4
    releaser.join()


def test_wait_keeps_its_place_in_the_queue(etcd: Any, monkeypatch: Any) -> None:
    """A waiting run joins once: it is served before anyone who queued after it, with the token it queued with."""
    from celery_etcdlock.settings import client_for
    from tests.support import wait_until

    name = patient.lock_name_for((7,))
    queue = f"locks/{encode_name(name)}"
    joins: list[str] = []
    backend = client_for(app).backend  # the run's own client: count its joins, all of them real requests
    for method in ("join_queue", "join_queue_if_empty"):
        real = getattr(backend, method)
        monkeypatch.setattr(backend, method, lambda q, *a, _real=real, **k: (joins.append(q), _real(q, *a, **k))[1])
    holder = Mutex(etcd, name, ttl=5)
    assert holder.acquire(timeout=5)
    ran: list[str] = []
    runner = threading.Thread(target=lambda: ran.append(patient(7)))
    runner.start()
    queued = wait_until(lambda: etcd.backend.read_queue(queue).entries[1:], 10, "the waiting run to queue")
    later = Mutex(etcd, name, ttl=5)
    behind = threading.Thread(target=lambda: later.acquire(timeout=10))
    behind.start()
    wait_until(lambda: len(etcd.backend.read_queue(queue).entries) == 3, 10, "a later request to queue behind it")
    holder.release()
    runner.join(10)
    behind.join(10)
    assert ran == ["ran"]
    assert joins == [queue], "the run left the queue and joined it again"
    assert calls[-1]["token"] == queued[0].token, "the run queued again instead of keeping its place"
    assert later.held and later.token > queued[0].token
    later.release()


def test_lock_lost_mid_run_is_reported_and_next_run_not_blocked(etcd: Any, caplog: Any) -> None:
    with pytest.raises(LockLost, match="lost its lock"):
        fragile(1)
    assert calls[-1] == {"held_after_delete": False}
    assert "lost its lock" in caplog.text
    assert Mutex(etcd, fragile.lock_name_for((1,)), ttl=2).holders() == []
    with pytest.raises(LockLost):  # runs again at once (and loses again, by design of the body)
        fragile(1)


def test_rwlock_task_readers_share_writer_excluded(etcd: Any) -> None:
    with RWLock(etcd, "index-a", ttl=5).read():
        assert reader("a") == "read"
        assert writer("a") is None  # on_conflict="skip": a reader holds it
    assert writer("a") == "written"
    assert [c["mode"] for c in calls] == ["read", "write"]


# -- through an embedded worker --------------------------------------------------------------------


def test_threads_pool_concurrent_submissions_one_runs(etcd: Any, celery_worker: Any) -> None:
    tag = uuid.uuid4().hex
    handles = [gated.delay(tag) for _ in range(5)]
    # while the first run waits at the gate, the four others are skipped
    deadline = time.monotonic() + 30
    while sum(h.ready() for h in handles) < 4:
        assert time.monotonic() < deadline, "the other submissions were not skipped"
        time.sleep(0.02)
    gate.set()
    values = [h.get(timeout=30) for h in handles]
    assert sorted(values, key=str) == [None, None, None, None, "ran"]
    assert len([c for c in calls if c.get("tag") == tag]) == 1


@pytest.mark.parametrize("celery_worker_pool", ["solo"])
def test_solo_pool(etcd: Any, celery_worker: Any) -> None:
    assert sync_customer.delay(5).get(timeout=30) == "ran"
    assert calls[-1]["customer_id"] == 5 and calls[-1]["id"] is not None


def test_dedupe_marker_of_a_lost_message_expires(broker: str, etcd: Any) -> None:
    # no worker consumes this queue: the message is as good as lost
    first = deduped.apply_async(("t",), queue=f"nobody-{uuid.uuid4().hex}")
    again = deduped.apply_async(("t",), queue="elsewhere")
    assert again.id == first.id
    deadline = time.monotonic() + 10
    while deduped.apply_async(("t",), queue="elsewhere").id == first.id:
        assert time.monotonic() < deadline, "the enqueue marker never expired"
        time.sleep(0.2)


@singleton_task(app=app, key="{pair}", dedupe_enqueue=True, dedupe_ttl=30)
def paired(pair: Any) -> Any:
    return pair


def test_dedupe_marker_is_named_as_the_worker_will_name_the_lock(broker: str, etcd: Any) -> None:
    """A tuple argument arrives as a list (JSON): the marker must carry the run's lock name."""
    from celery_etcdlock.tasks.dedupe import EnqueueMarkers

    sent = paired.apply_async(((1, 2),), queue=f"nobody-{uuid.uuid4().hex}")
    as_run = paired.lock_name_for(([1, 2],), {})
    marker = EnqueueMarkers(etcd).store.get(as_run)
    assert marker is not None and marker.value["task_id"] == sent.id


def test_url_options_hold_unless_a_setting_overrides_them() -> None:
    from celery_etcdlock.settings import Settings, client_for

    local = celery.Celery("settings", set_as_current=False)
    local.conf.etcdlock_url = "etcd://127.0.0.1:1?prefix=/from-url&retry_max_delay=4"
    client = client_for(local)  # connect() talks to nobody yet
    assert (client.prefix, client.options.retry_max_delay) == ("/from-url", 4)
    local.conf.etcdlock_prefix, local.conf.etcdlock_retry_max_delay = "/from-setting", 0.5
    settings = Settings.from_app(local)
    assert (settings.prefix, settings.retry_max_delay) == ("/from-setting", 0.5)
    client = client_for(local)
    assert (client.prefix, client.options.retry_max_delay) == ("/from-setting", 0.5)


@pytest.mark.parametrize(
    ("setting", "value"),
    [("etcdlock_retry_max_delay", "soon"), ("etcdlock_retry_max_delay", -1), ("etcdlock_ttl", 0)],
)
def test_bad_settings_are_named(setting: str, value: Any) -> None:
    from celery_etcdlock.settings import Settings

    local = celery.Celery("settings", set_as_current=False)
    local.conf[setting] = value
    with pytest.raises((ValueError, TypeError), match=setting):
        Settings.from_app(local)


# -- options users bring with them ------------------------------------------------------------------


def test_class_based_tasks_take_the_decorators_option_names(etcd: Any) -> None:
    local = celery.Celery("classy", set_as_current=False)
    local.conf.update(etcdlock_url=app.conf.etcdlock_url, etcdlock_prefix=app.conf.etcdlock_prefix)

    @local.task(shared=False, base=RWLockTask, bind=True, lock="index-{name}", mode="read")
    def read_index(self: Any, name: str) -> str:
        return f"{self.lock.mode} {self.lock.name}"

    task = local.tasks[read_index.name]
    assert (task.lock_name, task.lock_mode) == ("index-{name}", "read")
    assert isinstance(type(task).__dict__.get("lock", type(task).lock), property)  # the lock property survives
    with RWLock(etcd, "index-b", ttl=5).read():  # another reader: shared, not the task's own exclusive lock
        assert read_index("b") == "read index-b"
    with pytest.raises(TypeError, match="give lock= or lock_name=, not both"):

        @local.task(shared=False, base=RWLockTask, lock="a", lock_name="b", mode="read")
        def both() -> None: ...

        local.tasks[both.name]


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"unique_on": ["customer_id"]}, r"unique_on= is celery-singleton's unique_on: use key="),
        ({"lock_expiry": 60}, "use lock_ttl="),
        ({"raise_on_duplicate": True}, "use on_conflict='raise'"),
        ({"once": {"keys": ["customer_id"], "graceful": True}}, "celery-once's once="),
        ({"keys": ["customer_id"]}, "celery-once's keys: use key="),
        ({"graceful": True}, "use on_conflict='skip'"),
        ({"lock_tll": 60}, "unknown option 'lock_tll'; did you mean 'lock_ttl'"),
        ({"on_conflit": "raise"}, "did you mean 'on_conflict'"),
    ],
)
def test_options_of_other_libraries_and_misspellings_fail_at_definition(options: dict[str, Any], match: str) -> None:
    local = celery.Celery("migrating", set_as_current=False)
    with pytest.raises(TypeError, match=match):

        @singleton_task(app=local, shared=False, **options)
        def sync(customer_id: int) -> None: ...

    with pytest.raises(TypeError, match=match):  # the class-based form too

        @local.task(shared=False, base=SingletonTask, **options)
        def sync_too(customer_id: int) -> None: ...

        local.tasks[sync_too.name]


def test_unknown_options_far_from_ours_are_left_to_celery() -> None:
    local = celery.Celery("own", set_as_current=False)

    @singleton_task(app=local, shared=False, audit_level=3)  # a user's own task attribute
    def job() -> None: ...

    assert local.tasks[job.name].audit_level == 3


@singleton_task(app=app, bind=True, key=["email"], hash_key=True)
def private(self: SingletonTask, email: str) -> str:
    record(self, holders=self.lock.holders())
    return "ran"


def test_hash_key_keeps_argument_values_out_of_keys_and_holders(etcd: Any) -> None:
    name = private.lock_name_for(("someone@example.com",))
    assert name.startswith(f"task/{private.name}/sha256:") and "example" not in name
    assert private.lock_name_for((), {"email": "someone@example.com"}) == name
    assert private.lock_name_for(("other@example.com",)) != name
    assert private("someone@example.com") == "ran"
    assert calls[-1]["name"] == name
    assert "example" not in json.dumps(calls[-1]["holders"])


def test_a_huge_key_argument_gets_a_bounded_key(etcd: Any, caplog: Any) -> None:
    huge = "x" * 600_000  # as a key, twice in one transaction: over etcd's 1.5 MiB request limit
    assert sync_customer(huge) == "ran"
    for logger in ("celery_etcdlock", "celery_etcdlock.tasks"):  # tasks logs through Celery's logger tree
        caplog.set_level(logging.DEBUG, logger=logger)
    with Mutex(etcd, sync_customer.lock_name_for((huge,)), ttl=5):  # the same lock, found again
        assert sync_customer(huge) is None
        [queue] = etcd.backend.list_queues("locks")
        assert len(queue) < 300 and queue.startswith("locks/" + encode_name(f"task/{sync_customer.name}/"))
    with Mutex(etcd, raising.lock_name_for((huge,)), ttl=5), pytest.raises(TaskLocked) as raised:
        raising(huge)
    # issue 24.14: the skip's INFO line carried all 600,000 characters of the key, and so did the error
    assert "skipped" in caplog.text and "characters, sha256 " in caplog.text
    assert max(len(r.getMessage()) for r in caplog.records) < 1000
    assert len(str(raised.value)) < 1000 and raised.value.lock_name == raising.lock_name_for((huge,))


# -- settings ---------------------------------------------------------------------------------------


def test_an_unset_url_is_named_when_etcd_cannot_be_reached() -> None:
    from celery_etcdlock import BackendUnavailable
    from celery_etcdlock.settings import UNSET_URL_RETRY_MAX_DELAY, Settings

    local = celery.Celery("fresh", set_as_current=False)
    settings = Settings.from_app(local)
    assert not settings.url_is_set and settings.url == "etcd3://127.0.0.1:2379"
    assert settings.retry_max_delay == UNSET_URL_RETRY_MAX_DELAY  # a first try fails fast
    explained = settings.explain(BackendUnavailable("etcd unreachable at http://127.0.0.1:2379: refused"))
    assert "etcdlock_url is not set" in str(explained) and "CELERY_ETCDLOCK_URL" in str(explained)


def test_an_unreachable_url_is_named_in_a_task_error_without_its_password() -> None:
    from tests.support import free_port

    local = celery.Celery("unreachable", set_as_current=False)
    local.conf.update(etcdlock_url=f"etcd3://app:s3cret@127.0.0.1:{free_port()}", etcdlock_retry_max_delay=0.5)

    @singleton_task(app=local, shared=False)
    def job() -> None: ...

    with pytest.raises(Exception, match="etcdlock_url is etcd3://app:\\*\\*\\*@127.0.0.1") as raised:
        local.tasks[job.name]()
    assert "s3cret" not in str(raised.value)


@pytest.mark.slow
@pytest.mark.parametrize("celery_worker_pool", ["solo"])
def test_celery_settings_dumps_mask_the_etcd_password(etcd: Any, celery_worker: Any) -> None:
    """What `celery report` prints and `celery inspect conf` answers never carries the etcd password."""
    import celery_etcdlock.settings  # noqa: F401  (installs the masking, as any use of the package does)

    local = celery.Celery("masked", set_as_current=False)
    local.config_from_object({"CELERY_ETCDLOCK_URL": "etcd3://app:pa%2Fss@h:2379"}, namespace="CELERY")
    table = local.conf.table(with_defaults=False)
    assert table["CELERY_ETCDLOCK_URL"] == "etcd3://app:***@h:2379"
    assert "pa%2Fss" not in local.conf.humanize()
    previous = app.conf.etcdlock_url
    app.conf.etcdlock_url = previous.replace("://", "://app:w0rd@", 1)
    try:
        answers = app.control.inspect(timeout=10).conf()
        assert answers, "no worker answered inspect conf"
        shown = json.dumps(answers)
        assert "etcdlock_url" in shown and "w0rd" not in shown and "app:***@" in shown
    finally:
        app.conf.etcdlock_url = previous


@app.task(shared=False)
def echo(value: Any) -> Any:
    return value


def test_an_expired_message_never_stalls_the_consumer_while_etcd_is_down(broker: str, own_etcd: Any) -> None:
    """The consumer handles revoked and expired messages itself: it must never wait for etcd (10.7)."""
    url = own_etcd.url(prefix=f"/stall-{uuid.uuid4().hex[:8]}")
    from tests.support import wait_until

    previous = {k: app.conf.get(k) for k in ("etcdlock_url", "etcdlock_prefix", "etcdlock_retry_max_delay")}
    app.conf.update(etcdlock_url=url, etcdlock_prefix=_prefix(url), etcdlock_retry_max_delay=120)
    try:
        expires_at = time.time() + 0.2
        doomed = deduped.apply_async(("stall",), expires=0.2)  # its marker is in etcd now
        own_etcd.stop()
        wait_until(lambda: time.time() > expires_at + 0.1, 5, "the message to expire unconsumed")
        # the consumer meets the expired message first; forgetting its marker would wait 120 s for etcd.
        # (start_worker is what the celery_worker fixture runs, started here: after the message expired)
        with start_worker(app, pool="threads", concurrency=2, perform_ping_check=True, shutdown_timeout=30):
            assert echo.delay("through").get(timeout=20) == "through"
        assert doomed.state == "REVOKED"
    finally:
        app.conf.update(previous)


# -- limited tasks and reschedule -------------------------------------------------------------------

inside = {"now": 0, "most": 0}
inside_lock = threading.Lock()


@limited_task(app=app, limit=2, key=["pool"], bind=True)
def limited(self: Any, pool: str) -> int:
    with inside_lock:
        inside["now"] += 1
        inside["most"] = max(inside["most"], inside["now"])
    try:
        assert gate.wait(30)
        return self.lock.token
    finally:
        with inside_lock:
            inside["now"] -= 1


def test_limited_task_runs_at_most_limit_at_once_and_all_of_them(etcd: Any, celery_worker: Any) -> None:
    from tests.support import wait_until

    inside.update(now=0, most=0)
    pool = uuid.uuid4().hex
    handles = [limited.delay(pool) for _ in range(5)]
    wait_until(lambda: inside["now"] == 2, 30, "two runs inside")
    queue = f"semaphores/{encode_name(limited.lock_name_for((pool,)))}"
    # the worker runs 4 at a time: 2 inside, 2 waiting in the semaphore's queue
    wait_until(lambda: len(limited_client().backend.read_queue(queue).entries) == 4, 30, "two runs waiting")
    assert inside["now"] == 2
    gate.set()
    tokens = [h.get(timeout=60) for h in handles]
    assert inside["most"] == 2, f"{inside['most']} runs were inside a limit of 2"
    assert len(set(tokens)) == 5


def limited_client() -> Any:
    from celery_etcdlock.settings import client_for

    return client_for(app)


@singleton_task(app=app, bind=True, key=["n"], on_conflict="reschedule", max_retries=0,
                reschedule_countdown=0.2, reschedule_max_countdown=0.4)  # fmt: skip
def rescheduled(self: Any, n: int) -> dict[str, Any]:
    return {"retries": self.request.retries, "rescheduled": (self.request.get("etcdlock_rescheduled") or {})}


def test_reschedule_requeues_without_counting_a_retry(etcd: Any, celery_worker: Any) -> None:
    from tests.support import wait_until

    holder = Mutex(etcd, rescheduled.lock_name_for((1,)), ttl=5)
    assert holder.acquire(timeout=5)
    handle = rescheduled.delay(1)
    # rescheduled again and again while the lock is held, although max_retries=0 allows no retry
    wait_until(lambda: _rescheduled.get(handle.id, 0) >= 2, 30, "two reschedules")
    assert handle.state == "RETRY" and isinstance(handle.info, TaskLocked)
    holder.release()
    result = handle.get(timeout=30)
    assert result["retries"] == 0  # never counted as a retry: with max_retries=0 a retry would have failed
    assert result["rescheduled"]["count"] >= 2


_rescheduled: dict[str, int] = {}  # task id -> how often the worker saw it rescheduled (a RETRY state)


@celery.signals.task_retry.connect(weak=False)
def _count_reschedules(request: Any = None, **_: Any) -> None:
    if request is not None:
        _rescheduled[request.id] = _rescheduled.get(request.id, 0) + 1


@singleton_task(app=app, key=["n"], on_conflict="reschedule", reschedule_countdown=0.2, reschedule_for=1)
def give_up(n: int) -> str:
    return "ran"


def test_reschedule_gives_up_after_reschedule_for(etcd: Any, celery_worker: Any) -> None:
    with Mutex(etcd, give_up.lock_name_for((1,)), ttl=5):
        handle = give_up.delay(1)
        with pytest.raises(TaskLocked, match="gave up after being rescheduled"):
            handle.get(timeout=30, propagate=True)


# -- signals and events ------------------------------------------------------------------------------


QUIET_UNTIL_CONNECTED = """
from celery_etcdlock import observe, signals, tasks  # the whole Celery layer, hooks connected
assert observe._subscribers == [], observe._subscribers
receiver = lambda sender, **kwargs: None
signals.lock_acquired.connect(receiver)
assert observe._subscribers, "a receiver connected, but the primitives' reports go nowhere"
signals.lock_acquired.disconnect(receiver)
assert observe._subscribers == [], observe._subscribers
print("OK")
"""


def test_importing_the_signals_costs_nothing_until_a_receiver_connects() -> None:
    """observe's promise: with nobody listening, a report is one test of an empty list (issue 25.6)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", QUIET_UNTIL_CONNECTED], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "OK", done.stdout + done.stderr


def test_lock_and_leader_signals_carry_what_they_document(etcd: Any) -> None:
    from celery_etcdlock import Election, signals
    from celery_etcdlock.cli import force_release
    from tests.support import wait_until

    seen: dict[str, list[dict[str, Any]]] = {name: [] for name in
                                             ("lock_acquired", "lock_released", "lock_lost", "leader_elected",
                                              "leader_deposed")}  # fmt: skip
    receivers = {name: (lambda sender, _n=name, **kw: seen[_n].append({"sender": sender, **kw})) for name in seen}
    for name, receiver in receivers.items():
        getattr(signals, name).connect(receiver)
    try:
        lock = Mutex(etcd, "signalled", ttl=3, data={"task_id": "t-9"})
        assert lock.acquire(timeout=5)
        lock.release()
        assert lock.acquire(timeout=5)
        force_release(etcd, "signalled")
        wait_until(lambda: seen["lock_lost"], 10, "lock_lost")
        lock.release()
        election = Election(etcd, "signalled", identity="me", ttl=3)
        assert election.campaign(timeout=5)
        election.resign()
    finally:
        for name, receiver in receivers.items():
            getattr(signals, name).disconnect(receiver)
    acquired, released, lost = seen["lock_acquired"][0], seen["lock_released"][0], seen["lock_lost"][0]
    assert acquired["sender"] == acquired["name"] == "signalled" and acquired["kind"] == "mutex"
    assert acquired["task_id"] == "t-9" and acquired["holder"] == lock.holder and acquired["waited"] >= 0
    assert released["token"] == acquired["token"] and released["held"] >= 0
    assert lost["cause"] == "deleted" and lost["token"] > acquired["token"]
    elected = {k: v for k, v in seen["leader_elected"][0].items() if k != "signal"}
    assert elected == {"sender": "signalled", "name": "signalled", "identity": "me", "token": elected["token"]}
    assert seen["leader_deposed"][0]["cause"] is None  # it resigned


@pytest.mark.parametrize("celery_worker_parameters", [{"concurrency": 2, "shutdown_timeout": 30, "task_events": True}])
def test_a_skipped_run_sends_task_skipped_and_an_event_when_events_are_on(etcd: Any, celery_worker: Any) -> None:
    from celery_etcdlock import signals

    skipped: list[dict[str, Any]] = []
    received: list[dict[str, Any]] = []

    def on_skipped(sender: Any, **kwargs: Any) -> None:
        skipped.append({"sender": sender, **kwargs})

    signals.task_skipped.connect(on_skipped)
    assert signals.events_on(), "the worker, started with task events on (-E), did not turn ours on"

    receivers: list[Any] = []

    def listen() -> None:
        with app.connection_for_read() as connection:
            receiver = app.events.Receiver(connection, handlers={"*": received.append})
            receivers.append(receiver)
            receiver.capture(limit=None, timeout=20, wakeup=False)

    def probe_arrived() -> bool:  # the receiver listens once an event sent now reaches it
        signals.send_event("test-probe")
        return any(e["type"] == "test-probe" for e in received)

    from tests.support import wait_until

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    try:
        wait_until(probe_arrived, 20, "the event receiver to listen", interval=0.1)
        name = sync_customer.lock_name_for((77,))
        with Mutex(etcd, name, ttl=5, data={"task_id": "holder-1", "task": "x", "hostname": "h"}):
            handle = sync_customer.delay(77)
            assert handle.get(timeout=30) is None
        wait_until(lambda: [e for e in received if e["type"] == "task-skipped"], 20, "the task-skipped event")
    finally:
        signals.task_skipped.disconnect(on_skipped)
        signals._events.update(enabled=False, flag=None)
        # issue 24.19: the listener outlived the test and died on the closed Redis with two tracebacks
        for receiver in receivers:
            receiver.should_stop = True
        listener.join(timeout=20)
    assert not listener.is_alive(), "the event receiver did not stop"
    assert skipped and skipped[0]["sender"].name == sync_customer.name and skipped[0]["task_id"] == handle.id
    assert skipped[0]["lock_name"] == name and skipped[0]["holders"][0]["data"]["task_id"] == "holder-1"
    [event] = [e for e in received if e["type"] == "task-skipped"]
    assert event["uuid"] == handle.id and event["name"] == sync_customer.name and event["lock"] == name
    assert event["holders"][0]["data"]["task_id"] == "holder-1"
