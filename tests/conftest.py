"""Fixtures: real etcd and Redis servers, one URL with a fresh key prefix per test.

A test that asks for ``etcd_url``, ``client`` or ``own_etcd`` runs once per etcd API:

- ``[v2]``: the v2 keys API (``etcd://``) of etcd 3.4 started with ``--enable-v2``;
- ``[v3]``: the v3 API (``etcd3://``) of the newest etcd (3.7), without v2.

A test marked ``every_etcd`` (``every_etcd("v2")``: of that API) runs on every test kind instead
(tests/support/etcd_versions.py):
``[v2-3.4]``, ``[v2-3.5]`` (3.5 with --enable-v2), ``[v3-3.5]``, ``[v3-3.6]``, ``[v3-3.7]``.
``etcd_kind`` is the kind of the running test.

``ETCDLOCK_TEST_APIS=v2`` (a comma list) runs only those APIs; ``ETCDLOCK_TEST_ETCD=3.4,3.7``
only those versions or kinds. A test can pin the API itself: ``@pytest.mark.parametrize("api", ["v2"])``.
Etcd 3.5-3.7 are scripts/etcd-build's: a kind whose build is missing skips, with one line saying
what to install, except under CI=true, where it fails.

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
from tests.support import EtcdCluster, EtcdServer, RedisServer, etcd_versions
from tests.support.etcd_versions import EtcdKind

ALL_APIS = ("v2", "v3")

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
    # the markers are registered in pyproject.toml ([tool.pytest.ini_options] markers), with --strict-markers
    try:
        etcd_versions.check_selection()
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``api`` runs once per API, or once per etcd kind for a test marked ``every_etcd``."""
    if "api" not in metafunc.fixturenames:
        return
    if any("api" in mark.args[0] for mark in metafunc.definition.iter_markers("parametrize")):
        return  # the test names its API itself; etcd_kind is that API's default
    marker = metafunc.definition.get_closest_marker("every_etcd")
    every = marker is not None
    apis = [a for a in _selected_apis() if not (marker and marker.args) or a in marker.args]
    kinds = etcd_versions.selected_kinds(apis, every)
    ids = [k.name if every else k.api for k in kinds]
    metafunc.parametrize("api", kinds, ids=ids, indirect=True)


require_etcd = etcd_versions.require


# What starts processes or servers of a test's own (workers, beats, an etcd or Redis, child
# Pythons) or works in files: a test that uses none of them is marked quick, whatever its name
# or module, and scripts/test-pythons runs the quick ones on every CPython.
HEAVY_FIXTURES = frozenset(
    {
        "spawn", "own_etcd", "etcd_server_factory", "etcd_cluster", "etcd_cluster_factory", "redis_server",
        "redis_url", "redis_for_workers", "redis_for_worker", "worker", "workers", "make_beats", "celery_worker",
        "pytest_celery", "broker", "tmp_path",
    }
)  # fmt: skip


# A test marked slow_but_newest waits out TTLs on every backend it runs on; the fast lane keeps it
# on memory:// and the newest etcd's v3 API only. Those two, because they are what the CI matrix
# runs (scripts/test-pythons: quick tests, ETCDLOCK_TEST_ETCD=3.7): a plain slow marker would take
# such a quick test out of the matrix, and it would run on no other CPython at all.
NEWEST = etcd_versions.DEFAULT_KIND["v3"]


def _on_newest(item: pytest.Item) -> bool:
    """Whether ``item`` runs on memory:// or the newest etcd's v3 API (by its backend parameter)."""
    if item.get_closest_marker("skip"):
        return True  # runs nowhere (say, no etcd kind selected: an empty parameter set), so costs nothing
    callspec = getattr(item, "callspec", None)
    for value in callspec.params.values() if callspec else ():
        name = value.name if isinstance(value, EtcdKind) else value
        if isinstance(name, str) and name in ("memory", "v3", NEWEST.name, NEWEST.version):
            return True
    return False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HEAVY_FIXTURES.isdisjoint(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.quick)
        if item.get_closest_marker("slow_but_newest") and not _on_newest(item):
            item.add_marker(pytest.mark.slow)


# -- servers -----------------------------------------------------------------------------------


def _start(server: EtcdServer | RedisServer) -> EtcdServer | RedisServer:
    try:
        return server.start()
    except Exception:
        server.close()
        raise


@pytest.fixture(scope="session")
def etcd_kind_servers() -> Iterator[Callable[[EtcdKind], EtcdServer]]:
    """``servers(kind)``: the session's server of an etcd test kind, started on first use."""
    running: dict[str, EtcdServer] = {}

    def server(kind: EtcdKind) -> EtcdServer:
        if kind.name not in running:
            require_etcd(kind.version)
            name = "etcd" + kind.version.replace(".", "") + ("" if kind.name in ("v2-3.4", "v3-3.5") else kind.api)
            started = _start(EtcdServer(kind.version, enable_v2=kind.enable_v2, api=kind.api, name=name))
            assert isinstance(started, EtcdServer)
            running[kind.name] = started
        return running[kind.name]

    yield server
    for started in running.values():
        started.close()


@pytest.fixture(scope="session")
def etcd34_server(etcd_kind_servers: Callable[[EtcdKind], EtcdServer]) -> EtcdServer:
    """etcd 3.4 with the v2 API enabled, for the whole session. Do not stop it: use own_etcd."""
    return etcd_kind_servers(etcd_versions.KINDS["v2-3.4"])


@pytest.fixture(scope="session")
def etcd35_server(etcd_kind_servers: Callable[[EtcdKind], EtcdServer]) -> EtcdServer:
    """The newest etcd 3.5 without the v2 API (v3 only), for the whole session."""
    return etcd_kind_servers(etcd_versions.KINDS["v3-3.5"])


@pytest.fixture(scope="session")
def etcd_v3_server(etcd_kind_servers: Callable[[EtcdKind], EtcdServer]) -> EtcdServer:
    """The v3 default kind's server (the newest etcd, v3 only), for the whole session."""
    return etcd_kind_servers(etcd_versions.DEFAULT_KIND["v3"])


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


@pytest.fixture
def api(request: pytest.FixtureRequest) -> str:
    """ "v2" or "v3": which etcd API this run of the test uses (its kind's: see pytest_generate_tests)."""
    param = request.param
    return param.api if isinstance(param, EtcdKind) else str(param)


@pytest.fixture
def etcd_kind(api: str, request: pytest.FixtureRequest) -> EtcdKind:
    """The etcd test kind of this run: the one ``every_etcd`` gave it, else its API's default."""
    callspec = getattr(request.node, "callspec", None)
    param = callspec.params.get("api") if callspec else None
    return param if isinstance(param, EtcdKind) else etcd_versions.DEFAULT_KIND[api]


def unique_prefix(request: pytest.FixtureRequest) -> str:
    """A key prefix no other test uses, e.g. ``/t-test_acquire-v2-1a2b3c4d``."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name).strip("-.")[:60]
    return f"/t-{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def etcd_server_for_api(
    etcd_kind: EtcdKind, etcd_kind_servers: Callable[[EtcdKind], EtcdServer], request: pytest.FixtureRequest
) -> EtcdServer:
    """The session-scoped server of this test's etcd kind."""
    server = etcd_kind_servers(etcd_kind)
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
def own_etcd(etcd_kind: EtcdKind, request: pytest.FixtureRequest) -> Iterator[EtcdServer]:
    """An etcd of this test's own (of its ``etcd_kind``), to stop, kill, pause or restart.

    Use ``own_etcd.url(prefix=...)`` for its URL. Removed after the test.
    """
    require_etcd(etcd_kind.version)
    kind = etcd_kind
    server = _start(EtcdServer(kind.version, enable_v2=kind.enable_v2, api=kind.api, name=f"own-{kind.api}"))
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
        require_etcd(str(args[0] if args else kwargs.get("version", "3.4")))
        server = EtcdServer(*args, **kwargs)
        started.append(server)
        _track(request, server)
        server.start()
        return server

    yield make
    for server in started:
        server.close()


# -- 3-member clusters ---------------------------------------------------------------------------

# What each cluster kind runs: etcd 3.4 serves both APIs, the newest etcd 3.5 v3 only.
CLUSTER_KINDS = {"3.4": {"version": "3.4", "enable_v2": True}, "3.5": {"version": "3.5", "enable_v2": False}}


@pytest.fixture
def etcd_cluster_factory(request: pytest.FixtureRequest) -> Iterator[Callable[..., EtcdCluster]]:
    """Start 3-member clusters: ``etcd_cluster_factory("3.4", enable_v2=True)`` (EtcdCluster's arguments).

    After the test, whatever happened in it, every cluster is closed: members killed, temp
    dirs removed, and its iptables chains removed; teardown fails if a chain is left.
    """
    started: list[EtcdCluster] = []

    def make(*args: Any, **kwargs: Any) -> EtcdCluster:
        require_etcd(str(args[0] if args else kwargs.get("version", "3.4")))
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
