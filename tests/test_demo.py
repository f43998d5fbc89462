"""The README's demo command, end to end: ``scripts/demo --quick`` (and Ctrl-C on it).

It runs the real stack (etcd, Redis, 3 prefork workers, 2 beats under honcho), kills the
beat leader and a worker in the middle of a singleton task, and must report zero doubles,
a fail-over, a lock recovery, and no process left behind. ``DEMO_PYTHON`` makes the script
skip its set-up (the machine is set up already) and use this interpreter.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import REPO_ROOT, Proc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DEMO = str(REPO_ROOT / "scripts" / "demo")
MARKER = b"SHOP_DEMO_RUN="
TASKS = {"shop.sync_customer", "shop.search", "shop.rebuild_search_index", "shop.nightly_report"}


def demo_processes() -> set[int]:
    """Every live process started by some demo run (they carry its marker in their environment)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if any(var.startswith(MARKER) for var in environ.split(b"\0")):
                found.add(int(entry.name))
    return found


@pytest.fixture
def no_leftovers() -> Iterator[None]:
    """Fails the test if the demo leaves a process behind (and kills it)."""
    before = demo_processes()
    yield
    left = demo_processes() - before
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"the demo left processes behind: {sorted(left)}"


def start_demo(*args: str) -> Proc:
    return Proc([DEMO, *args], env={"DEMO_PYTHON": sys.executable}, name="scripts/demo")


def test_quick_demo_shows_failover_and_lock_recovery_with_zero_doubles(tmp_path: Path, no_leftovers: None):
    summary_file = tmp_path / "summary.json"
    with start_demo("--quick", "--summary-json", str(summary_file)) as demo:
        demo.expect("stack ready", timeout=150)
        demo.expect(r"KILL -9 beat-\d \(the beat leader", timeout=60)
        demo.expect(r"FAIL-OVER: beat-\d leads", timeout=60)
        demo.expect(r"KILL -9 worker-\d .* in the middle of", timeout=60)
        demo.expect(r"LOCK RECOVERED", timeout=60)
        demo.expect(r"^SUMMARY  done", timeout=120)
        demo.expect_exit(0, timeout=60)
        output = demo.output

    summary = json.loads(summary_file.read_text())
    assert summary["ok"] is True
    assert summary["doubles"] == 0, summary["doubles_detail"]
    assert "  doubles: 0  (overlapping runs 0, tokens out of order 0, beat sends twice 0)" in output
    assert summary["processes_left"] == 0
    assert "  processes left behind: 0" in output
    assert set(summary["tasks"]) == TASKS
    for task, counts in summary["tasks"].items():
        assert counts["runs"] > 0, task
    assert len(set().union(*(c["workers"] for c in summary["tasks"].values()))) == 3  # every worker ran tasks

    failover = summary["failover"]
    assert failover["new_leader"] != failover["killed"]
    assert failover["token_after"] > failover["token_before"]
    assert 0 < failover["seconds"] < 30
    assert set(summary["sends"]) == {"beat-1", "beat-2"}  # both led in turn

    recovery = summary["recovery"]
    assert recovery["token_after"] > recovery["token_before"]
    assert 0 < recovery["seconds"] < 30

    measured = summary["metrics"]  # what the workers' and beats' /metrics endpoints said at the end
    assert measured["scraped"] == ["beat-1", "beat-2", "worker-1", "worker-2", "worker-3"]
    assert measured["acquisitions"]["acquired"] > 0
    assert len(measured["leaders"]) == 1  # exactly one beat says it leads
    assert "  metrics (5 /metrics endpoints): locks acquired " in output


def test_ctrl_c_stops_every_process_cleanly(no_leftovers: None):
    with start_demo("--quick") as demo:
        demo.expect("stack ready", timeout=150)
        code = demo.interrupt(timeout=60)
        output = demo.output
    assert code == 130, output[-3000:]
    assert "SUMMARY  interrupted (Ctrl-C)" in output
    assert "  processes left behind: 0" in output
    assert "Traceback" not in output
