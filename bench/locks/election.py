"""Election fail-over: 3 candidates, ttl 3; a new leader after resign() and after a SIGKILL.

resign(): the time from the leader calling it to another candidate being
elected (each candidate reports its own monotonic time; Linux's monotonic clock
is system-wide). SIGKILL: the leader is killed right after a renewal; the time
to the next leader. A fresh candidate replaces each one that resigned or died.
Ours on each API, side by side with tooz's Redis election (its etcd3gw driver
has none), which elects only inside ``run_watchers()``: its candidates call it
every ``tooz_poll`` seconds.
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import threading
import time
import traceback
import uuid
from typing import Any

from bench.common import emit, inbox, markdown_table
from bench.locks.harness import Harness
from bench.locks.kinds import HOST, LABELS, call_on_http_request, connect_ours, is_ours_renewal


def task_candidate(kind: str, ports: dict[str, int], name: str, identity: str, ttl: float, poll: float) -> float:
    """Campaign; once leader report "elected" and each renewal; on "resign" step down and return."""
    if kind == "tooz-redis":
        return _tooz_candidate(ports, name, identity, ttl, poll)
    from celery_etcdlock import Election

    api = "v2" if kind.endswith("v2") else "v3"
    client = connect_ours(api, ports)
    election = Election(client, name, identity, ttl=ttl)
    emit("campaigning")
    election.campaign()
    emit("elected", time.monotonic(), identity)
    call_on_http_request(is_ours_renewal(api), lambda: emit("renewed", time.monotonic()))
    inbox()
    resigning = time.monotonic()
    emit("resigning", resigning)
    election.resign()
    client.close()
    return resigning


def _tooz_candidate(ports: dict[str, int], name: str, identity: str, ttl: float, poll: float) -> float:
    from tooz import coordination

    url = f"redis://{HOST}:{ports['redis']}?lock_timeout={int(ttl)}&membership_timeout={int(ttl)}"
    coordinator = coordination.get_coordinator(url, identity.encode())
    coordinator.start(start_heart=True)
    group = name.encode()
    with contextlib.suppress(coordination.GroupAlreadyExist):
        coordinator.create_group(group).get()
    coordinator.join_group(group).get()
    elected = threading.Event()
    coordinator.watch_elected_as_leader(group, lambda event: elected.set())
    emit("campaigning")
    while not elected.is_set():  # tooz elects in run_watchers(), which the application calls
        coordinator.run_watchers()
        if not elected.is_set():
            time.sleep(poll)
    emit("elected", time.monotonic(), identity)
    heartbeat = coordinator.heartbeat

    def heartbeat_and_tell() -> Any:
        result = heartbeat()
        emit("renewed", time.monotonic())
        return result

    coordinator.heartbeat = heartbeat_and_tell  # type: ignore[method-assign]
    inbox()
    resigning = time.monotonic()
    emit("resigning", resigning)
    coordinator.stop()  # the redis driver has no stand_down_group_leader: stop() releases the leader lock
    return resigning


def run(h: Harness) -> None:
    kinds = [f"ours-{api}" for api in h.ours_apis()] + ["tooz-redis"]
    h.pool.grow(3 * len(kinds))
    out: dict[str, dict[str, Any]] = {}
    threads = []
    for i, kind in enumerate(kinds):

        def one(i: int = i, kind: str = kind) -> None:
            try:
                out[kind] = _trials(h, kind, list(range(3 * i, 3 * i + 3)))
            except Exception:  # noqa: BLE001 - reported in the results
                out[kind] = {"error": traceback.format_exc()}

        threads.append(threading.Thread(target=one))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for kind, data in out.items():
        if "error" in data:
            print(f"election {kind}: ERROR\n{data['error']}", flush=True)
        else:
            print(
                f"election {kind:10}: resign -> {', '.join(f'{x * 1000:.0f} ms' for x in data['resign'])}; "
                f"SIGKILL -> {', '.join(f'{x:.2f} s' for x in data['kill'])}",
                flush=True,
            )
    h.results["election"] = {kind: out[kind] for kind in kinds}  # in a fixed order, not the order they finished


def _trials(h: Harness, kind: str, indexes: list[int]) -> dict:
    s = h.settings
    ttl, pool = s.failover_ttl, h.pool
    name = f"election-{kind}-{uuid.uuid4().hex[:6]}"
    serial = iter(range(1000))
    campaigning: set[int] = set()

    def wait_campaigning(index: int) -> None:
        if index not in campaigning:
            pool[index].wait_for("campaigning", 60)
        campaigning.discard(index)

    def start_candidate(index: int) -> None:
        campaigning.discard(index)
        pool[index].wait_ready().run(
            f"{__name__}:task_candidate",
            kind=kind,
            ports=h.ports,
            name=name,
            identity=f"cand-{next(serial)}",
            ttl=ttl,
            poll=s.tooz_poll,
        )

    def next_elected(timeout: float) -> tuple[int, float]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{kind}: nobody elected within {timeout}s")
            busy = [i for i in indexes if pool[i].busy]
            ready = multiprocessing.connection.wait([pool[i].conn for i in busy], left)
            for conn in ready:
                index = next(i for i in busy if pool[i].conn is conn)
                event = pool[index].next_event(0)
                if event[0] == "campaigning":
                    campaigning.add(index)
                if event[0] == "elected":
                    return index, event[1]

    for index in indexes:
        start_candidate(index)
    leader, _ = next_elected(120)
    for index in indexes:  # everyone in the race before the first trial
        if index != leader:
            wait_campaigning(index)
    time.sleep(0.5)
    resign: list[float] = []
    kill: list[float] = []
    kill_after_renewal: list[float] = []
    for _ in range(s.resign_trials):
        pool[leader].send("resign")
        _, resigned_at = pool[leader].wait_for("resigning", 30)
        pool[leader].result(30)
        new_leader, elected_at = next_elected(30)
        resign.append(elected_at - resigned_at)
        start_candidate(leader)
        wait_campaigning(leader)
        time.sleep(0.3)
        leader = new_leader
    for _ in range(s.kill_trials):
        pool[leader].drain()
        # kill right after a renewal: the longest its entry can outlive it
        _, renewed_at = pool[leader].wait_for("renewed", ttl * 2)
        killed_at = pool[leader].kill()
        pool.replace(leader).wait_ready()
        start_candidate(leader)  # a fresh third candidate, as a restarted host would be
        new_leader, elected_at = next_elected(ttl * 4 + 10)
        kill.append(elected_at - killed_at)
        kill_after_renewal.append(elected_at - renewed_at)
        leader = new_leader
    for index in indexes:  # end the candidates: the waiting ones are blocked in campaign()
        pool.replace(index)
    for index in indexes:
        pool[index].wait_ready()
    return {"resign": resign, "kill": kill, "kill_after_renewal": kill_after_renewal}


def render(results: dict[str, Any], s: dict[str, Any]) -> list[str]:
    rows = []
    for kind, r in results["election"].items():
        if "error" in r:
            rows.append([LABELS[kind], "error", "error"])
            continue
        rows.append(
            [LABELS[kind], ", ".join(f"{x * 1000:.0f}" for x in r["resign"]), ", ".join(f"{x:.2f}" for x in r["kill"])]
        )
    return [
        f"### Election fail-over, 3 candidates, ttl {s['failover_ttl']:.0f}\n",
        markdown_table(["election", "resign() -> new leader, ms", "SIGKILL after renewal -> new leader, s"], rows),
        f"\ntooz's candidates call run_watchers() every {s['tooz_poll'] * 1000:.0f} ms; its redis driver "
        "has no stand_down_group_leader(), so it resigns with stop(), which releases the leader lock.\n",
    ]
