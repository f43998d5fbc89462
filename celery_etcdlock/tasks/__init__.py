"""The Celery task layer: locked task classes, their decorators, options and dedupe.

from celery_etcdlock.tasks import SingletonTask, singleton_task

Importing it connects the package's worker and beat hooks (``worker.py``).
"""

from . import worker  # noqa: F401  (the hooks; they need the task classes)
from .task import LimitedTask, RWLockTask, SingletonTask, limited_task, rwlock_task, singleton_task

__all__ = ["LimitedTask", "RWLockTask", "SingletonTask", "limited_task", "rwlock_task", "singleton_task"]
