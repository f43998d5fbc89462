"""Capacity: what stays flat as the work grows (issue 26), on a real etcd 3.5.

A v3 session's renewal lists the keys of its lease (etcd's LeaseTimeToLive with keys, unpaged), so one
lease carries at most ``session.ENTRIES_PER_LEASE`` entries: the answer stays far below the transport's cap
on a response whatever the number of locks a process holds, and the requests stay three per lease.
"""

from __future__ import annotations

import uuid
from collections import Counter

import pytest

from celery_etcdlock import Mutex, connect
from celery_etcdlock.locks import session
from tests.support import EtcdServer

from .test_gateway import count_requests


def test_a_session_spreads_its_entries_over_leases_of_bounded_size(
    etcd35_server: EtcdServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(session, "ENTRIES_PER_LEASE", 3)
    client = connect(etcd35_server.url(prefix=f"/scale-{uuid.uuid4().hex[:8]}"), retry_max_delay=10)
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
