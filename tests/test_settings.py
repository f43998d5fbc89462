"""The etcdlock_* settings: masked in Celery's dumps, checked at a worker's and a beat's start."""

from __future__ import annotations

import subprocess
import sys

import pytest

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
