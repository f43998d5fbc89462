"""One lock across Celery, Go and shell: our Mutex, ``etcdctl lock`` and clientv3/concurrency's Mutex;
and one election: our Election, ``etcdctl elect`` and concurrency.Election.

A Mutex named N on prefix P queues under ``P/locks/<N encoded>/``, one key per holder, ordered by
create revision: the layout of etcd's own ``concurrency.Mutex`` (docs/interop.md). So a Python
holder, ``etcdctl lock P/locks/N`` and a Go service's ``concurrency.NewMutex(session, "P/locks/N")``
take turns in FIFO order and never hold at once. Each v3 release line is tested with its own
etcdctl (3.4: Debian's /usr/bin/etcdctl on a v3-only 3.4 server), and with tests/go/interop (built
by scripts/etcd-build --interop, against client/v3 3.7).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import IO

import pytest

from celery_etcdlock import Election, Mutex, _children, connect
from celery_etcdlock.cli import find_lock, list_elections
from celery_etcdlock.keys import ELECTIONS, LOCKS, encode_name, queue_key
from celery_etcdlock.locks.client import Client
from tests.support import EtcdServer, etcd_versions, wait_until
from tests.support.etcd_versions import REPO, EtcdKind

V3_KINDS = etcd_versions.selected_kinds(["v3"], every=True)
#: etcd 3.4 is no v3 test kind (its kind is v2), but Debian's etcdctl 3.4 is what a shell script on
#: Debian or Ubuntu runs: its v3 API gets the same tests, on a v3-only 3.4 server of their own
ON_34 = ["3.4"] if etcd_versions.version_wanted("v3", "3.4") else []


class Lines:
    """The lines a child process prints, read by a thread of their own (no blocking read in the test)."""

    def __init__(self, stream: IO[str]) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, start: str, what: str) -> str:
        return wait_until(lambda: next((line for line in self.lines if line.startswith(start)), None), 60, what)


@pytest.fixture(scope="session")
def interop_binary() -> str:
    """tests/go/interop, built (or found in the cache) by scripts/etcd-build --interop; needs Go."""
    built = subprocess.run(
        [str(REPO / "scripts" / "etcd-build"), "--interop"], capture_output=True, text=True, timeout=600
    )
    if built.returncode != 0:
        reason = (
            f"tests/go/interop not built: {built.stderr.strip().splitlines()[-1] if built.stderr else built.returncode}"
        )
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    return built.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def etcd34_v3() -> Iterator[EtcdServer]:
    etcd_versions.require("3.4")
    with EtcdServer("3.4", enable_v2=False, name="interop34") as etcd:
        yield etcd


@pytest.fixture(params=ON_34 + V3_KINDS, ids=[f"v3-{p}" if isinstance(p, str) else p.name for p in ON_34 + V3_KINDS])
def server(request: pytest.FixtureRequest, etcd_kind_servers: Callable[[EtcdKind], EtcdServer]) -> EtcdServer:
    if request.param == "3.4":
        return request.getfixturevalue("etcd34_v3")
    return etcd_kind_servers(request.param)


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait(30)


def queued(client: Client, name: str) -> int:
    return len(client.backend.read_queue(queue_key(LOCKS, name)).entries)


def start(procs: list[subprocess.Popen[str]], argv: list[str]) -> tuple[subprocess.Popen[str], Lines]:
    """``argv`` running, killed after the test; its stdout read by a thread (``Lines``).

    ETCDCTL_API=3 is 3.4's default already and only warned about (unrecognised) by 3.6 and newer;
    it is set so that an older etcdctl on PATH would not fall back to v2.
    """
    env = {**os.environ, "ETCDCTL_API": "3"}
    proc = _children.popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    procs.append(proc)
    assert proc.stdout is not None
    return proc, Lines(proc.stdout)


def test_our_mutex_and_etcdctl_lock_hand_over_in_fifo_order_both_ways(
    server: EtcdServer, procs: list[subprocess.Popen[str]]
) -> None:
    """Without Go: etcdctl queues behind our holder and takes over at our release; our waiter queues
    behind etcdctl's holder, ahead of a second etcdctl, and takes over at its release.

    etcdctl 3.4 (Debian's) and 3.5-3.7 behave alike here: ``lock`` prints the key it holds, then its
    (empty) value, in the ``simple`` output, and on SIGINT unlocks and exits 0; the flags used
    (``--endpoints``, ``lock <name>``) are the same.
    """
    prefix = f"/interop-{uuid.uuid4().hex[:8]}"
    name = "reports/daily"
    lock_prefix = f"{prefix}/{LOCKS}/{encode_name(name)}"
    etcdctl = [etcd_versions.etcdctl_path(server.version), f"--endpoints={server.endpoint}", "lock", lock_prefix]
    client = connect(server.url(prefix=prefix))
    other = connect(server.url(prefix=prefix))
    try:
        ours = Mutex(client, name, ttl=10)
        assert ours.acquire(blocking=False)
        first, first_out = start(procs, etcdctl)
        wait_until(lambda: queued(client, name) == 2, 60, "etcdctl's key queued behind our holder")
        assert not first_out.lines, "etcdctl took the lock beside our Mutex"
        ours.release()
        first_key = first_out.wait_for(lock_prefix + "/", "etcdctl to take the lock at our release")

        acquired = threading.Event()
        waiter = Mutex(other, name, ttl=10)
        thread = threading.Thread(target=lambda: waiter.acquire(timeout=120) and acquired.set(), daemon=True)
        thread.start()
        wait_until(lambda: queued(client, name) == 2, 60, "our waiter's key queued behind etcdctl")
        second, second_out = start(procs, etcdctl)
        wait_until(lambda: queued(client, name) == 3, 60, "the second etcdctl's key queued behind our waiter")
        assert not acquired.is_set(), "our Mutex took the lock beside etcdctl"

        first.send_signal(signal.SIGINT)  # unlocks, then exits
        assert first.wait(30) == 0
        wait_until(acquired.is_set, 60, "our waiter to take the lock at etcdctl's release")
        assert queued(client, name) == 2 and not second_out.lines, "the second etcdctl jumped the queue"

        waiter.release()
        second_key = second_out.wait_for(lock_prefix + "/", "the second etcdctl to take the lock at our release")
        assert second_key != first_key
        assert not Mutex(client, name, ttl=10).acquire(blocking=False), "our Mutex took the lock beside etcdctl"
        second.send_signal(signal.SIGINT)
        assert second.wait(30) == 0
        wait_until(lambda: queued(client, name) == 0, 60, "etcdctl's key gone after it unlocked")
    finally:
        client.close()
        other.close()


def test_our_mutex_etcdctl_lock_and_a_go_mutex_take_turns_in_fifo_order(
    server: EtcdServer, interop_binary: str, procs: list[subprocess.Popen[str]]
) -> None:
    prefix = f"/interop-{uuid.uuid4().hex[:8]}"
    name = "reports/daily"  # a name with a slash: encoded into one key segment
    lock_prefix = f"{prefix}/{LOCKS}/{encode_name(name)}"  # what etcdctl and Go are given
    etcdctl = etcd_versions.etcdctl_path(server.version)
    client = connect(server.url(prefix=prefix))
    other = connect(server.url(prefix=prefix))
    ours = Mutex(client, name, ttl=10)

    try:
        assert ours.acquire(blocking=False)
        # etcdctl queues behind us, then the Go service behind etcdctl
        shell, shell_out = start(procs, [etcdctl, f"--endpoints={server.endpoint}", "lock", lock_prefix])
        wait_until(lambda: queued(client, name) == 2, 60, "etcdctl's key in the queue")
        go, go_out = start(procs, [interop_binary, "lock", "-endpoints", server.endpoint, "-key", lock_prefix])
        wait_until(lambda: queued(client, name) == 3, 60, "the Go mutex's key in the queue")
        assert not shell_out.lines and not go_out.lines  # both wait while we hold

        ours.release()
        held = shell_out.wait_for(lock_prefix + "/", "etcdctl to take the lock (it prints its key)")
        assert not go_out.lines, "the Go mutex took the lock beside etcdctl"
        assert not Mutex(other, name, ttl=10).acquire(blocking=False), "our Mutex took the lock beside etcdctl"
        shown = find_lock(client, name)  # what `celery etcdlock locks` shows
        assert shown is not None and shown.holders[0].holder == "foreign (etcdctl or Go)"
        assert [w.holder for w in shown.waiters] == ["foreign (etcdctl or Go)"]

        # now we queue behind the Go service
        acquired = threading.Event()
        waiter = Mutex(other, name, ttl=10)
        thread = threading.Thread(target=lambda: waiter.acquire(timeout=120) and acquired.set(), daemon=True)
        thread.start()
        wait_until(lambda: queued(client, name) == 3, 60, "our waiter's key in the queue")

        shell.send_signal(signal.SIGINT)  # etcdctl lock holds until it is interrupted, then unlocks
        assert shell.wait(30) == 0
        go_key = go_out.wait_for("acquired ", "the Go mutex to take the lock").split(" ", 1)[1]
        assert go_key.startswith(lock_prefix + "/") and go_key != held
        assert not acquired.is_set(), "our Mutex took the lock beside the Go mutex"

        assert go.stdin is not None
        go.stdin.write("release\n")
        go.stdin.flush()
        go_out.wait_for("released", "the Go mutex to release")
        thread.join(60)
        assert acquired.is_set() and waiter.held
        waiter.release()
    finally:
        client.close()
        other.close()
    assert go.wait(30) == 0


def test_our_election_etcdctl_elect_and_a_go_election_never_lead_at_once(
    server: EtcdServer, interop_binary: str, procs: list[subprocess.Popen[str]]
) -> None:
    prefix = f"/interop-{uuid.uuid4().hex[:8]}"
    name = "billing"
    election_prefix = f"{prefix}/{ELECTIONS}/{encode_name(name)}"
    etcdctl = etcd_versions.etcdctl_path(server.version)
    client = connect(server.url(prefix=prefix))
    ours = Election(client, name, identity="host-1:4242", ttl=10)

    def go_sees() -> str:
        argv = [interop_binary, "leader", "-endpoints", server.endpoint, "-key", election_prefix]
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout.strip()

    try:
        shell, shell_out = start(
            procs, [etcdctl, f"--endpoints={server.endpoint}", "elect", election_prefix, "shell-1"]
        )
        shell_out.wait_for(election_prefix + "/", "etcdctl to lead (it prints its key, then its proposal)")
        wait_until(lambda: ours.leader() == "shell-1", 60, "our Election to name the foreign leader")
        assert go_sees() == "shell-1"
        (shown,) = list_elections(client)  # what `celery etcdlock leader` shows
        assert shown.leader.holder == "foreign: shell-1"
        assert not ours.campaign(timeout=0.5), "our Election led beside etcdctl"

        go, go_out = start(
            procs, [interop_binary, "elect", "-endpoints", server.endpoint, "-key", election_prefix, "-value", "go-1"]
        )
        wait_until(
            lambda: len(client.backend.read_queue(queue_key(ELECTIONS, name)).entries) == 2, 60, "Go's candidate"
        )
        shell.send_signal(signal.SIGINT)  # etcdctl elect resigns when interrupted
        shell.wait(30)
        go_out.wait_for("leader", "the Go candidate to lead")
        assert ours.leader() == "go-1"
        assert not ours.campaign(timeout=0.5), "our Election led beside the Go candidate"

        assert go.stdin is not None
        go.stdin.write("resign\n")
        go.stdin.flush()
        go_out.wait_for("resigned", "the Go candidate to resign")
        assert ours.campaign(timeout=30)
        listen, listen_out = start(
            procs, [etcdctl, f"--endpoints={server.endpoint}", "elect", "--listen", election_prefix]
        )
        listen_out.wait_for("{", "etcdctl elect --listen to show our leader")  # our value: a JSON object
        assert any("host-1:4242" in line for line in listen_out.lines)
        assert ours.leader() == "host-1:4242" and '"host-1:4242"' in go_sees()
        ours.resign()
    finally:
        client.close()
