"""A real etcd on loopback: one member of its own, or (through cluster.py) one member of three.

    server = EtcdServer("3.4", enable_v2=True)      # /usr/bin/etcd (Debian etcd-server)
    server.start()
    client = connect(server.url(prefix="/t1"))       # "etcd://127.0.0.1:40123?prefix=/t1"
    server.pause(); server.resume()                  # SIGSTOP / SIGCONT
    server.restart()                                 # same data dir and ports: keys survive
    server.close()                                   # stop and remove the temp dir

``http()``, ``v3()`` and ``metrics()`` talk to it with plain urllib: the tests of the
servers must not depend on our own code.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import ssl
import subprocess
import uuid
from typing import Any
from urllib import error as urlerror
from urllib import request as urlrequest
from urllib.parse import quote, urlencode

from tests.support.etcd_versions import etcd_path
from tests.support.ports import HOST, free_port
from tests.support.process import ServerError, ServerProcess
from tests.support.tls import make_certificates

ROOT_USER = "root"
ROOT_PASSWORD = "root-secret"
APP_USER = "app"
APP_PASSWORD = "app-secret"


def etcd_binary(version: str) -> str:
    """The etcd executable of release line ``version``: "3.4" is Debian's, "3.5" to "3.7" are
    scripts/etcd-build's (tests/support/etcd_versions.py). ETCDLOCK_ETCD34 overrides 3.4's path.
    """
    path = etcd_path(version)
    if not os.access(path, os.X_OK):
        raise ServerError(f"etcd {version} not found at {path}: install Debian's etcd-server (scripts/test does)")
    _check_version(path, version)
    return path


_checked_versions: dict[str, str] = {}


def _check_version(path: str, version: str) -> None:
    if path not in _checked_versions:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
        found = re.search(r"etcd Version: (\d+\.\d+)", out)
        _checked_versions[path] = found.group(1) if found else "?"
    if _checked_versions[path] != version:
        raise ServerError(f"{path} is etcd {_checked_versions[path]}, expected {version}")


class EtcdServer(ServerProcess):
    """One real etcd on loopback, with its own temp dir (data, log, certificates).

    ``version``: "3.4" (/usr/bin/etcd), "3.5", "3.6" or "3.7" (built by scripts/etcd-build).
    ``enable_v2``: serve the v2 keys API (3.4 and 3.5 only).
    ``api``: which API the tests talk to, "v2" or "v3" (default: "v2" when ``enable_v2``);
    it picks the default URL scheme and which auth store ``auth=True`` sets up.

    ``tls=True``: https with a fresh CA (``ca_file``) and server cert for 127.0.0.1/localhost;
    a client needs the CA only (the server asks for no client cert, so ``client_cert`` is ignored).
    ``client_cert_auth=True`` adds ``--trusted-ca-file`` and ``--client-cert-auth``: every client
    must then present ``client_cert``/``client_key`` (etcd demands one once it has a trusted CA,
    whatever ``--client-cert-auth`` says). ``url()`` carries all three as ``?ca=&cert=&key=``.

    ``extra_flags``: more etcd flags, after ours (``("--auth-token-ttl=1",)``).

    ``auth=True``: users ``root`` (ROOT_PASSWORD) and ``app`` (APP_PASSWORD, role ``app`` with
    read-write on every key), then auth enabled. etcd keeps two unrelated auth stores:

    - api="v2": the v2 store, which the v2 keys API checks with HTTP basic auth:
      PUT /v2/auth/users/root, /v2/auth/roles/app, /v2/auth/users/app, PUT /v2/auth/enable,
      then the ``guest`` role (which v2 gives full access by default) is stripped of its rights,
      so an anonymous request gets 401.
    - api="v3": the v3 store (what ``etcdctl user add`` / ``auth enable`` use), reached here through
      the JSON gateway: /v3/auth/user/add, role/add, user/grant, role/grant, /v3/auth/enable.
      Clients POST /v3/auth/authenticate for a token, sent as the ``Authorization`` header.

    Either way setup is verified: anonymous access refused, ``app`` allowed.
    ``url()`` then contains ``app:app-secret@``.
    """

    log_name = "etcd.log"

    def __init__(
        self,
        version: str = "3.4",
        enable_v2: bool = True,
        tls: bool = False,
        auth: bool = False,
        name: str = "etcdlock-test",
        api: str | None = None,
        client_cert_auth: bool = False,
        extra_flags: tuple[str, ...] = (),
    ) -> None:
        if api is None:
            api = "v2" if enable_v2 else "v3"
        if api not in ("v2", "v3"):
            raise ValueError(f"api must be 'v2' or 'v3', not {api!r}")
        if api == "v2" and not enable_v2:
            raise ValueError("api='v2' needs enable_v2=True")
        if enable_v2 and version not in ("3.4", "3.5"):
            raise ValueError(f"etcd {version} has no v2 API (3.6 removed it): enable_v2 needs 3.4 or 3.5")
        self.version = version
        self.kind = f"etcd {version}"
        self.binary = etcd_binary(version)
        super().__init__(f"etcdlock-etcd{version}-")
        self.enable_v2 = enable_v2
        self.tls = tls
        self.auth = auth
        self.client_cert_auth = client_cert_auth
        self.extra_flags = list(extra_flags)  # appended to the command line: they win over ours
        self.api = api
        self.name = name
        self.data_dir = self.dir / "data"
        self.client_port = 0
        self.peer_port = 0
        self._auth_ready = False
        self.user = APP_USER if auth else None
        self.password = APP_PASSWORD if auth else None
        self.ca_file: str | None = None
        self.client_cert: str | None = None
        self.client_key: str | None = None
        if tls:
            files = make_certificates(self.dir / "tls", "celery-etcdlock-test-client" if api == "v2" else "")
            self.ca_file = str(files["ca"])
            self.client_cert = str(files["client_cert"])
            self.client_key = str(files["client_key"])
            self._server_cert = str(files["server_cert"])
            self._server_key = str(files["server_key"])

    # -- addresses

    @property
    def endpoint(self) -> str:
        return f"{HOST}:{self.client_port}"

    @property
    def client_url(self) -> str:
        """``http(s)://127.0.0.1:port``."""
        return f"{'https' if self.tls else 'http'}://{self.endpoint}"

    @property
    def peer_url(self) -> str:
        return f"http://{HOST}:{self.peer_port}"

    def url(
        self,
        scheme: str | None = None,
        prefix: str | None = None,
        *,
        user: str | None = None,
        password: str | None = None,
        **options: Any,
    ) -> str:
        """A celery_etcdlock URL for this server, e.g. ``etcd://127.0.0.1:40123?prefix=/p``.

        ``scheme`` defaults to etcd/etcd3 by ``api``, plus "s" with TLS. With auth it has
        ``app:app-secret@`` (or ``user``/``password``); with TLS ``?ca=&cert=&key=``.
        Extra keyword options (``timeout=2``, ``retry_max_delay=5``) go into the query.
        """
        return self.url_for([self.endpoint], scheme, prefix, user=user, password=password, **options)

    def url_for(
        self,
        endpoints: list[str],
        scheme: str | None = None,
        prefix: str | None = None,
        *,
        user: str | None = None,
        password: str | None = None,
        **options: Any,
    ) -> str:
        """``url()`` naming ``endpoints`` ("host:port", in that order) instead of this server alone."""
        if scheme is None:
            scheme = ("etcd" if self.api == "v2" else "etcd3") + ("s" if self.tls else "")
        user = user if user is not None else self.user
        password = password if password is not None else self.password
        credentials = f"{quote(user, safe='')}:{quote(password or '', safe='')}@" if user else ""
        query: dict[str, Any] = {}
        if prefix is not None:
            query["prefix"] = prefix
        if self.tls:
            query.update(ca=self.ca_file, cert=self.client_cert, key=self.client_key)
        query.update(options)
        tail = f"?{urlencode(query, safe='/')}" if query else ""
        return f"{scheme}://{credentials}{','.join(endpoints)}{tail}"

    # -- the process

    def ports(self) -> list[int]:
        return [self.client_port, self.peer_port]

    def choose_ports(self) -> None:
        self.client_port, self.peer_port = free_port(), free_port()

    def forget_data(self) -> None:
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def start(self) -> EtcdServer:
        """Start on fresh free ports (first time) or the same ports (later), and wait until healthy."""
        super().start()
        if self.auth and not self._auth_ready:
            self._enable_auth()
            self._auth_ready = True
        return self

    def cluster_flags(self) -> list[str]:
        """How this member finds its cluster: here a cluster of one (cluster.py's members name all three)."""
        return [
            f"--initial-cluster={self.name}={self.peer_url}",
            f"--initial-cluster-token=etcdlock-{uuid.uuid4().hex[:12]}",
            "--initial-cluster-state=new",
        ]

    def argv(self) -> list[str]:
        client = self.client_url
        cmd = [
            self.binary,
            f"--name={self.name}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={self.peer_url}",
            f"--initial-advertise-peer-urls={self.peer_url}",
            *self.cluster_flags(),
            "--logger=zap",
            "--log-outputs=stderr",
            "--log-level=warn",
        ]
        if self.version in ("3.4", "3.5"):
            cmd.append(f"--enable-v2={'true' if self.enable_v2 else 'false'}")  # 3.6 has no v2, nor the flag
        if self.tls:
            cmd += [f"--cert-file={self._server_cert}", f"--key-file={self._server_key}"]
            if self.client_cert_auth:
                # etcd requires a client cert from every client as soon as it has a trusted CA.
                cmd += [f"--trusted-ca-file={self.ca_file}", "--client-cert-auth=true"]
        return cmd + self.extra_flags

    def ready(self) -> bool:
        """GET /health says {"health": "true"}: the member has a leader and serves a quorum read."""
        self.check_alive()
        status, body = self.http("GET", "/health", timeout=2, client_cert=self.client_cert_auth)
        if status != 200:
            return False
        try:
            return bool(json.loads(body).get("health") == "true")
        except ValueError:
            return False

    def __repr__(self) -> str:
        flags = "".join(f" {f}" for f, on in (("v2", self.enable_v2), ("tls", self.tls), ("auth", self.auth)) if on)
        return f"<EtcdServer {self.version} {self.name} {self.endpoint} api={self.api}{flags}>"

    # -- talking to it (plain urllib: the tests of the servers must not depend on our code)

    def ssl_context(self, client_cert: bool = False) -> ssl.SSLContext | None:
        if not self.tls:
            return None
        ctx = ssl.create_default_context(cafile=self.ca_file)
        if client_cert:
            assert self.client_cert and self.client_key
            ctx.load_cert_chain(self.client_cert, self.client_key)
        return ctx

    def http(
        self,
        method: str,
        path: str,
        body: bytes | dict[str, Any] | None = None,
        *,
        basic_auth: tuple[str, str] | None = None,
        token: str | None = None,
        form: dict[str, str] | None = None,
        timeout: float = 10,
        client_cert: bool | None = None,
    ) -> tuple[int, bytes]:
        """One HTTP request to the client port: (status, body); status 0 if it could not connect.

        ``client_cert``: present the client certificate (default: when the server demands one).
        """
        headers: dict[str, str] = {}
        data: bytes | None
        if isinstance(body, dict):
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        elif form is not None:
            data = urlencode(form).encode()
            headers["Content-Type"] = "application/x-www-form-urlencoded"
        else:
            data = body
        if basic_auth:
            headers["Authorization"] = "Basic " + base64.b64encode(":".join(basic_auth).encode()).decode()
        if token:
            headers["Authorization"] = token
        req = urlrequest.Request(self.client_url + path, data=data, headers=headers, method=method)
        try:
            with urlrequest.urlopen(
                req,
                timeout=timeout,
                context=self.ssl_context(self.client_cert_auth if client_cert is None else client_cert),
            ) as resp:
                return resp.status, resp.read()
        except urlerror.HTTPError as exc:
            return exc.code, exc.read()
        except (urlerror.URLError, OSError):
            return 0, b""

    def v3(
        self, method: str, body: dict[str, Any], token: str | None = None, timeout: float = 10
    ) -> tuple[int, dict[str, Any]]:
        """POST /v3/<method> through etcd's JSON gateway, e.g. v3("kv/range", {"key": b64("k")}).

        Status 0 (and an empty reply) when it could not connect or got no answer within ``timeout``.
        """
        status, raw = self.http("POST", f"/v3/{method}", body, token=token, timeout=timeout)
        try:
            return status, json.loads(raw or b"{}")
        except ValueError:
            return status, {"raw": raw.decode(errors="replace")}

    def v3_token(self, user: str = APP_USER, password: str = APP_PASSWORD) -> str:
        status, reply = self.v3("auth/authenticate", {"name": user, "password": password})
        if status != 200 or "token" not in reply:
            raise ServerError(f"v3 authenticate as {user} failed: {status} {reply}")
        return str(reply["token"])

    def metrics(self) -> str:
        """The Prometheus text of /metrics."""
        status, body = self.http("GET", "/metrics")
        if status != 200:
            raise ServerError(f"GET /metrics on {self.endpoint} answered {status}")
        return body.decode()

    def proposals_committed(self) -> int:
        """etcd_server_proposals_committed_total: grows by one per write (and per lease renewal).

        etcd sets this gauge as raft reports commits, so it may trail the last answered write
        by a moment: compare with a poll (``wait_until``) or over many operations.
        """
        found = re.search(r"^etcd_server_proposals_committed_total\s+(\S+)$", self.metrics(), re.M)
        if not found:
            raise ServerError("etcd_server_proposals_committed_total not in /metrics")
        return int(float(found.group(1)))

    # -- auth

    def _enable_auth(self) -> None:
        if self.api == "v2":
            self._enable_v2_auth()
        else:
            self._enable_v3_auth()

    def _must(self, what: str, result: tuple[int, Any], ok: tuple[int, ...] = (200, 201)) -> None:
        if result[0] not in ok:
            raise ServerError(f"etcd auth setup: {what} answered {result[0]}: {result[1]!r}")

    def _enable_v2_auth(self) -> None:
        root = (ROOT_USER, ROOT_PASSWORD)
        everything = {"read": ["/*"], "write": ["/*"]}
        self._must(
            "PUT /v2/auth/users/root",
            self.http("PUT", "/v2/auth/users/root", {"user": ROOT_USER, "password": ROOT_PASSWORD}),
        )
        self._must(
            "PUT /v2/auth/roles/app",
            self.http("PUT", "/v2/auth/roles/app", {"role": "app", "permissions": {"kv": everything}}),
        )
        self._must(
            "PUT /v2/auth/users/app",
            self.http("PUT", "/v2/auth/users/app", {"user": APP_USER, "password": APP_PASSWORD, "roles": ["app"]}),
        )
        self._must("PUT /v2/auth/enable", self.http("PUT", "/v2/auth/enable"))
        # v2 creates a "guest" role with full access for anonymous requests: take it away.
        self._must(
            "PUT /v2/auth/roles/guest",
            self.http("PUT", "/v2/auth/roles/guest", {"role": "guest", "revoke": {"kv": everything}}, basic_auth=root),
        )
        self._must("anonymous GET /v2/keys/ (expect 401)", self.http("GET", "/v2/keys/"), ok=(401, 403))
        self._must("app GET /v2/keys/", self.http("GET", "/v2/keys/", basic_auth=(APP_USER, APP_PASSWORD)))

    def _enable_v3_auth(self) -> None:
        every_key = base64.b64encode(b"\0").decode()  # key=\0, range_end=\0: all keys
        steps: list[tuple[str, dict[str, Any]]] = [
            ("auth/user/add", {"name": ROOT_USER, "password": ROOT_PASSWORD}),
            ("auth/role/add", {"name": "root"}),
            ("auth/user/grant", {"user": ROOT_USER, "role": "root"}),
            ("auth/role/add", {"name": "app"}),
            (
                "auth/role/grant",
                {"name": "app", "perm": {"permType": "READWRITE", "key": every_key, "range_end": every_key}},
            ),
            ("auth/user/add", {"name": APP_USER, "password": APP_PASSWORD}),
            ("auth/user/grant", {"user": APP_USER, "role": "app"}),
            ("auth/enable", {}),
        ]
        for method, body in steps:
            self._must(f"POST /v3/{method}", self.v3(method, body))
        probe = {"key": base64.b64encode(b"/etcdlock-auth-probe").decode(), "value": ""}
        status, reply = self.v3("kv/put", probe)
        if status == 200:
            raise ServerError(f"v3 auth enabled but an anonymous put succeeded: {reply}")
        self._must("app put", self.v3("kv/put", probe, token=self.v3_token()))
