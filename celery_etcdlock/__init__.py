"""Cluster-wide locks for Celery on etcd: singleton tasks, read-write locked tasks,
and celery beat on many hosts with exactly one leader sending.

    from celery_etcdlock import connect, Mutex

    client = connect("etcd://127.0.0.1:2379")
    with Mutex(client, "reports/daily", ttl=10) as lock:
        print("holding", lock.token)
"""

from .client import Client
from .connect import connect
from .election import Election, LeaderEvent
from .errors import (
    AuthenticationFailed,
    BackendError,
    BackendUnavailable,
    EtcdLockError,
    InvalidUse,
    LockLost,
    NotHeld,
    TaskLocked,
    UnsupportedServer,
)
from .mutex import Mutex
from .rwlock import RWLock
from .tasks import RWLockTask, SingletonTask, rwlock_task, singleton_task

__version__ = "0.1.0"

__all__ = [
    "AuthenticationFailed",
    "BackendError",
    "BackendUnavailable",
    "Client",
    "Election",
    "LeaderEvent",
    "Mutex",
    "RWLock",
    "RWLockTask",
    "SingletonTask",
    "EtcdLockError",
    "InvalidUse",
    "LockLost",
    "NotHeld",
    "TaskLocked",
    "UnsupportedServer",
    "connect",
    "rwlock_task",
    "singleton_task",
    "__version__",
]
