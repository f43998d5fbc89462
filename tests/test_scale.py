"""Capacity: what stays flat as the work grows (issue 26), on a real etcd (the default v3 kind).

A v3 session's renewal lists the keys of its lease (etcd's LeaseTimeToLive with keys, unpaged), so one
lease carries at most ``session.ENTRIES_PER_LEASE`` entries: the answer stays far below the transport's cap
on a response whatever the number of locks a process holds, and the requests stay three per lease.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from pathlib import Path

import pytest

from celery_etcdlock import Mutex, connect
from celery_etcdlock.locks import session
from tests.support import EtcdServer
from tests.support.etcd_versions import DEFAULT_KIND

from .test_gateway import count_requests


def test_a_session_spreads_its_entries_over_leases_of_bounded_size(
    etcd_v3_server: EtcdServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(session, "ENTRIES_PER_LEASE", 3)
    client = connect(etcd_v3_server.url(prefix=f"/scale-{uuid.uuid4().hex[:8]}"), retry_max_delay=10)
    locks = [Mutex(client, f"held-{i}", ttl=60) for i in range(7)]  # ttl 60: the renewer sleeps 20 s
    try:
        for lock in locks:
            assert lock.acquire(blocking=False)
        s = client.session(60)
        leases = list(s._leases)
        assert sorted(len(lease.skeys) for lease in leases) == [1, 3, 3]
        with count_requests() as counts:
            for lease in leases:
                s._renew(lease)
        # three requests a lease (keep-alive, the confirming read, the listing), none per lock
        assert counts == Counter({"/v3/lease/keepalive": 3, "/v3/kv/range": 3, "/v3/kv/lease/timetolive": 3})
        assert sorted(len(lease.handle.keys or ()) for lease in leases) == [1, 3, 3]
        assert all(lock.held for lock in locks)
        for lock in locks:
            lock.release()
        assert len(s._leases) == 1  # the full leases went with their last entry; the shared one lapses
    finally:
        client.close()


@pytest.mark.slow
def test_bench_scale_runs_its_smallest_cell(tmp_path: Path) -> None:
    """The capacity benchmark's harness works: 10 clients holding nothing, then one lock each, on one etcd."""
    pytest.importorskip("urllib3")  # bench.common counts requests through it in every host process
    from bench import bench_scale

    out = tmp_path / "scale.json"
    argv = ["--quick", "--targets", "single", "--only", "idle", "--cells", "1", "--json", str(out)]
    assert bench_scale.main([*argv, "--etcd", DEFAULT_KIND["v3"].version]) == 0
    rows = {row["k"]: row for row in json.loads(out.read_text())["idle"]}
    assert sorted(rows) == [0, 1]
    assert rows[0]["requests"] == 0 and rows[0]["leases"] == 0  # a client that holds nothing sends nothing
    assert rows[1]["held"] == 10 and rows[1]["lost"] == 0 and rows[1]["leases"] == 10  # a lease per client
