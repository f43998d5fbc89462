"""The Celery task layer: locked task classes, their decorators, options and dedupe.

from celery_etcdlock.tasks import SingletonTask, singleton_task
"""

from .task import LimitedTask, RWLockTask, SingletonTask, limited_task, rwlock_task, singleton_task

__all__ = ["LimitedTask", "RWLockTask", "SingletonTask", "limited_task", "rwlock_task", "singleton_task"]
