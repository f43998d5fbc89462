"""``scripts/demo --quick --etcd-members 3``: the demo on a 3-member etcd cluster whose raft leader it kills.

On top of what tests/test_demo.py checks of the default demo (a beat fail-over, a lock
recovery, zero doubles, no process left), the summary must show the etcd member killed,
another member leading, and the lock service going on meanwhile: task runs started and
beat runs sent after the kill, still with zero doubles.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_demo import TASKS, demo_processes, start_demo

pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.timeout(300)]


def test_quick_demo_on_three_etcd_members_keeps_going_when_the_raft_leader_is_killed(tmp_path: Path) -> None:
    before = demo_processes()
    summary_file = tmp_path / "summary.json"
    with start_demo("--quick", "--etcd-members", "3", "--summary-json", str(summary_file)) as demo:
        demo.expect("stack ready", timeout=150)
        demo.expect(r"KILL -9 etcd-\d \(the raft leader of the 3 etcd members", timeout=90)
        demo.expect(r"ETCD: etcd-\d leads the 2 members left", timeout=30)
        demo.expect(r"^SUMMARY  done", timeout=120)
        demo.expect_exit(0, timeout=60)
        output = demo.output
    assert demo_processes() - before == set(), "the demo left processes behind"

    summary = json.loads(summary_file.read_text())
    assert summary["ok"] is True
    assert summary["doubles"] == 0, summary["doubles_detail"]
    assert set(summary["tasks"]) == TASKS
    killed = summary["etcd_kill"]
    assert killed["new_leader"] != killed["member"]
    assert killed["runs_after"] > 0 and killed["sends_after"] > 0, killed
    assert f"  etcd member killed: {killed['member']} (the raft leader) -> {killed['new_leader']} led" in output
    assert "lock service kept going" in output
    assert summary["failover"]["token_after"] > summary["failover"]["token_before"]
