"""The Celery task layer: locked task classes, their decorators, options and dedupe.

    from celery_etcdlock.tasks import SingletonTask, singleton_task

- ``task.py``: the run life cycle of a locked task (``LimitedTask``, ``SingletonTask``, ``RWLockTask``);
- ``conflict.py``: what a run does when its lock is taken (``on_conflict``'s policies);
- ``options.py``: the one list of lock options (``LockOptions``), and the lock name of a call;
- ``decorators.py``: ``singleton_task``, ``limited_task``, ``rwlock_task``;
- ``dedupe.py``: enqueue-time deduplication;
- ``worker.py``: every Celery signal hook of the package (importing this package connects them).
"""

from . import worker  # noqa: F401  (the hooks; they need the task classes)
from .decorators import limited_task, rwlock_task, singleton_task
from .task import LimitedTask, RWLockTask, SingletonTask

__all__ = ["LimitedTask", "RWLockTask", "SingletonTask", "limited_task", "rwlock_task", "singleton_task"]
