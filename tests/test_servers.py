"""The test servers and subprocess helpers themselves: each kind starts, answers, and restarts."""

from __future__ import annotations

import base64
import json
import os
import sys
import threading
import time
from urllib import request as urlrequest

import etcd
import pytest
import redis

from celery_etcdlock import Mutex, connect
from celery_etcdlock.locks.connect import parse_url
from tests.procs import Proc, ProcFailed
from tests.support import (
    APP_PASSWORD,
    APP_USER,
    HOST,
    ROOT_PASSWORD,
    ROOT_USER,
    EtcdCluster,
    EtcdServer,
    RedisServer,
    partition_unsupported,
    wait_until,
)
from tests.support.partition import our_chains


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def v3_put(server: EtcdServer, key: str, value: str, token: str | None = None, timeout: float = 10) -> int:
    return server.v3("kv/put", {"key": b64(key), "value": b64(value)}, token=token, timeout=timeout)[0]


def v3_range(server: EtcdServer, key: str, timeout: float = 10, serializable: bool = False) -> tuple[int, str | None]:
    """(status, value): a linearizable read, or with ``serializable`` one the member answers alone."""
    status, reply = server.v3("kv/range", {"key": b64(key), "serializable": serializable}, timeout=timeout)
    kvs = reply.get("kvs", []) if status == 200 else []
    return status, base64.b64decode(kvs[0].get("value", "")).decode() if kvs else None


def v3_get(server: EtcdServer, key: str, token: str | None = None) -> str | None:
    status, reply = server.v3("kv/range", {"key": b64(key)}, token=token)
    assert status == 200, reply
    kvs = reply.get("kvs", [])
    return base64.b64decode(kvs[0]["value"]).decode() if kvs else None


# -- etcd --------------------------------------------------------------------------------------


def test_v2_server_reads_and_writes_through_python_etcd(etcd34_server: EtcdServer) -> None:
    assert etcd34_server.version == "3.4" and etcd34_server.enable_v2
    c = etcd.Client(host="127.0.0.1", port=etcd34_server.client_port)
    c.write("/smoke/v2", "hello")
    assert c.read("/smoke/v2").value == "hello"
    assert etcd34_server.url(prefix="/p") == f"etcd://127.0.0.1:{etcd34_server.client_port}?prefix=/p"


def test_v3_only_server_has_no_v2_api(etcd35_server: EtcdServer) -> None:
    assert etcd35_server.version == "3.5" and not etcd35_server.enable_v2
    status, _ = etcd35_server.http("GET", "/v2/keys/")
    assert status == 404
    assert v3_put(etcd35_server, "/smoke/v3", "there") == 200
    assert v3_get(etcd35_server, "/smoke/v3") == "there"
    assert etcd35_server.url() == f"etcd3://127.0.0.1:{etcd35_server.client_port}"


def test_proposals_committed_counts_writes(etcd35_server: EtcdServer) -> None:
    before = etcd35_server.proposals_committed()
    for i in range(5):
        assert v3_put(etcd35_server, f"/smoke/count/{i}", "x") == 200
    # A gauge set as raft reports commits: it may trail the last answered write by a moment.
    wait_until(lambda: etcd35_server.proposals_committed() >= before + 5, 10, "5 more proposals committed")
    assert "etcd_server_has_leader 1" in etcd35_server.metrics()


def test_v2_tls_and_auth_answer_only_with_credentials(etcd_server_factory) -> None:
    server = etcd_server_factory("3.4", enable_v2=True, tls=True, auth=True)
    assert server.client_url.startswith("https://")
    assert server.http("GET", "/v2/keys/")[0] == 401
    assert server.http("GET", "/v2/keys/", basic_auth=(APP_USER, "wrong"))[0] == 401
    assert server.http("PUT", "/v2/keys/smoke", form={"value": "v"}, basic_auth=(APP_USER, APP_PASSWORD))[0] == 201
    status, body = server.http("GET", "/v2/keys/smoke", basic_auth=(APP_USER, APP_PASSWORD))
    assert status == 200 and b'"value":"v"' in body
    with pytest.raises(OSError):  # plain http to the TLS port: the connection is dropped
        urlrequest.urlopen(f"http://{server.endpoint}/v2/keys/smoke", timeout=10)

    url = server.url(prefix="/p")
    assert url.startswith(f"etcds://{APP_USER}:{APP_PASSWORD}@127.0.0.1:{server.client_port}?prefix=/p&ca=")
    options = parse_url(url)
    assert (options.api, options.tls, options.username, options.password) == ("v2", True, APP_USER, APP_PASSWORD)
    assert (options.ca, options.cert, options.key) == (server.ca_file, server.client_cert, server.client_key)


def test_v3_tls_and_auth_answer_only_with_a_token(etcd_server_factory) -> None:
    server = etcd_server_factory("3.5", enable_v2=False, tls=True, auth=True)
    assert server.api == "v3"
    assert v3_put(server, "/smoke", "anon") != 200
    status, reply = server.v3("auth/authenticate", {"name": APP_USER, "password": "wrong"})
    assert status != 200 and "token" not in reply
    token = server.v3_token()
    assert v3_put(server, "/smoke", "app", token=token) == 200
    assert v3_get(server, "/smoke", token=server.v3_token(ROOT_USER, ROOT_PASSWORD)) == "app"
    assert server.url().startswith(f"etcd3s://{APP_USER}:{APP_PASSWORD}@127.0.0.1:{server.client_port}?ca=")


@pytest.mark.slow
@pytest.mark.parametrize("api", ["v2", "v3"])
def test_client_cert_auth_demands_the_client_certificate(etcd_server_factory, api: str) -> None:
    if api == "v2":
        server = etcd_server_factory("3.4", tls=True, auth=True, client_cert_auth=True)
    else:
        server = etcd_server_factory("3.5", enable_v2=False, tls=True, auth=True, client_cert_auth=True)
    assert server.http("GET", "/version", client_cert=False)[0] == 0
    assert server.http("GET", "/version", client_cert=True)[0] == 200
    if api == "v2":
        assert server.http("GET", "/v2/keys/")[0] == 401
        assert server.http("GET", "/v2/keys/", basic_auth=(APP_USER, APP_PASSWORD))[0] == 200
    else:
        assert v3_put(server, "/k", "anon") != 200
        assert v3_put(server, "/k", "app", token=server.v3_token()) == 200


@pytest.mark.slow
@pytest.mark.parametrize("version,enable_v2", [("3.4", True), ("3.5", False)])
def test_restart_and_crash_keep_data_and_ports(etcd_server_factory, version: str, enable_v2: bool) -> None:
    server = etcd_server_factory(version, enable_v2=enable_v2)
    port = server.client_port
    assert v3_put(server, "/kept", "1") == 200
    server.restart()
    assert server.client_port == port
    assert v3_get(server, "/kept") == "1"
    assert v3_put(server, "/kept", "2") == 200
    server.kill()
    assert server.http("GET", "/version", timeout=2)[0] == 0
    server.start()
    assert server.client_port == port
    assert v3_get(server, "/kept") == "2"


def test_pause_freezes_the_server_until_resume(etcd_server_factory) -> None:
    server = etcd_server_factory("3.4")
    server.pause()
    try:
        assert server.http("GET", "/version", timeout=1)[0] == 0
    finally:
        server.resume()
    assert server.http("GET", "/version", timeout=10)[0] == 200


def test_servers_started_in_parallel_get_distinct_ports() -> None:
    servers = [EtcdServer("3.5", enable_v2=False) for _ in range(3)]
    errors: list[BaseException] = []

    def start(server: EtcdServer) -> None:
        try:
            server.start()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(s,)) for s in servers]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        ports = {p for s in servers for p in (s.client_port, s.peer_port)}
        assert len(ports) == 6
        for s in servers:
            assert v3_put(s, "/mine", str(s.client_port)) == 200
        assert {v3_get(s, "/mine") for s in servers} == {str(s.client_port) for s in servers}
    finally:
        for s in servers:
            s.close()


def test_a_server_that_cannot_start_says_why() -> None:
    server = EtcdServer("3.4")
    server.data_dir.parent.mkdir(exist_ok=True)
    server.data_dir.write_text("not a directory")
    try:
        with pytest.raises(Exception, match="exited with"):
            server.start()
    finally:
        server.close()


def test_etcd_url_has_a_fresh_prefix_for_the_api(etcd_url: str, api: str) -> None:
    options = parse_url(etcd_url)
    assert options.api == api
    assert options.prefix.startswith("/t-test_etcd_url_has_a_fresh_prefix_for_the_api")


# -- a 3-member cluster ------------------------------------------------------------------------
# Each test gets a fresh cluster of each kind: etcd 3.4 (v2 and v3) and etcd 3.5 (v3).
# A write that must fail gets a short client timeout (FAILING_WRITE_TIMEOUT); every wait for
# something to happen is a poll with a deadline.

FAILING_WRITE_TIMEOUT = 2.0  # etcd would answer "request timed out" after several seconds; we stop waiting first
RECOVERY_TIMEOUT = 30.0


def skip_unless_partition_works() -> None:
    reason = partition_unsupported()
    if reason:
        pytest.skip(reason)


@pytest.mark.cluster
def test_cluster_has_three_healthy_members_that_replicate(etcd_cluster: EtcdCluster) -> None:
    members = etcd_cluster.members
    assert len({port for m in members for port in m.ports()}) == 6
    assert all(m.ready() for m in members)
    status, reply = members[0].v3("cluster/member/list", {})
    assert status == 200 and sorted(m["name"] for m in reply["members"]) == ["member0", "member1", "member2"]
    assert etcd_cluster.wait_for_leader() in (0, 1, 2)

    assert v3_put(members[0], "/replicated", "from 0") == 200
    assert [v3_range(m, "/replicated") for m in members[1:]] == [(200, "from 0")] * 2
    if etcd_cluster.enable_v2:
        assert members[2].http("PUT", "/v2/keys/replicated", form={"value": "from 2"})[0] == 201
        status, body = members[1].http("GET", "/v2/keys/replicated?quorum=true")
        assert status == 200 and json.loads(body)["node"]["value"] == "from 2"


@pytest.mark.cluster
def test_cluster_url_names_every_member_in_the_order_asked(etcd_cluster: EtcdCluster) -> None:
    ports = [m.client_port for m in etcd_cluster.members]
    url = etcd_cluster.url(order=[2, 0, 1], prefix="/p")
    assert parse_url(url).endpoints == tuple((HOST, ports[i]) for i in (2, 0, 1))
    with pytest.raises(ValueError, match="each member once"):
        etcd_cluster.url(order=[0, 0, 1])

    orders = {"etcd": [2, 0, 1], "etcd3": [1, 2, 0]} if etcd_cluster.enable_v2 else {"etcd3": [1, 2, 0]}
    for scheme, order in orders.items():
        client = connect(etcd_cluster.url(order, scheme=scheme, prefix=f"/url-{scheme}"))
        try:
            with Mutex(client, "through-all-endpoints", ttl=5) as mutex:
                assert mutex.held
        finally:
            client.close()


@pytest.mark.cluster
def test_killing_the_leader_elects_another_and_writes_go_on(etcd_cluster: EtcdCluster) -> None:
    leader = etcd_cluster.wait_for_leader()
    old = etcd_cluster.member(leader)
    assert v3_put(old, "/k", "before") == 200

    old.kill()
    etcd_cluster.wait_for_leader(other_than=leader)
    survivors = [m for m in etcd_cluster.members if m is not old]
    for n, member in enumerate(survivors):
        assert v3_put(member, "/k", f"after {n}") == 200
    assert v3_range(survivors[0], "/k") == (200, "after 1")

    old.restart()  # same ports and data: it rejoins as a follower and catches up
    wait_until(lambda: v3_range(old, "/k", timeout=2) == (200, "after 1"), RECOVERY_TIMEOUT, "catch-up")


@pytest.mark.cluster
def test_move_leader_hands_leadership_to_the_member_asked(etcd_cluster: EtcdCluster) -> None:
    leader = etcd_cluster.wait_for_leader()
    for target in [(leader + 1) % 3, leader]:
        etcd_cluster.move_leader(target)
        assert etcd_cluster.leader() == target
        assert v3_put(etcd_cluster.member(target), "/moved", str(target)) == 200


@pytest.mark.cluster
def test_a_paused_leader_is_replaced_and_catches_up_when_resumed(etcd_cluster: EtcdCluster) -> None:
    leader = etcd_cluster.wait_for_leader()
    frozen = etcd_cluster.member(leader)
    frozen.pause()
    new_leader = etcd_cluster.wait_for_leader(other_than=leader)
    assert v3_put(etcd_cluster.member(new_leader), "/k", "while frozen") == 200

    frozen.resume()
    wait_until(lambda: v3_range(frozen, "/k", timeout=2) == (200, "while frozen"), RECOVERY_TIMEOUT, "catch-up")
    assert all(m.ready() for m in etcd_cluster.members)


@pytest.mark.cluster
@pytest.mark.parametrize("role", ["follower", "leader"])
def test_a_partitioned_member_cannot_commit_while_the_others_do(etcd_cluster: EtcdCluster, role: str) -> None:
    skip_unless_partition_works()
    leader = etcd_cluster.wait_for_leader()
    victim_index = leader if role == "leader" else (leader + 1) % 3
    victim = etcd_cluster.member(victim_index)
    others = [m for m in etcd_cluster.members if m is not victim]
    assert v3_put(victim, "/k", "before") == 200
    wait_until(lambda: all(v3_range(m, "/k", timeout=2) == (200, "before") for m in others), 10, "replication")

    etcd_cluster.partition(victim_index)
    assert len([rule for rule in etcd_cluster.firewall.rules() if "DROP" in rule]) == 3  # type: ignore[union-attr]
    # Cut off, the victim loses its leader (a leader steps down: it no longer hears a quorum).
    wait_until(lambda: "no leader" in str((victim.status() or {}).get("errors")), RECOVERY_TIMEOUT, "no leader")
    etcd_cluster.wait_for_leader(other_than=victim_index)

    # Its client port still answers, but nothing that needs a quorum: no write, no linearizable read.
    assert victim.http("GET", "/version", timeout=5)[0] == 200
    assert v3_put(victim, "/k", "lost", timeout=FAILING_WRITE_TIMEOUT) != 200
    assert v3_range(victim, "/k", timeout=FAILING_WRITE_TIMEOUT)[0] != 200
    # The other two still commit; the victim, read alone (serializable), has not seen it: a stale read.
    assert v3_put(others[0], "/k", "after") == 200
    assert v3_range(others[1], "/k") == (200, "after")
    assert v3_range(victim, "/k", serializable=True) == (200, "before")

    etcd_cluster.heal()
    assert not [rule for rule in etcd_cluster.firewall.rules() if "DROP" in rule]  # type: ignore[union-attr]
    wait_until(lambda: v3_range(victim, "/k", timeout=2) == (200, "after"), RECOVERY_TIMEOUT, "the victim to catch up")
    etcd_cluster.wait_for_leader()
    # The write the victim took alone was never committed: every member agrees on "after".
    assert [v3_range(m, "/k") for m in etcd_cluster.members] == [(200, "after")] * 3


def lease_ttl(member: EtcdServer, lease: str) -> int:
    """The seconds lease ``lease`` has left, as ``member`` says (-1 once it is gone)."""
    status, reply = member.v3("kv/lease/timetolive", {"ID": lease}, timeout=5)
    return int(reply.get("TTL", -1)) if status == 200 else -1


@pytest.mark.cluster
def test_a_resumed_old_leader_renews_leases_alone(etcd_cluster: EtcdCluster) -> None:
    """etcd-io/etcd#15247, said fixed in 3.5.13 / 3.4.31: what the fault suite found behind two candidates leading.

    A leader frozen for longer than a lease's TTL, once resumed, still takes itself for the
    leader for a moment: it answers a keep-alive with "renewed, TTL 2" from its own lessor.
    The real leader never hears of that renewal and expires the lease on its own schedule,
    so a holder that trusts the answer believes it holds a lease that is gone. Every version
    the tests run does it (3.4.23 and 3.5.35 here; 3.6.16 and 3.7.3 too); our client refuses such a renewal
    (tests/test_cluster_clients.py, Etcd3Backend.keep_alive).
    """
    old, healthy = etcd_cluster.member(0), etcd_cluster.member(1)

    def renewed_alone() -> bool:
        """Freeze the leader past a lease's TTL, resume it, renew through it: did the lease then go early?"""
        etcd_cluster.move_leader(0)
        lease = healthy.v3("lease/grant", {"TTL": 2})[1]["ID"]
        old.pause()
        etcd_cluster.wait_for_leader(other_than=0)
        renewed_until = time.monotonic() + 3  # longer than the TTL: the frozen leader's lessor deems it expired
        while time.monotonic() < renewed_until:
            assert healthy.v3("lease/keepalive", {"ID": lease}, timeout=2)[0] == 200
            time.sleep(0.25)
        old.resume()
        asked = time.monotonic()
        status, answer = old.v3("lease/keepalive", {"ID": lease}, timeout=5)
        if status != 200 or int(answer.get("result", {}).get("TTL", 0)) <= 0:
            return False  # it had heard of its successor already: an honest answer
        # "renewed for 2 s" at `asked`; the real leader, which last renewed it earlier, expires it sooner
        while time.monotonic() < asked + 2:
            if lease_ttl(healthy, lease) < 0:
                return True
            time.sleep(0.02)
        return False

    for _attempt in range(3):  # the resumed leader may hear of its successor before it answers
        if renewed_alone():
            return
        etcd_cluster.wait_for_leader()
    pytest.fail("a resumed old leader never renewed a lease alone in 3 tries: has etcd fixed etcd#15247 for good?")


@pytest.mark.cluster
def test_losing_quorum_fails_writes_until_it_is_restored(etcd_cluster: EtcdCluster) -> None:
    assert v3_put(etcd_cluster.member(0), "/q", "before") == 200
    killed = etcd_cluster.stop_quorum()
    assert len(killed) == 2
    (alone,) = [m for m in etcd_cluster.members if m.running]
    assert v3_put(alone, "/q", "no quorum", timeout=FAILING_WRITE_TIMEOUT) != 200
    assert v3_range(alone, "/q", timeout=FAILING_WRITE_TIMEOUT)[0] != 200

    etcd_cluster.restore()
    assert all(m.running for m in etcd_cluster.members)
    back = etcd_cluster.member(killed[0])
    wait_until(lambda: v3_put(back, "/q", "after", timeout=5) == 200, RECOVERY_TIMEOUT, "a write after restore")
    assert [v3_range(m, "/q") for m in etcd_cluster.members] == [(200, "after")] * 3


@pytest.mark.cluster
def test_rolling_restart_keeps_data_and_a_leader(etcd_cluster: EtcdCluster) -> None:
    assert v3_put(etcd_cluster.member(1), "/r", "kept") == 200
    leader = etcd_cluster.wait_for_leader()
    order = etcd_cluster.rolling_restart()
    assert sorted(order) == [0, 1, 2] and order[-1] == leader
    assert [v3_range(m, "/r") for m in etcd_cluster.members] == [(200, "kept")] * 3
    assert v3_put(etcd_cluster.member(order[0]), "/r", "new") == 200
    assert etcd_cluster.diverged() is None


@pytest.mark.cluster
def test_a_failing_test_leaves_no_chain_process_or_temp_dir() -> None:
    skip_unless_partition_works()
    cluster = EtcdCluster("3.5", enable_v2=False)
    with pytest.raises(RuntimeError, match="the test failed"), cluster:
        cluster.partition(1)
        assert len(cluster.leftover_chains()) == 2  # the marking chain and the cutting chain
        pids = [m.pid for m in cluster.members]
        raise RuntimeError("the test failed")
    assert cluster.leftover_chains() == []
    assert not [chain for chain in our_chains() if chain.startswith(cluster.firewall.chain)]  # type: ignore[union-attr]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # type: ignore[arg-type]
    assert not [m.dir for m in cluster.members if m.dir.exists()]


# -- redis -------------------------------------------------------------------------------------


def test_redis_answers_and_is_flushed_per_test(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    assert r.ping()
    assert r.dbsize() == 0
    r.set("smoke", "1")
    assert r.get("smoke") == b"1"


def test_redis_restarts_on_its_port_and_the_client_reconnects() -> None:
    with RedisServer() as server:
        port = server.port
        server.client().set("k", "v")
        server.restart()
        assert server.port == port
        assert server.client().ping()
        assert server.client().get("k") is None  # no persistence: a fresh server


# -- subprocesses ------------------------------------------------------------------------------


def test_proc_expect_send_and_exit() -> None:
    with Proc.start(
        """
        import sys
        print("ready", 42)
        for line in sys.stdin:
            print("echo", line.strip())
            if line.strip() == "bye":
                break
        sys.exit(3)
        """
    ) as proc:
        assert proc.expect(r"ready (\d+)").group(1) == "42"
        proc.send("hello\n")
        proc.expect("echo hello")
        proc.send("bye\n")
        proc.expect_exit(3)
        assert proc.lines == ["ready 42", "echo hello", "echo bye"]


def test_proc_expect_fails_with_the_output() -> None:
    with Proc.start("print('only this'); import time; time.sleep(60)") as proc:
        proc.expect("only this")
        with pytest.raises(ProcFailed, match=r"(?s)no line matching 'never'.*only this"):
            proc.expect("never", timeout=0.5)
    with Proc.start("print('bye')") as proc, pytest.raises(ProcFailed, match="exited with 0 before"):
        proc.expect("never")


def test_proc_stop_cont_and_kill(spawn) -> None:
    proc = spawn(
        """
        import sys
        for line in sys.stdin:
            print("got", line.strip())
        """
    )
    proc.stop()
    proc.send("while stopped\n")
    with pytest.raises(ProcFailed):
        proc.expect("got while stopped", timeout=0.5)
    proc.cont()
    proc.expect("got while stopped")
    assert proc.kill() == -9
    assert not proc.alive


def test_proc_sees_the_repo_and_the_env(spawn) -> None:
    proc = spawn(
        "import os, celery_etcdlock; print('ok', os.environ['X'], celery_etcdlock.__version__)", env={"X": "y"}
    )
    proc.expect(r"^ok y \d")
    proc.expect_exit(0)


def _gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie no one reaped yet counts: it runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal (prctl) is Linux only")
def test_servers_and_procs_die_with_a_sigkilled_test_run() -> None:
    """CI's timeout SIGKILLs pytest: no atexit, no teardown. Its servers and children must go with it.

    The etcd is started from a thread that has ended by the time the parent is killed: Linux
    sends the death signal when the forking *thread* ends, so it must still be up until then.
    As root, a child that runs as another user (PostgreSQL's way) too: a change of credentials
    clears the death signal.
    """
    with Proc.start(
        """
        import json, os, pwd, sys, threading
        from celery_etcdlock import _children
        from celery_etcdlock.testing import LocalEtcd, find_etcd
        from tests.procs import Proc
        from tests.support import EtcdServer

        started = []
        starter = threading.Thread(target=lambda: started.append(EtcdServer("3.5", enable_v2=False).start()))
        starter.start()
        starter.join()
        plugin = LocalEtcd(find_etcd()).start()  # the pytest plugin's etcd_server
        child = Proc.start("import sys; print('up'); sys.stdin.readline()")
        child.expect("up")
        pids = [started[0].pid, plugin.process.pid, child.pid]
        if os.geteuid() == 0:
            nobody = pwd.getpwnam("nobody")
            pids.append(_children.popen(["sleep", "600"], user=nobody.pw_uid, group=nobody.pw_gid, extra_groups=[]).pid)
        print("started", json.dumps({"pids": pids, "endpoints": [started[0].endpoint, plugin.endpoint]}))
        sys.stdin.readline()
        """,
        name="test run",
    ) as parent:
        started = json.loads(parent.expect(r"started (.*)", timeout=120).group(1))
        for endpoint in started["endpoints"]:  # alive and answering, thread or no thread
            with urlrequest.urlopen(f"http://{endpoint}/health", timeout=10) as answer:
                assert json.loads(answer.read())["health"] == "true"
        pids = started["pids"]
        assert not any(_gone(pid) for pid in pids)
        parent.kill()
        wait_until(lambda: all(_gone(pid) for pid in pids), 30, f"the children {pids} to die with their parent")
