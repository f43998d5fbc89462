"""The lock workloads of the fault suite, each a real OS process: ``python -m tests.cluster_workloads ROLE JSON``.

    counter     a Mutex, then a read-modify-write of a shared counter file, with an overlap detector
    rwmix       an RWLock, readers and writers at random, with an occupancy file under flock
    candidate   an Election in the background; records when this process believed it led

Each process appends one JSON line per event to its own file (``log``), written with a
single ``os.write`` on an O_APPEND descriptor and timed with the wall clock (``time.time()``,
one clock for every process of the machine), so that the test can order events across
processes at any moment while they run. A line with ``"event": "error"`` records an etcd
error the role survived (``BackendUnavailable`` while the cluster has no quorum): a role
never dies of one. SIGTERM ends the role cleanly (exit 0) after its current step.

What each role records, and what the test checks with it (tests/test_cluster_faults.py):

- counter: ``inc`` with the value it read and the fencing token it wrote under. Lost
  updates show as a final counter below the number of ``inc`` lines (or two lines that read
  one value); overlaps as ``overlap: true`` (the detector is a file created with O_EXCL on
  entry and removed on exit); token order as a token not larger than the one that wrote
  the value before.
- rwmix: ``read`` / ``write`` with the token, and ``conflict: true`` if the occupancy file
  showed a writer beside a reader, or anyone beside a writer; writers also bump a write
  counter, whose order their tokens must follow.
- every role: ``lost`` with the ``cause`` (``late``, ``revoked``, ``deleted``) whenever a hold
  or a leadership ends before its release.
- candidate: ``lead`` when it starts believing it leads, ``leading`` every 0.2 s while it
  does, ``end`` when it stops. The interval recorded is [t1 of the first sample that read
  ``is_leader`` True, t0 of the last such sample], where t0/t1 are the clock read before
  and after the sample: always inside the true interval, so a recorded overlap is a real one.
"""

from __future__ import annotations

import contextlib
import faulthandler
import fcntl
import json
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from celery_etcdlock import Election, EtcdLockError, Mutex, RWLock, connect, observe
from celery_etcdlock.locks.session import Flag


class Stopping(Flag):
    """Set by SIGTERM: the session's plain flag, and a wait that polls it.

    Not a threading.Event: its set() takes the event's lock, which the thread the signal
    handler interrupted may hold inside that same event's wait(); the handler then waits for
    itself forever (a role that never stopped, in a fault suite run).
    """

    __slots__ = ()

    def wait(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while not self.is_set() and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, 0.05))
        return self.is_set()
        return self.flag


stopping = Stopping()
#: a blocked acquire waits this long at most: far longer than any fault, so that a waiter stuck on a
#: member that failed shows as a stall (it does not give up and queue again), yet a bug never hangs the run
ACQUIRE_TIMEOUT = 60.0


class Log:
    """One JSON line per event, appended atomically to this process's file."""

    def __init__(self, path: str, role: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.base = {"role": role, "pid": os.getpid()}
        self.lock = threading.Lock()

    def __call__(self, event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, "at": time.time(), **self.base, **fields}) + "\n"
        with self.lock:
            os.write(self.fd, line.encode())


def pause(seconds: float) -> None:
    stopping.wait(seconds)


def acquired(lock: Any, log: Log) -> bool:
    """``lock.acquire`` with the workloads' timeout; an etcd error is logged, paused on, and a False."""
    try:
        return bool(lock.acquire(timeout=ACQUIRE_TIMEOUT))
    except EtcdLockError as exc:
        log("error", op="acquire", error=repr(exc)[:300])
        pause(0.2)
        return False


def counter(args: dict[str, Any], log: Log) -> None:
    """Loop: acquire, read the counter, write it + 1 (not atomically), record it, release."""
    lock = Mutex(connect(args["url"]), args["name"], ttl=args["ttl"])
    path, inside = args["counter"], args["counter"] + ".inside"
    rng = random.Random(args["seed"])
    while not stopping.is_set():
        if not acquired(lock, log):
            continue
        try:
            if not lock.held:  # lost in the instant after acquire returned: do not enter
                log("lost_before_entry", token=lock.token)
                continue
            t_in = time.time()
            overlap = False
            try:
                marker = os.open(inside, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                overlap, marker = True, -1
            with open(path) as f:
                value = int(f.read() or 0)
            time.sleep(0.002)  # widen the window a missing lock would expose
            with open(path, "w") as f:
                f.write(str(value + 1))
            if marker >= 0:
                os.close(marker)
                os.unlink(inside)
            t_out = time.time()
            log("inc", value=value, token=lock.token, t_in=t_in, t_out=t_out, overlap=overlap, held_out=lock.held)
        finally:
            try:
                lock.release()
            except EtcdLockError as exc:
                log("error", op="release", error=repr(exc)[:300])
        pause(rng.uniform(0.01, 0.06))


@contextlib.contextmanager
def occupancy(path: str) -> Iterator[dict[str, int]]:
    """The rwmix occupancy document, read and written under an exclusive flock."""
    with open(path + ".flock", "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        try:
            try:
                with open(path) as f:
                    state = json.loads(f.read() or "{}")
            except FileNotFoundError:
                state = {}
            state = {"readers": 0, "writers": 0, "writes": 0, **state}
            yield state
            with open(path, "w") as f:
                f.write(json.dumps(state))
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def rwmix(args: dict[str, Any], log: Log) -> None:
    """Loop: read (60 %) or write (40 %) under the RWLock; check the occupancy while inside."""
    rw = RWLock(connect(args["url"]), args["name"], ttl=args["ttl"])
    path = args["state"]
    rng = random.Random(args["seed"])
    while not stopping.is_set():
        mode = "read" if rng.random() < 0.6 else "write"
        lock = rw.read() if mode == "read" else rw.write()
        if not acquired(lock, log):
            continue
        try:
            if not lock.held:
                log("lost_before_entry", token=lock.token)
                continue
            t_in = time.time()
            with occupancy(path) as state:
                if mode == "read":
                    conflict = state["writers"] > 0
                    state["readers"] += 1
                    write_number = None
                else:
                    conflict = state["writers"] > 0 or state["readers"] > 0
                    state["writers"] += 1
                    write_number = state["writes"]
                    state["writes"] += 1
            time.sleep(rng.uniform(0.005, 0.03))
            with occupancy(path) as state:
                state["readers" if mode == "read" else "writers"] -= 1
            t_out = time.time()
            log(mode, token=lock.token, write=write_number, t_in=t_in, t_out=t_out, conflict=conflict,
                held_out=lock.held)  # fmt: skip
        finally:
            try:
                lock.release()
            except EtcdLockError as exc:
                log("error", op="release", error=repr(exc)[:300])
        pause(rng.uniform(0.02, 0.08))


def candidate(args: dict[str, Any], log: Log) -> None:
    """Campaign in the background; sample ``is_leader`` every few ms and record each leadership."""
    election = Election(connect(args["url"]), args["name"], identity=args["identity"], ttl=args["ttl"])
    election.start()

    def events() -> None:
        for event in election.events():
            log("election_event", kind=event.kind, leader=event.leader)

    threading.Thread(target=events, daemon=True).start()
    leading: dict[str, Any] | None = None  # start, last, token of the leadership being recorded
    last_report = 0.0
    while not stopping.is_set():
        t0 = time.time()
        token = election.token if election.is_leader else None
        t1 = time.time()
        if leading is not None and token != leading["token"]:
            log("end", token=leading["token"], start=leading["start"], end=leading["last"])
            leading = None
        if token is not None:
            if leading is None:
                leading = {"start": t1, "last": t0, "token": token}
                log("lead", token=token, start=t1)
            leading["last"] = t0
            if t0 - last_report >= 0.2:
                last_report = t0
                log("leading", token=token, start=leading["start"], last=t0)
        time.sleep(0.005)
    if leading is not None:
        log("end", token=leading["token"], start=leading["start"], end=leading["last"])
    election.stop()


ROLES = {"counter": counter, "rwmix": rwmix, "candidate": candidate}


def main() -> None:
    role, args = sys.argv[1], json.loads(sys.argv[2])
    log = Log(args["log"], role)
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a role that does not stop shows where it is

    def note_loss(event: observe.Event) -> None:  # why a hold or a leadership ended before its release
        if event.kind in (observe.LOST, observe.DEPOSED):
            log("lost", kind=event.kind, cause=event.cause, token=event.token)

    observe.subscribe(note_loss)
    log("start", url=args["url"])
    try:
        ROLES[role](args, log)
    except BaseException as exc:
        log("crash", error=repr(exc)[:500])
        raise
    log("stop")


if __name__ == "__main__":
    main()
