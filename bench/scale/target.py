"""The etcd under measurement (a 3-member cluster or a single member on loopback) and what it reports.

    with Target("cluster", "3.5") as target:             # or Target("single"); v3 only
        target.urls(4, seed=1)                           # client URLs, the members in shuffled orders
        before = target.sample()
        ...
        window = target.sample().since(before)           # rates over the window
        window.requests_per_s, window.proposals_per_s, window.cpu_per_s, window.rss_mb
        target.leases(), target.raw(0).post("kv/range", {...})

Every figure comes from the server itself: ``/metrics`` of each member (scraped over HTTP,
which no gRPC counter sees), ``/proc/<pid>`` of each member for CPU and resident memory, and
``lease/leases`` (read after a window, as it is itself a request). Requests are
``grpc_server_msg_received_total`` summed over the members: the JSON gateway forwards each
HTTP call as one gRPC message. Proposals are ``etcd_server_proposals_committed_total`` on the
member with the most (each member commits every proposal; summing would count them thrice).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import random
import time
from dataclasses import dataclass
from http.client import HTTPConnection
from typing import Any

from bench.common import Metrics, cpu_seconds
from tests.support import EtcdCluster, EtcdServer

VERSION = "3.5"  # the default: the most deployed line (tests/support builds 3.5, 3.6 and 3.7)


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` in MiB (nan if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


class Raw:
    """A bare keep-alive HTTP connection to one member's JSON gateway: the raw floor, and the bench's own reads."""

    def __init__(self, endpoint: str, timeout: float = 30.0) -> None:
        host, _, port = endpoint.rpartition(":")
        self.conn = HTTPConnection(host, int(port), timeout=timeout)
        self.bytes_read = 0

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.conn.request("POST", f"/v3/{path}", json.dumps(body), {"Content-Type": "application/json"})
        response = self.conn.getresponse()
        data = response.read()
        self.bytes_read = len(data)
        if response.status != 200:
            raise RuntimeError(f"POST /v3/{path} answered {response.status}: {data[:300]!r}")
        return json.loads(data)

    def close(self) -> None:
        self.conn.close()


@dataclass
class Sample:
    at: float
    requests: float
    by_method: dict[str, float]
    proposals: float
    events: float
    cpu: float
    rss: float
    keys: float
    watchers: float

    def since(self, before: Sample) -> Window:
        seconds = max(1e-9, self.at - before.at)
        methods = {m: (v - before.by_method.get(m, 0.0)) / seconds for m, v in self.by_method.items()}
        return Window(
            seconds=seconds,
            requests=self.requests - before.requests,
            requests_per_s=(self.requests - before.requests) / seconds,
            by_method={m: v for m, v in methods.items() if v > 0},
            proposals=self.proposals - before.proposals,
            proposals_per_s=(self.proposals - before.proposals) / seconds,
            events=self.events - before.events,
            cpu=self.cpu - before.cpu,
            cpu_per_s=(self.cpu - before.cpu) / seconds,
            rss_mb=self.rss,
            keys=self.keys,
            watchers=self.watchers,
        )


@dataclass
class Window:
    seconds: float
    requests: float
    requests_per_s: float
    by_method: dict[str, float]
    proposals: float
    proposals_per_s: float
    events: float  # watch events etcd sent (etcd_debugging_mvcc_events_total)
    cpu: float  # etcd CPU seconds, all members
    cpu_per_s: float
    rss_mb: float  # all members, at the end
    keys: float
    watchers: float


class Target:
    """etcd (v3 only): ``"cluster"`` (3 members, the tests' fast raft timings) or ``"single"``."""

    def __init__(self, kind: str, version: str = VERSION) -> None:
        if kind not in ("cluster", "single"):
            raise ValueError(f"target must be 'cluster' or 'single', not {kind!r}")
        self.kind = kind
        self.cluster: EtcdCluster | None = None
        self.members: list[EtcdServer] = []
        if kind == "cluster":
            self.cluster = EtcdCluster(version, enable_v2=False)
            self.members = list(self.cluster.members)
        else:
            self.members = [EtcdServer(version, enable_v2=False, name="etcdlock-scale")]
        self._raw: dict[int, Raw] = {}

    def __enter__(self) -> Target:
        if self.cluster is not None:
            self.cluster.start()
            self.cluster.wait_for_leader()
        else:
            self.members[0].start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for raw in self._raw.values():
            raw.close()
        self._raw.clear()
        if self.cluster is not None:
            self.cluster.close()
        else:
            for member in self.members:
                member.close()

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    @property
    def pids(self) -> list[int]:
        return [m.pid for m in self.members if m.pid is not None]

    def urls(self, count: int, seed: int, prefix: str, **options: Any) -> list[str]:
        """``count`` client URLs naming every member, each in an order of its own (a fleet spreads over them)."""
        rng = random.Random(seed)
        urls = []
        for _ in range(count):
            order = list(range(len(self.members)))
            rng.shuffle(order)
            urls.append(self.members[0].url_for([self.members[i].endpoint for i in order], prefix=prefix, **options))
        return urls

    def raw(self, index: int = 0) -> Raw:
        if index not in self._raw:
            self._raw[index] = Raw(self.members[index].endpoint)
        return self._raw[index]

    def reconnect(self, index: int = 0) -> Raw:
        """A new connection for ``raw(index)`` (after a failed request left the old one unusable)."""
        old = self._raw.pop(index, None)
        if old is not None:
            old.close()
        return self.raw(index)

    def sample(self) -> Sample:
        scrapes = [Metrics(m.metrics()) for m in self.members]
        methods: dict[str, float] = {}
        for scrape in scrapes:
            for labels, value in scrape.samples.get("grpc_server_msg_received_total", []):
                name = labels.get("grpc_method", "?")
                methods[name] = methods.get(name, 0.0) + value
        return Sample(
            at=time.monotonic(),
            requests=sum(methods.values()),
            by_method=methods,
            proposals=max(s.sum("etcd_server_proposals_committed_total") for s in scrapes),
            events=sum(s.sum("etcd_debugging_mvcc_events_total") for s in scrapes),
            cpu=sum(cpu_seconds(pid) for pid in self.pids),
            rss=sum(rss_mb(pid) for pid in self.pids),
            keys=max(s.sum("etcd_debugging_mvcc_keys_total") for s in scrapes),
            watchers=sum(s.sum("etcd_debugging_mvcc_watcher_total") for s in scrapes),
        )

    def leases(self) -> int:
        """How many leases etcd holds (a request itself: call it outside a window)."""
        return len(self.raw().post("lease/leases", {}).get("leases") or [])

    def count(self, prefix: str) -> int:
        """Keys under ``prefix`` (a request itself)."""
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        return int(self.raw().post("kv/range", {"key": b64(prefix), "range_end": b64(end), "count_only": True})
                   .get("count", 0))  # fmt: skip

    def revoke_all(self) -> None:
        """Revoke every lease (what a cell leaves behind must not bill the next one)."""
        for lease in self.raw().post("lease/leases", {}).get("leases") or []:
            with contextlib.suppress(RuntimeError):  # expired meanwhile
                self.raw().post("kv/lease/revoke", {"ID": lease["ID"]})


def machine_load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"
