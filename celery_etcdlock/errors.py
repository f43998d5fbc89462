"""Every error this package raises derives from :class:`EtcdLockError`.

Bad arguments raise the built-in ``ValueError`` or ``TypeError`` instead,
naming the argument, as Python code usually does.
"""

from __future__ import annotations


class EtcdLockError(Exception):
    """Base class of every error raised by celery_etcdlock."""


class BackendError(EtcdLockError):
    """etcd answered, but not in a way we can work with."""


class BackendUnavailable(BackendError):
    """etcd could not be reached: the retry policy gave up.

    ``endpoints`` names what was tried; ``__cause__`` is the last failure.
    """

    def __init__(self, message: str, endpoints: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.endpoints = endpoints


class UnsupportedServer(BackendError):
    """The server does not speak the API the URL's scheme asks for."""


class AuthenticationFailed(BackendError):
    """etcd refused the credentials, or the user lacks permission."""


class LockLost(EtcdLockError):
    """A lock was lost while it was held.

    ``cause`` says why: ``"deleted"`` (its key was deleted: force-released, or by another
    client), ``"late"`` (no renewal succeeded in time: etcd unreachable, or the process was
    paused), ``"revoked"`` (its lease was revoked or expired on the server), ``"closed"``
    (its client was closed); None when unknown.
    """

    def __init__(self, message: str, lock_name: str = "", cause: str | None = None) -> None:
        super().__init__(message)
        self.lock_name = lock_name
        self.cause = cause


class NotHeld(EtcdLockError):
    """release() of a lock this object does not hold."""


class LimitMismatch(EtcdLockError, ValueError):
    """A semaphore was asked for with another limit than its current participants have (names both)."""

    def __init__(self, message: str, lock_name: str = "", limit: int = 0, asked: int = 0) -> None:
        super().__init__(message)
        self.lock_name = lock_name
        self.limit = limit
        self.asked = asked


class InvalidUse(EtcdLockError, RuntimeError):
    """An object used out of turn: ``acquire()`` on a lock object that is held or busy, ``start()`` twice."""


class UnsupportedPool(EtcdLockError, RuntimeError):
    """The process runs under a concurrency library whose pool cannot keep locks alive (eventlet)."""


class TaskLocked(EtcdLockError):
    """A singleton task found its lock taken and ``on_conflict="raise"``."""

    def __init__(self, message: str, lock_name: str = "", holder: object = None) -> None:
        super().__init__(message)
        self.lock_name = lock_name
        self.holder = holder
