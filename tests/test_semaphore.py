"""Semaphore against a real etcd (both APIs): at most ``limit`` inside, FIFO, crashes, freezes, one limit."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from celery_etcdlock import Semaphore
from tests.procs import Proc

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


@pytest.mark.slow
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
