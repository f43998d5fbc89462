"""Leader-only celery beat: every beat campaigns, only the leader sends.

celery -A proj beat -S celery_etcdlock.beat:LeaderScheduler          # the schedule in beat_schedule
celery -A proj beat -S celery_etcdlock.beat:LeaderDatabaseScheduler  # django-celery-beat's, [django] extra
LeaderPersistent = leader_only(celery.beat.PersistentScheduler)      # any other scheduler

scheduler.py  LeaderScheduler         leader.py  LeaderMixin, leader_only
runs.py       the fenced run records  stores.py  hooks for the stores of wrapped schedulers
entries.py    LeaderSchedulerEntry    runtime.py the leader's runtime entries
django.py     LeaderDatabaseScheduler (imported on first use: it needs Django)
"""

from typing import Any

from ..tasks import worker  # noqa: F401  (the package's beat and worker hooks, also for every `celery` command)
from .entries import LeaderSchedulerEntry
from .leader import LeaderMixin, leader_only
from .scheduler import STATE_KIND, LeaderScheduler, beat_name


def __getattr__(name: str) -> Any:
    # django-celery-beat needs Django set up: import it only when asked for
    if name == "LeaderDatabaseScheduler":
        from .django import LeaderDatabaseScheduler

        return LeaderDatabaseScheduler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["STATE_KIND", "LeaderMixin", "LeaderScheduler", "LeaderSchedulerEntry", "beat_name", "leader_only"]
