"""Cluster-wide locks for Celery on etcd: singleton tasks, read-write locked tasks,
and celery beat on many hosts with exactly one leader sending.

    from celery_etcdlock import connect, Mutex

    client = connect("etcd3://127.0.0.1:2379")
    with Mutex(client, "reports/daily", ttl=10) as lock:
        print("holding", lock.token)

The primitives (``connect``, ``Mutex``, ``RWLock``, ``Election`` and the
errors) never import Celery; the task decorators and classes load it when
first used.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

from . import _moved, logs, masking
from .errors import (
    AuthenticationFailed,
    BackendError,
    BackendUnavailable,
    EtcdLockError,
    InvalidUse,
    LimitMismatch,
    LockLost,
    NotHeld,
    TaskLocked,
    UnsupportedPool,
    UnsupportedServer,
)
from .locks.client import Client
from .locks.connect import connect
from .locks.election import Election, LeaderEvent
from .locks.mutex import Mutex
from .locks.queue import Holder
from .locks.rwlock import ReadLock, RWLock, WriteLock
from .locks.semaphore import Semaphore

if TYPE_CHECKING:
    from .tasks import LimitedTask, RWLockTask, SingletonTask, limited_task, rwlock_task, singleton_task

__version__ = "0.2.0"

_moved.install()

# A library logs; the application decides where it goes (Celery's workers and beat configure the root logger).
logging.getLogger(__name__).addHandler(logging.NullHandler())
logs.install()  # and no line of ours grows with the user's data (a lock named after a huge argument)

# etcdlock_url's password stays out of app.bugreport() and conf.humanize(censored=True) (without importing Celery)
masking.install()

#: names of the Celery layer, imported on first use so that the primitives work without Celery
_CELERY_LAYER = {
    "LimitedTask": "tasks",
    "limited_task": "tasks",
    "RWLockTask": "tasks",
    "SingletonTask": "tasks",
    "rwlock_task": "tasks",
    "singleton_task": "tasks",
}


def __getattr__(name: str) -> Any:
    module = _CELERY_LAYER.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "AuthenticationFailed",
    "BackendError",
    "BackendUnavailable",
    "Client",
    "Election",
    "Holder",
    "LeaderEvent",
    "LimitedTask",
    "Mutex",
    "RWLock",
    "ReadLock",
    "RWLockTask",
    "Semaphore",
    "SingletonTask",
    "EtcdLockError",
    "InvalidUse",
    "LimitMismatch",
    "LockLost",
    "NotHeld",
    "TaskLocked",
    "UnsupportedPool",
    "UnsupportedServer",
    "WriteLock",
    "connect",
    "limited_task",
    "rwlock_task",
    "singleton_task",
    "__version__",
]
