"""The test servers and subprocess helpers themselves: each kind starts, answers, and restarts."""

from __future__ import annotations

import base64
import threading
from urllib import request as urlrequest

import etcd
import pytest
import redis

from celery_etcdlock.connect import parse_url
from tests.procs import Proc, ProcFailed
from tests.support import APP_PASSWORD, APP_USER, ROOT_PASSWORD, ROOT_USER, EtcdServer, RedisServer, wait_until


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def v3_put(server: EtcdServer, key: str, value: str, token: str | None = None) -> int:
    return server.v3("kv/put", {"key": b64(key), "value": b64(value)}, token=token)[0]


def v3_get(server: EtcdServer, key: str, token: str | None = None) -> str | None:
    status, reply = server.v3("kv/range", {"key": b64(key)}, token=token)
    assert status == 200, reply
    kvs = reply.get("kvs", [])
    return base64.b64decode(kvs[0]["value"]).decode() if kvs else None


# -- etcd --------------------------------------------------------------------------------------


def test_v2_server_reads_and_writes_through_python_etcd(etcd_server: EtcdServer) -> None:
    assert etcd_server.version == "3.4" and etcd_server.enable_v2
    c = etcd.Client(host="127.0.0.1", port=etcd_server.client_port)
    c.write("/smoke/v2", "hello")
    assert c.read("/smoke/v2").value == "hello"
    assert etcd_server.url(prefix="/p") == f"etcd://127.0.0.1:{etcd_server.client_port}?prefix=/p"


def test_v3_only_server_has_no_v2_api(etcd3_server: EtcdServer) -> None:
    assert etcd3_server.version == "3.5" and not etcd3_server.enable_v2
    status, _ = etcd3_server.http("GET", "/v2/keys/")
    assert status == 404
    assert v3_put(etcd3_server, "/smoke/v3", "there") == 200
    assert v3_get(etcd3_server, "/smoke/v3") == "there"
    assert etcd3_server.url() == f"etcd3://127.0.0.1:{etcd3_server.client_port}"


def test_proposals_committed_counts_writes(etcd3_server: EtcdServer) -> None:
    before = etcd3_server.proposals_committed()
    for i in range(5):
        assert v3_put(etcd3_server, f"/smoke/count/{i}", "x") == 200
    # A gauge set as raft reports commits: it may trail the last answered write by a moment.
    wait_until(lambda: etcd3_server.proposals_committed() >= before + 5, 10, "5 more proposals committed")
    assert "etcd_server_has_leader 1" in etcd3_server.metrics()


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
