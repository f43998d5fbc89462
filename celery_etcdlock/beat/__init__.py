"""Leader-only celery beat: every beat campaigns, only the leader sends.

celery -A proj beat -S celery_etcdlock.beat:LeaderScheduler
"""

from ..tasks import worker  # noqa: F401  (the package's beat and worker hooks, also for every `celery` command)
from .entries import LeaderSchedulerEntry
from .scheduler import STATE_KIND, LeaderScheduler, beat_name

__all__ = ["STATE_KIND", "LeaderScheduler", "LeaderSchedulerEntry", "beat_name"]
