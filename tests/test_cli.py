"""``celery etcdlock``: locks, leader, release, against a real etcd with locks held by other processes.

The holders are real processes (tests.procs) holding real Mutex, RWLock and Election
entries; the CLI runs through Celery's own command line (``celery -A app etcdlock ...``),
in-process with click's runner, plus once as the installed ``celery`` program to prove the
``celery.commands`` entry point.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery.bin.celery import celery as celery_cli
from click.testing import CliRunner, Result

from tests.procs import REPO_ROOT, Proc
from tests.support import free_port

pytestmark = pytest.mark.timeout(180)

HOLDER = """
import os, sys
from celery_etcdlock import Election, Mutex, RWLock, Semaphore, connect

client = connect(os.environ["URL"])
kind, name = sys.argv[1], sys.argv[2]
data = {"task_id": "id-" + sys.argv[3], "task": "shop.report", "hostname": sys.argv[3] + "@box"}
lost = lambda lock: print("lost", flush=True)
if kind == "candidate":
    election = Election(client, name, identity=sys.argv[3], ttl=10)
    election.start()
    print("campaigning", flush=True)
    for event in election.events():
        print(event.kind, event.leader, election.token, flush=True)
else:
    if kind == "mutex":
        lock = Mutex(client, name, ttl=10, on_lost=lost, data=data)
    elif kind == "slot":
        lock = Semaphore(client, name, limit=3, ttl=10, on_lost=lost, data=data)
    else:
        lock = RWLock(client, name, ttl=10).read(on_lost=lost, data=data)
    print("queueing", flush=True)
    lock.acquire()
    print("held", lock.token, flush=True)
    sys.stdin.readline()
"""


def split_url(url: str) -> tuple[str, str]:
    base, _, query = url.partition("?prefix=")
    return base, query


@pytest.fixture
def cli_app(tmp_path: Path, etcd_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A Celery app module whose etcdlock settings point at this test's etcd and prefix."""
    return make_app(tmp_path, monkeypatch, *split_url(etcd_url))


def make_app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str, prefix: str, **conf: Any) -> str:
    module = f"cliapp_{uuid.uuid4().hex[:8]}"
    settings = {"etcdlock_url": url, "etcdlock_prefix": prefix, **conf}
    (tmp_path / f"{module}.py").write_text(
        f"from celery import Celery\napp = Celery({module!r})\napp.conf.update({settings!r})\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return module


@pytest.fixture
def run_cli(cli_app: str) -> Callable[..., Result]:
    def run(*args: str, input: str | None = None) -> Result:
        return CliRunner().invoke(celery_cli, ["-A", cli_app, "etcdlock", *args], input=input, catch_exceptions=False)

    return run


@pytest.fixture
def holders(etcd_url: str) -> Iterator[Callable[..., Proc]]:
    started: list[Proc] = []

    def start(kind: str, name: str, who: str) -> Proc:
        proc = Proc.start(HOLDER, kind, name, who, env={"URL": etcd_url}, name=f"{kind}-{who}")
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()


def poll(what: str, check: Callable[[], Any], timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def locks_json(run_cli: Callable[..., Result]) -> dict[str, Any]:
    result = run_cli("locks", "--json")
    assert result.exit_code == 0, result.output
    return {lock["name"]: lock for lock in json.loads(result.output)}


def test_locks_shows_holders_tokens_hosts_and_waiters(run_cli: Callable[..., Result], holders: Callable[..., Proc]):
    holder = holders("mutex", "reports/daily", "worker-1")
    token = int(holder.expect(r"held (\d+)").group(1))
    waiter = holders("mutex", "reports/daily", "worker-2")
    waiter.expect("queueing")
    reader_tokens = []
    for who in ("reader-1", "reader-2"):
        reader_tokens.append(int(holders("read", "search-index", who).expect(r"held (\d+)").group(1)))

    locks = poll("the waiter's entry", lambda: (s := locks_json(run_cli)) and s["reports/daily"]["waiters"] and s)

    daily = locks["reports/daily"]
    assert daily["mode"] == "write"
    assert [(h["token"], h["task_id"], h["host"], h["task"]) for h in daily["holders"]] == [
        (token, "id-worker-1", "worker-1@box", "shop.report")
    ]
    assert [w["task_id"] for w in daily["waiters"]] == ["id-worker-2"]
    assert daily["waiters"][0]["token"] > token
    index = locks["search-index"]
    assert index["mode"] == "read"
    assert sorted(h["token"] for h in index["holders"]) == sorted(reader_tokens)
    assert index["waiters"] == []
    for lock in (daily, index):
        for h in lock["holders"]:
            assert h["ttl"] is None or 0 < h["ttl"] <= 10
            assert re.fullmatch(r"[^:]+:\d+", h["holder"]), h  # "host:pid" of the holding process

    table = run_cli("locks")
    assert table.exit_code == 0, table.output
    lines = table.output.splitlines()
    assert lines[0].split()[:3] == ["NAME", "MODE", "TOKEN"]
    daily_line = next(line for line in lines if line.startswith("reports/daily"))
    assert daily_line.split()[:6] == [
        "reports/daily",
        "write",
        str(token),
        "shop.report",
        "id-worker-1",
        "worker-1@box",
    ]
    assert daily_line.split()[-1] == "1"  # one waiter
    assert sum(1 for line in lines if " read " in line) == 2


def test_locks_when_nothing_is_held(run_cli: Callable[..., Result]):
    assert run_cli("locks").output.strip() == "No lock is held."
    assert json.loads(run_cli("locks", "--json").output) == []
    assert "No leader" in run_cli("leader").output


def test_leader_shows_the_leader_and_candidates_in_order(run_cli: Callable[..., Result], holders: Callable[..., Proc]):
    first = holders("candidate", "beat/shop", "beat-a")
    leader_token = int(first.expect(r"elected beat-a (\d+)").group(1))
    holders("candidate", "beat/shop", "beat-b").expect("campaigning")

    def both() -> Any:
        result = run_cli("leader", "--json")
        assert result.exit_code == 0, result.output
        states = json.loads(result.output)
        return states if states and len(states[0]["candidates"]) == 1 else None

    (state,) = poll("both candidates", both)
    assert state["name"] == "beat/shop"
    assert (state["leader"]["holder"], state["leader"]["token"]) == ("beat-a", leader_token)
    assert [c["holder"] for c in state["candidates"]] == ["beat-b"]
    assert state["candidates"][0]["token"] > leader_token

    table = run_cli("leader").output.splitlines()
    assert table[1].split()[:4] == ["beat/shop", "leader", "beat-a", str(leader_token)]
    assert table[2].split()[:2] == ["candidate", "beat-b"]


def test_release_asks_first_then_hands_the_lock_to_the_next_waiter(
    run_cli: Callable[..., Result], holders: Callable[..., Proc]
):
    holder = holders("mutex", "stuck", "worker-1")
    token = int(holder.expect(r"held (\d+)").group(1))
    waiter = holders("mutex", "stuck", "worker-2")
    poll("the waiter's entry", lambda: locks_json(run_cli).get("stuck", {}).get("waiters"))

    refused = run_cli("release", "stuck", input="n\n")
    assert refused.exit_code == 1
    assert "Force-release lock 'stuck'?" in refused.output
    assert f"stuck  write  {token}" in refused.output  # it showed what it would release
    assert locks_json(run_cli)["stuck"]["holders"][0]["token"] == token

    released = run_cli("release", "stuck", input="y\n")
    assert released.exit_code == 0, released.output
    assert f"Released lock 'stuck' (token {token})" in released.output
    new_token = int(waiter.expect(r"held (\d+)").group(1))
    assert new_token > token
    assert locks_json(run_cli)["stuck"]["holders"][0]["token"] == new_token


@pytest.mark.slow
def test_a_force_released_holder_learns_it_lost_the_lock(run_cli: Callable[..., Result], holders: Callable[..., Proc]):
    holder = holders("mutex", "stuck", "worker-1")
    holder.expect(r"held (\d+)")
    assert run_cli("release", "stuck", "--yes").exit_code == 0
    holder.expect("lost", timeout=20)  # at its next renewal, within ttl/3 (10 s here)


@pytest.mark.slow
def test_release_yes_json_releases_every_reader(run_cli: Callable[..., Result], holders: Callable[..., Proc]):
    readers = [holders("read", "index", f"reader-{i}") for i in range(2)]
    tokens = sorted(int(r.expect(r"held (\d+)").group(1)) for r in readers)

    result = run_cli("release", "index", "--yes", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == {"name": "index", "released": tokens}
    for reader in readers:
        reader.expect("lost", timeout=20)
    assert "index" not in locks_json(run_cli)


def test_release_of_a_free_lock_fails_clearly(run_cli: Callable[..., Result]):
    result = run_cli("release", "nobody/holds/this", "--yes")
    assert result.exit_code == 1
    assert "lock 'nobody/holds/this' is not held" in result.output
    result = run_cli("release", "nobody/holds/this", "--yes", "--json")
    assert result.exit_code == 1
    assert json.loads(result.output) == {"name": "nobody/holds/this", "released": []}
    assert run_cli("release", "x", "--json").exit_code != 0  # --json cannot ask for confirmation


@pytest.mark.slow
@pytest.mark.timeout(60)  # the app's own budget is 120 s: the command must not use it
@pytest.mark.parametrize("command", [["locks"], ["leader"], ["release", "x", "--yes"]])
def test_unreachable_etcd_is_a_quick_one_line_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command):
    port = free_port()
    module = make_app(tmp_path, monkeypatch, f"etcd3://127.0.0.1:{port}", "/x", etcdlock_retry_max_delay=120)
    result = CliRunner().invoke(celery_cli, ["-A", module, "etcdlock", *command], catch_exceptions=False)
    assert result.exit_code == 1
    assert "BackendUnavailable: etcd unreachable at" in result.output
    assert result.output.count(f"127.0.0.1:{port}") == 1, result.output  # the endpoint, once
    assert "Traceback" not in result.output
    quick = CliRunner().invoke(celery_cli, ["-A", module, "etcdlock", "locks", "--timeout", "0"])
    assert quick.exit_code == 1 and "etcd unreachable" in quick.output


@pytest.mark.parametrize("api", ["v2"])
def test_the_celery_program_has_the_etcdlock_command(tmp_path: Path, api: str, etcd_url: str):
    url, prefix = split_url(etcd_url)
    (tmp_path / "entryapp.py").write_text(
        f"from celery import Celery\napp = Celery('entryapp')\n"
        f"app.conf.update(etcdlock_url={url!r}, etcdlock_prefix={prefix!r})\n"
    )
    celery = Path(sys.executable).with_name("celery")
    program = [str(celery)] if celery.exists() else [sys.executable, "-m", "celery"]
    env = {"PYTHONPATH": f"{tmp_path}:{REPO_ROOT}", "PATH": "/usr/bin:/bin"}
    listed = subprocess.run(
        [*program, "-A", "entryapp", "etcdlock", "--help"], capture_output=True, text=True, env=env, timeout=60
    )
    assert listed.returncode == 0, listed.stderr
    for command in ("locks", "leader", "release"):
        assert command in listed.stdout
    empty = subprocess.run(
        [*program, "-A", "entryapp", "etcdlock", "locks", "--json"], capture_output=True, text=True, env=env, timeout=60
    )
    assert empty.returncode == 0, empty.stderr
    assert json.loads(empty.stdout) == []


@pytest.mark.slow
def test_semaphore_slots_are_shown_and_one_holders_slot_can_be_freed(
    run_cli: Callable[..., Result], holders: Callable[..., Proc]
):
    slots = [holders("slot", "renderers", f"worker-{i}") for i in range(2)]
    by_token = {int(s.expect(r"held (\d+)").group(1)): s for s in slots}
    tokens = sorted(by_token)
    table = run_cli("locks").output.splitlines()
    assert table[1].split()[:3] == ["renderers", "slot", "2/3"], table
    shown = locks_json(run_cli)["renderers"]
    assert shown["kind"] == "semaphore" and shown["limit"] == 3
    assert sorted(h["token"] for h in shown["holders"]) == tokens
    result = run_cli("release", "renderers", "--token", str(tokens[0]), "--yes", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == {"name": "renderers", "released": [tokens[0]]}
    by_token[tokens[0]].expect("lost", timeout=20)
    assert [h["token"] for h in locks_json(run_cli)["renderers"]["holders"]] == [tokens[1]]
    assert run_cli("release", "renderers", "--token", "1", "--yes").exit_code == 1  # no such holder


def test_release_takes_a_task_name_and_explains_how_task_locks_are_named(
    run_cli: Callable[..., Result], client: Any
) -> None:
    """Issue 24.17: `release proj.tasks.nightly_report` said only "not held"."""
    from celery_etcdlock import Mutex

    nightly = Mutex(client, "task/proj.tasks.nightly_report", ttl=10, data={"task": "proj.tasks.nightly_report"})
    keyed = Mutex(client, "task/proj.tasks.sync/customer_id=1", ttl=10)
    assert nightly.acquire() and keyed.acquire()
    try:
        released = run_cli("release", "proj.tasks.nightly_report", "--yes")
        assert released.exit_code == 0, released.output
        assert f"Released lock 'task/proj.tasks.nightly_report' (token {nightly.token})" in released.output

        refused = run_cli("release", "proj.tasks.sync", "--yes")
        assert refused.exit_code == 1
        assert "the task's held locks are 'task/proj.tasks.sync/customer_id=1'" in refused.output, refused.output
        unknown = run_cli("release", "proj.tasks.other", "--yes")
        assert unknown.exit_code == 1 and "task/<task name>/<key>" in unknown.output, unknown.output
    finally:
        for lock in (nightly, keyed):
            with contextlib.suppress(Exception):
                lock.release()
