"""Roles that tests run as real OS processes: ``python -m tests.agents ROLE JSON``.

Each role prints one line per event it wants the test to see, flushed at
once, with the wall-clock time (``wall=``) so that a test can order events
across processes.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

from celery_etcdlock import Election, Mutex, RWLock, connect

_stdout = threading.Lock()


def say(*parts: object) -> None:
    # one write per line, under a lock: print() writes each part apart, and the
    # threads of a role (events, LEADING reports) would splice their lines
    line = " ".join(map(str, (*parts, f"wall={time.time():.6f}"))) + "\n"
    with _stdout:
        sys.stdout.write(line)
        sys.stdout.flush()


def _lock(args: dict[str, Any], on_lost: Any = None) -> Any:
    client = connect(args["url"])
    mode = args.get("mode", "mutex")
    if mode == "mutex":
        return Mutex(client, args["name"], ttl=args["ttl"], on_lost=on_lost)
    rw = RWLock(client, args["name"], ttl=args["ttl"])
    return rw.read(on_lost=on_lost) if mode == "read" else rw.write(on_lost=on_lost)


def counter(args: dict[str, Any]) -> None:
    """Loop: acquire, read-modify-write a shared file (not atomically), log the token, release."""
    lock = _lock(args)
    path, log = args["counter"], args["tokens"]
    for _ in range(args["rounds"]):
        lock.acquire()
        try:
            with open(path) as f:
                value = int(f.read() or 0)
            time.sleep(0.001)  # widen the window a missing lock would expose
            with open(path, "w") as f:
                f.write(str(value + 1))
            with open(log, "a") as f:
                f.write(f"{lock.token}\n")
        finally:
            lock.release()
    say("DONE")


def hold(args: dict[str, Any]) -> None:
    """Acquire, then report ``held`` every few milliseconds until killed (or ``seconds`` pass)."""
    lock = _lock(args, on_lost=lambda lk: say("LOST"))
    if not lock.acquire(timeout=args.get("timeout")):
        say("TIMEOUT")
        return
    say("HELD", f"token={lock.token}")
    end = time.monotonic() + args.get("seconds", 3600)
    while time.monotonic() < end:
        say(f"held={lock.held}")
        time.sleep(args.get("every", 0.02))
    if lock.held:
        lock.release()
        say("RELEASED")


def acquire(args: dict[str, Any]) -> None:
    """Queue up (announce it), acquire with a timeout, report, hold ``hold`` seconds, release."""
    lock = _lock(args)
    say("QUEUEING")
    if lock.acquire(timeout=args.get("timeout")):
        say("ACQUIRED", f"token={lock.token}")
        time.sleep(args.get("hold", 0))
        lock.release()
        say("RELEASED")
    else:
        say("TIMEOUT")


def churn(args: dict[str, Any]) -> None:
    """Acquire and release in a loop for ``seconds``, surviving etcd outages."""
    lock = _lock(args)
    end = time.monotonic() + args["seconds"]
    done = errors = 0
    while time.monotonic() < end:
        try:
            if lock.acquire(timeout=5):
                lock.release()
                done += 1
                if done % 10 == 1:
                    say("CYCLE", done)
        except Exception as exc:  # an outage may surface as BackendUnavailable: keep going
            errors += 1
            say("ERROR", type(exc).__name__)
    say("DONE", f"cycles={done}", f"errors={errors}")


def elect(args: dict[str, Any]) -> None:
    """Campaign in the background; print every event, and LEADING while this node leads."""
    election = Election(connect(args["url"]), args["name"], identity=args["identity"], ttl=args["ttl"])
    election.start()

    def report() -> None:
        while True:
            if election.is_leader:
                say("LEADING")
            time.sleep(0.02)

    threading.Thread(target=report, daemon=True).start()
    if args.get("resign_after"):
        threading.Timer(args["resign_after"], lambda: (say("RESIGNING"), election.resign())).start()
    for event in election.events():
        say("EVENT", event.kind, f"leader={event.leader}")


if __name__ == "__main__":
    role, payload = sys.argv[1], json.loads(sys.argv[2])
    say("START", f"pid={os.getpid()}")
    {"counter": counter, "hold": hold, "acquire": acquire, "churn": churn, "elect": elect}[role](payload)


# -- for the tests: start a role, read its lines ---------------------------------------


def agent(role: str, **args: Any) -> Any:
    """Start ``role`` in a real OS process; returns a ``tests.procs.Proc`` (a context manager that kills it)."""
    from tests.procs import Proc

    return Proc.module("tests.agents", role, json.dumps(args), name=f"agent-{role}")


def walls(line: str) -> float:
    """The ``wall=`` time an agent printed on ``line``."""
    return float(line.rsplit("wall=", 1)[1].split()[0])
