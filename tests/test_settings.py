"""The etcdlock_* settings: masked in Celery's dumps, checked at a worker's and a beat's start."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import celery
import pytest

from tests.procs import Proc
from tests.support import free_port, wait_until

LEADER = "celery_etcdlock.beat:LeaderScheduler"

MASKED = """
import sys
{imports}
app = Celery("masked", set_as_current=False)
app.conf.etcdlock_url = "etcd3://app:s3cret@etcd-1:2379"
shown = app.bugreport() + app.conf.humanize(censored=True) + app.conf.humanize(with_defaults=False, censored=True)
assert "s3cret" not in shown, shown
assert "etcd3://app:***@etcd-1:2379" in shown, shown
assert "celery_etcdlock.settings" not in sys.modules, "the test must not lean on settings.py"
print("OK")
"""


@pytest.mark.parametrize(
    "imports",
    ["import celery_etcdlock\nfrom celery import Celery", "from celery import Celery\nimport celery_etcdlock"],
    ids=["package-first", "celery-first"],
)
def test_importing_the_package_masks_the_etcd_password_in_celery_dumps(imports: str) -> None:
    """Issue 24.11: app.bugreport() and humanize(censored=True) showed the password unless settings.py was imported."""
    done = subprocess.run(
        [sys.executable, "-c", MASKED.format(imports=imports)], capture_output=True, text=True, timeout=60
    )
    assert done.stdout.strip() == "OK", done.stdout + done.stderr


# -- the check at a worker's and a beat's start (issue 24.13) ------------------------------------------

APP = """
import celery
from celery_etcdlock import singleton_task

app = celery.Celery("startcheck", broker={broker!r}, backend={backend!r})
app.conf.update(broker_connection_retry_on_startup=True, worker_hijack_root_logger=True, **{settings!r})

@singleton_task(app=app)
def locked():
    return "locked"

@app.task
def plain():
    return "plain"
"""


def _app(tmp_path: Path, settings: dict[str, Any], broker: str = "memory://", backend: str | None = None) -> Path:
    (tmp_path / "startcheck.py").write_text(APP.format(broker=broker, backend=backend, settings=settings))
    return tmp_path


def _start(tmp_path: Path, *args: str) -> Proc:
    return Proc.module("celery", "-A", "startcheck", *args, cwd=tmp_path, name=args[0])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("role", "settings", "named"),
    [
        ("worker", {"etcdlock_url": "memory://", "etcdlock_ttl": "30"}, "etcdlock_ttl must be a number of seconds"),
        ("worker", {"etcdlock_url": "memory://", "etcdlock_tll": 30}, "etcdlock_tll .*did you mean etcdlock_ttl"),
        ("worker", {"etcdlock_url": "etcd3://127.0.0.1:notaport"}, "etcdlock_url: .*notaport"),
        ("beat", {"etcdlock_url": "memory://", "etcdlock_beat_ttl": -1}, "etcdlock_beat_ttl must be a positive"),
    ],
    ids=["wrong-type", "misspelt", "bad-url", "beat"],
)
def test_bad_settings_stop_a_worker_or_beat_at_its_start(
    tmp_path: Path, role: str, settings: dict[str, Any], named: str
) -> None:
    """etcdlock_ttl="30" let a worker say ready while every locked task failed; etcdlock_tll was ignored."""
    args = ["worker", "-P", "solo", "-l", "INFO"] if role == "worker" else ["beat", "-S", LEADER, "-l", "INFO"]
    proc = _start(_app(tmp_path, settings), *args)
    try:
        line = proc.expect(rf"celery_etcdlock: the {role} does not start: ", timeout=60).string
        assert re.search(named, line), line
        assert proc.wait(timeout=60) == 78, proc.output
        assert "Traceback" not in proc.output, proc.output
        assert "ready." not in proc.output, proc.output
    finally:
        proc.kill()


def test_a_worker_warns_of_unknown_and_replaced_settings_and_of_an_unreachable_etcd(
    tmp_path: Path, redis_url: str
) -> None:
    """Warnings, not a refusal: and with etcd down, one line, and the worker still serves its other tasks."""
    settings = {
        "etcdlock_url": f"etcd3://127.0.0.1:{free_port()}",
        "etcdlock_from_a_newer_version": 1,
        "singleton_backend_url": "redis://old",
        "redbeat_lock_timeout": 60,
    }
    proc = _start(_app(tmp_path, settings, broker=redis_url, backend=redis_url), "worker", "-P", "solo", "-l", "INFO")
    try:
        proc.expect("ready", timeout=60)
        wait_until(lambda: "etcd is unreachable at this worker's start" in proc.output, 30, "the unreachable line")
        local = celery.Celery("startcheck", broker=redis_url, backend=redis_url, set_as_current=False)
        try:
            assert local.send_task("startcheck.plain").get(timeout=30) == "plain"
        finally:
            local.close()
        output = proc.output
        assert output.count("etcd is unreachable") == 1, output
        assert "etcdlock_from_a_newer_version is not a setting of this version of celery_etcdlock" in output, output
        assert "singleton_backend_url is a setting of another library, not of celery_etcdlock: use etcdlock_url" in (
            output
        )
        assert "redbeat_lock_timeout is a setting of another library" in output and "etcdlock_beat_ttl" in output
        assert "Traceback" not in output, output
    finally:
        proc.kill()
