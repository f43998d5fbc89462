"""Semaphore against a real etcd (both APIs): at most ``limit`` inside, FIFO, crashes, freezes, one limit."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from celery_etcdlock import LimitMismatch, Semaphore
from celery_etcdlock.keys import SEMAPHORES
from tests.procs import Proc
from tests.support import wait_until

# A process that takes a slot in a loop and counts, in a shared file under flock, how many are inside.
INSIDE = """
import fcntl, json, os, sys, time
from celery_etcdlock import Semaphore, connect

url, name, limit, rounds, path = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
slot = Semaphore(connect(url), name, limit=limit, ttl=10)

def change(step):
    with open(path, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        state = json.loads(f.read() or '{"inside": 0, "most": 0, "tokens": []}')
        state["inside"] += step
        state["most"] = max(state["most"], state["inside"])
        if step > 0:
            state["tokens"].append(slot.token)
        f.seek(0); f.truncate(); f.write(json.dumps(state))

print("READY", flush=True)
for _ in range(rounds):
    assert slot.acquire(timeout=120)
    change(+1)
    time.sleep(0.02)  # work inside the slot: lets the others pile up behind the limit
    change(-1)
    slot.release()
print("DONE", flush=True)
"""


def test_at_most_limit_processes_inside_and_the_limit_is_reached(etcd_url: str, tmp_path: Path) -> None:
    state = tmp_path / "inside.json"
    state.write_text("")
    procs, limit, rounds = 7, 3, 8
    runners = [Proc.start(INSIDE, etcd_url, "pool", str(limit), str(rounds), str(state)) for _ in range(procs)]
    try:
        for runner in runners:
            runner.expect("DONE", timeout=180)
    finally:
        for runner in runners:
            runner.kill()
    import json

    seen = json.loads(state.read_text())
    assert seen["inside"] == 0
    assert seen["most"] <= limit, f"{seen['most']} processes were inside a semaphore of {limit}"
    assert seen["most"] == limit, "the limit was never reached: the semaphore let fewer in than it may"
    assert len(seen["tokens"]) == procs * rounds and len(set(seen["tokens"])) == procs * rounds  # one token each


def test_holders_tokens_and_a_free_slot(client) -> None:
    slots = [Semaphore(client, "s", limit=3, ttl=5) for _ in range(4)]
    for slot in slots[:3]:
        assert slot.acquire(blocking=False)
    tokens = [slot.token for slot in slots[:3]]
    assert tokens == sorted(tokens) and len(set(tokens)) == 3
    assert not slots[3].acquire(blocking=False)
    assert slots[3].conflict is not None and [h["token"] for h in slots[3].conflict.described()] == tokens
    assert [h["token"] for h in slots[0].holders()] == tokens
    slots[1].release()  # the middle one: a slot is free although the oldest holder stays
    assert slots[3].acquire(blocking=False)
    assert slots[3].token > max(tokens)
    for slot in (slots[0], slots[2], slots[3]):
        slot.release()
    assert client.backend.list_queues(SEMAPHORES) == {}


def test_a_waiter_takes_the_slot_of_whichever_holder_leaves_first(client) -> None:
    """Holders leave in any order: a waiter must not sleep on a long holder while a short one's slot is free."""
    long, short = Semaphore(client, "w", limit=2, ttl=5), Semaphore(client, "w", limit=2, ttl=5)
    assert long.acquire(timeout=5) and short.acquire(timeout=5)
    waiter = Semaphore(client, "w", limit=2, ttl=5)
    taken = threading.Event()
    thread = threading.Thread(target=lambda: waiter.acquire(timeout=30) and taken.set())
    thread.start()
    wait_until(lambda: len(client.backend.read_queue(f"{SEMAPHORES}/w").entries) == 3, 10, "the waiter to queue")
    short.release()
    assert taken.wait(10), "the waiter slept while a slot was free"
    assert long.held and waiter.held
    thread.join(10)
    long.release()
    waiter.release()


def test_waiters_are_served_in_arrival_order(client) -> None:
    """Each release lets in the longest waiting request, and only it."""
    holders = [Semaphore(client, "fifo", limit=2, ttl=5) for _ in range(2)]
    for holder in holders:
        assert holder.acquire(timeout=5)
    waiters = [Semaphore(client, "fifo", limit=2, ttl=5) for _ in range(4)]
    took = [threading.Event() for _ in waiters]
    threads = []
    for i, waiter in enumerate(waiters):
        thread = threading.Thread(target=lambda w=waiter, e=took[i]: w.acquire(timeout=60) and e.set())
        thread.start()
        threads.append(thread)
        wait_until(lambda n=i: len(client.backend.read_queue(f"{SEMAPHORES}/fifo").entries) == 3 + n, 10, "queue")
    leaving = [*holders, *waiters]
    for i in range(len(waiters)):
        leaving[i].release()  # frees one slot: the i-th waiter, and no later one, takes it
        assert took[i].wait(10), f"waiter {i} was not let in"
        assert not any(event.is_set() for event in took[i + 1 :]), f"a waiter behind {i} overtook it"
    for thread in threads:
        thread.join(10)
    for waiter in waiters[-2:]:
        waiter.release()


def test_a_different_limit_is_refused_naming_both(client) -> None:
    three = Semaphore(client, "limited", limit=3, ttl=5)
    assert three.acquire(timeout=5)
    four = Semaphore(client, "limited", limit=4, ttl=5)
    for attempt in (lambda: four.acquire(blocking=False), lambda: four.acquire(timeout=5)):
        with pytest.raises(LimitMismatch, match="has limit 3 .*not 4") as raised:
            attempt()
        assert isinstance(raised.value, ValueError) and (raised.value.limit, raised.value.asked) == (3, 4)
    assert [len(e) for e in client.backend.list_queues(SEMAPHORES).values()] == [1]  # the refused left nothing
    three.release()
    assert four.acquire(blocking=False)  # once the old participants are gone, the new limit holds
    four.release()


@pytest.mark.parametrize("limit", [0, -1, 1.5, "3", True])
def test_bad_limit(client, limit) -> None:
    with pytest.raises(ValueError, match="limit must be a positive whole number"):
        Semaphore(client, "bad", limit=limit)


HOLD = """
import sys
from celery_etcdlock import Semaphore, connect
lost = lambda s: print("LOST", flush=True)
slot = Semaphore(connect(sys.argv[1]), "crash", limit=2, ttl=float(sys.argv[2]), on_lost=lost)
assert slot.acquire(timeout=30)
print("HELD", slot.token, flush=True)
import time
while True:
    print("held=%s" % slot.held, flush=True)
    time.sleep(0.05)
"""


def test_a_killed_holders_slot_frees_within_ttl(etcd_url: str, client) -> None:
    ttl = 2
    other = Semaphore(client, "crash", limit=2, ttl=ttl)
    assert other.acquire(timeout=5)
    with Proc.start(HOLD, etcd_url, str(ttl)) as holder:
        holder.expect("HELD", timeout=30)
        holder.kill()
        contender = Semaphore(client, "crash", limit=2, ttl=ttl)
        assert contender.acquire(timeout=ttl + 1), "the dead holder's slot was not freed within ttl + 1 s"
        contender.release()
    other.release()


def test_a_frozen_holder_learns_it_lost_its_slot_before_anyone_takes_it(etcd_url: str, client) -> None:
    ttl = 1
    other = Semaphore(client, "crash", limit=2, ttl=ttl)
    assert other.acquire(timeout=5)
    with Proc.start(HOLD, etcd_url, str(ttl)) as holder:
        holder.expect("HELD", timeout=30)
        holder.stop()
        contender = Semaphore(client, "crash", limit=2, ttl=ttl)
        assert contender.acquire(timeout=ttl + 3)
        taken_at = time.time()
        holder.cont()
        holder.expect("LOST", timeout=10)
        # every line the holder printed after it was resumed says it no longer holds
        after = holder.lines[holder.lines.index(next(line for line in holder.lines if "LOST" in line)) :]
        assert all("held=True" not in line for line in after)
        assert contender.held and taken_at
        contender.release()
    other.release()
