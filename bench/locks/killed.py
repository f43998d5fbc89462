"""Crash recovery: a holder SIGKILLed right after a renewal, and how long a queued waiter takes to get the lock.

ttl 3. The holder is killed right after one of its renewals returned (the
longest its entry can outlive it), while another process waits in
``acquire()``; the time from the kill to the waiter holding the lock.
python-etcd's ``etcd.Lock`` never renews, so it is killed as soon as the
waiter is queued, and "after its last renewal" is measured from its
acquisition. Every lock's trial runs at the same time, in its own two processes.
"""

from __future__ import annotations

import threading
import time
import traceback
import uuid
from typing import Any

from bench.common import emit, fmt, inbox, markdown_table
from bench.locks.harness import Harness
from bench.locks.kinds import LABELS, make_impl, warm_up


def task_hold_until_killed(kind: str, ports: dict[str, int], name: str, ttl: float) -> None:
    """Acquire, report it, report each renewal after that; never return (the main process SIGKILLs us)."""
    impl = make_impl(kind, ports, ttl)
    warm_up(impl)
    handle = impl.lock(name)
    handle.acquire()
    acquired = time.monotonic()
    renews = impl.on_renewal(handle, lambda: emit("renewed", time.monotonic()))
    emit("acquired", acquired, renews)
    while True:
        time.sleep(3600)


def task_wait_acquire(kind: str, ports: dict[str, int], name: str, ttl: float) -> float:
    """Connect, report ready; on "go" block in acquire(); return the moment it succeeded."""
    impl = make_impl(kind, ports, ttl)
    warm_up(impl)
    emit("ready")
    inbox()
    handle = impl.lock(name)
    emit("waiting", time.monotonic())
    handle.acquire()
    acquired = time.monotonic()
    handle.release()
    impl.close()
    return acquired


def run(h: Harness) -> None:
    s = h.settings
    kinds = h.kinds(floors=False)
    h.pool.grow(2 * len(kinds))
    out: dict[str, list[dict]] = {k: [] for k in kinds}
    for trial in range(s.killed_trials):
        threads = []
        for i, kind in enumerate(kinds):

            def one(i: int = i, kind: str = kind, trial: int = trial) -> None:
                try:
                    out[kind].append(_trial(h, kind, 2 * i, 2 * i + 1, trial))
                except Exception:  # noqa: BLE001 - reported in the results
                    out[kind].append({"error": traceback.format_exc()})

            threads.append(threading.Thread(target=one))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for kind in kinds:
            last = out[kind][-1]
            print(
                f"killed holder trial {trial + 1} {kind:13}: "
                f"{fmt(last.get('after_kill'))} s after kill, "
                f"{fmt(last.get('after_renewal'))} s after last renewal{' ERROR' if 'error' in last else ''}",
                flush=True,
            )
    h.results["killed"] = out


def _trial(h: Harness, kind: str, holder_index: int, waiter_index: int, trial: int) -> dict:
    ttl = h.settings.failover_ttl
    name = f"killed-{kind}-{trial}-{uuid.uuid4().hex[:6]}"
    pool = h.pool
    holder, waiter = pool[holder_index].wait_ready(), pool[waiter_index].wait_ready()
    waiter.run(f"{__name__}:task_wait_acquire", kind=kind, ports=h.ports, name=name, ttl=ttl)
    waiter.wait_for("ready", 60)
    holder.run(f"{__name__}:task_hold_until_killed", kind=kind, ports=h.ports, name=name, ttl=ttl)
    _, acquired_at, renews = holder.wait_for("acquired", 60)
    waiter.send("go")
    waiter.wait_for("waiting", 60)
    time.sleep(0.3)  # the waiter's acquire() is queued by now
    last_sign_of_life = acquired_at
    if renews:
        holder.drain()  # renewals that happened before the waiter queued
        _, last_sign_of_life = holder.wait_for("renewed", ttl * 2)
    killed_at = holder.kill()
    pool.replace(holder_index)
    waiter_got = waiter.result(ttl * 4 + 10)
    pool[holder_index].wait_ready()
    return {"after_kill": waiter_got - killed_at, "after_renewal": waiter_got - last_sign_of_life, "renews": renews}


def render(results: dict[str, Any], s: dict[str, Any]) -> list[str]:
    rows = []
    for kind, trials in results["killed"].items():
        good = [t for t in trials if "error" not in t]
        rows.append(
            [
                LABELS[kind],
                ", ".join(f"{t['after_kill']:.2f}" for t in good) or "error",
                ", ".join(f"{t['after_renewal']:.2f}" for t in good) or "error",
                "yes" if good and good[0]["renews"] else "no (killed right after acquiring)",
            ]
        )
    return [
        f"### Holder SIGKILLed right after a renewal (ttl {s['failover_ttl']:.0f}): a queued waiter acquires after\n",
        markdown_table(["lock", "s after the kill", "s after its last renewal", "renews while held"], rows),
        "",
    ]
