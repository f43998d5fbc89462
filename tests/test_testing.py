"""celery_etcdlock.testing, the pytest plugin users opt into, tried as a user would: pytest on a sample project.

Each test writes a small project into a temporary directory (a conftest that
opts into the plugin and Celery's own fixtures, tests of a singleton task
run by ``celery_worker`` and of a Mutex) and runs pytest on it in a
subprocess, with pytest-celery loaded (it is in our test dependency group) and without it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from celery_etcdlock.testing import find_etcd

CONFTEST = """
import pytest

pytest_plugins = ("celery.contrib.pytest", "celery_etcdlock.testing")


@pytest.fixture(scope="session")
def celery_config({argument}):
    return {{
        "etcdlock_url": {url},
        "etcdlock_ttl": 10,
        "broker_transport_options": {{"polling_interval": 0.05}},  # the in-memory broker's default is 1 s
    }}
"""

TESTS = """
import threading

from celery_etcdlock import Mutex, connect, singleton_task


def test_a_singleton_task_runs_through_the_worker(celery_app, celery_worker):
    @singleton_task(app=celery_app, bind=True)
    def report(self):
        return self.lock.token

    celery_worker.reload()  # the worker learns of the task defined after it started
    assert report.delay().get(timeout=30) > 0


def test_a_run_is_skipped_while_another_holds_its_lock(celery_app, celery_worker):
    @singleton_task(app=celery_app, name="sample.busy")
    def busy():
        return "ran"

    celery_worker.reload()
    client = connect(celery_app.conf.etcdlock_url)  # another worker, as far as the lock can tell
    try:
        with Mutex(client, busy.lock_name_for(), ttl=10):
            assert busy.delay().get(timeout=30) is None
        assert busy.delay().get(timeout=30) == "ran"
    finally:
        client.close()


def test_a_mutex_on_etcd(etcdlock_client):
    first, second = Mutex(etcdlock_client, "x", ttl=5), Mutex(etcdlock_client, "x", ttl=5)
    assert first.acquire(timeout=5)
    assert not second.acquire(blocking=False)
    first.release()
    assert second.acquire(timeout=5)
    second.release()


def test_a_lock_held_across_a_restart_of_etcd_stays_held(etcd_server_per_test):
    server = etcd_server_per_test
    assert server.url == "etcd3://" + server.endpoint
    client = connect(server.url)
    try:
        with Mutex(client, "x", ttl=10) as lock:
            server.restart()  # same port, same data
            assert lock.held
    finally:
        client.close()


def test_a_mutex_on_memory(etcdlock_memory_client):
    first, second = Mutex(etcdlock_memory_client, "x", ttl=5), Mutex(etcdlock_memory_client, "x", ttl=5)
    assert first.acquire(timeout=5)
    assert first.token > 0 and not second.acquire(blocking=False)
    done = threading.Event()
    waiting = threading.Thread(target=lambda: second.acquire(timeout=10) and done.set())
    waiting.start()
    first.release()
    assert done.wait(10)
    waiting.join(10)
    second.release()
"""


THREADS_CONFTEST = """

@pytest.fixture(scope="session")
def celery_worker_pool():
    return "threads"


@pytest.fixture(scope="session")
def celery_worker_parameters():
    return {"concurrency": 2}
"""

THREADS_TESTS = """

def test_a_run_is_skipped_while_another_worker_thread_runs_it(celery_app, celery_worker):
    started, gate = threading.Event(), threading.Event()

    @singleton_task(app=celery_app, name="sample.slow")
    def slow(wait):
        if wait:
            started.set()
            gate.wait(30)
        return "ran"

    celery_worker.reload()
    first = slow.delay(True)
    assert started.wait(30)
    assert slow.delay(False).get(timeout=30) is None
    gate.set()
    assert first.get(timeout=30) == "ran"
"""


def write_project(directory: Path, on: str) -> Path:
    """A user's project whose tasks lock on etcd (``on="etcd"``, the solo pool) or on memory:// (the threads pool)."""
    directory.mkdir()
    argument, url = ("etcd_server", "etcd_server.url") if on == "etcd" else ("", '"memory://"')
    conftest, tests = CONFTEST.format(argument=argument, url=url), TESTS
    if on == "memory":
        conftest, tests = conftest + THREADS_CONFTEST, tests + THREADS_TESTS
    (directory / "conftest.py").write_text(textwrap.dedent(conftest))
    (directory / "test_sample.py").write_text(textwrap.dedent(tests))
    return directory


def run_pytest(project: Path, *options: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """pytest on ``project`` in a fresh interpreter: the installed package, nothing of our own tests."""
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS", "PYTEST_PLUGINS")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", "-v", *options, str(project)],
        cwd=project,
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=240,
    )


def counts(output: str) -> dict[str, int]:
    last = output.strip().splitlines()[-1]
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", last)}


def needs_etcd() -> None:
    if find_etcd() is None:
        pytest.skip("no etcd binary on this machine")


@pytest.mark.slow
@pytest.mark.parametrize("pytest_celery", ["loaded", "not loaded"])
def test_a_sample_project_passes_on_etcd(tmp_path: Path, pytest_celery: str) -> None:
    needs_etcd()
    options: tuple[str, ...] = ()
    if pytest_celery == "loaded":
        pytest.importorskip("pytest_celery", reason="pytest-celery is not installed")
    else:
        options = ("-p", "no:celery")  # as if pytest-celery were not installed: its entry point is "celery"
    done = run_pytest(write_project(tmp_path / "project", "etcd"), *options)
    assert counts(done.stdout) == {"passed": 5}, done.stdout + done.stderr


@pytest.mark.slow
def test_a_sample_project_on_memory_passes_without_etcd_whose_tests_are_skipped_saying_why(tmp_path: Path) -> None:
    done = run_pytest(write_project(tmp_path / "project", "memory"), env={"ETCDLOCK_ETCD": "/no/such/etcd"})
    assert counts(done.stdout) == {"passed": 4, "skipped": 2}, done.stdout + done.stderr
    assert "ETCDLOCK_ETCD='/no/such/etcd' is not an executable etcd binary" in done.stdout


def test_the_plugin_imports_without_pytest_celery_and_without_our_tests() -> None:
    code = (
        "import sys, celery_etcdlock.testing as t; "
        "assert not [m for m in sys.modules if m == 'tests' or m.startswith(('tests.', 'pytest_celery'))]; "
        "assert 'celery' not in sys.modules, 'the plugin loaded Celery'; "
        "print(sorted(n for n in ('etcd_server', 'etcdlock_client', 'etcdlock_memory_client') if hasattr(t, n)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd="/")
    assert done.stdout.strip() == "['etcd_server', 'etcdlock_client', 'etcdlock_memory_client']", done.stderr
