"""``Client``: what ``connect()`` returns; a backend plus this process's sessions.

Pass one client to every primitive. It is thread-safe, cheap to share, and
survives ``fork()``: a child process drops the parent's connections and
sessions and builds its own on first use.
"""

from __future__ import annotations

import os
import threading
import weakref

from ..etcd.base import Backend
from ..options import ConnectionOptions
from .session import Session


class Client:
    """A connection to etcd (or ``memory://``) and this process's sessions: what ``connect()`` returns.

        client = connect("etcd3://etcd-1:2379,etcd-2:2379?prefix=/myapp")
        with Mutex(client, "reports/daily", ttl=10):
            ...
        client.api, client.prefix             # "v3", "/myapp"
        client.close()                        # releases what this process holds through it

    Share one client between every primitive and thread; it survives ``fork()``
    (a child builds its own connections and sessions on first use).
    """

    def __init__(self, backend: Backend, options: ConnectionOptions) -> None:
        self.backend = backend
        self.options = options
        self._sessions: dict[float, Session] = {}
        self._mutex = threading.Lock()
        _clients.add(self)

    @property
    def prefix(self) -> str:
        return self.options.prefix

    @property
    def api(self) -> str:
        """``"v2"``, ``"v3"`` or ``"memory"``."""
        return self.options.api

    def session(self, ttl: float) -> Session:
        """This process's session for entries of ``ttl`` seconds (one per TTL)."""
        with self._mutex:
            session = self._sessions.get(ttl)
            if session is None:
                session = self._sessions[ttl] = Session(self.backend, ttl, self.options.retry_max_delay)
            return session

    def close(self) -> None:
        """Release every lock this process holds through this client, and the connections."""
        with self._mutex:
            sessions = list(self._sessions.values())
            self._sessions.clear()
        for session in sessions:
            session.close()
        self.backend.close()

    def _after_fork(self) -> None:
        self._mutex = threading.Lock()
        for session in self._sessions.values():
            session.drop_all()
        self._sessions.clear()
        self.backend.after_fork()

    def __repr__(self) -> str:
        return f"<celery_etcdlock.Client {self.options.api} {','.join(self.backend.endpoints)} prefix={self.prefix}>"


def check_client(client: object) -> Client:
    """``client`` if it is a ``Client``; else a ``TypeError`` that says where one comes from."""
    if not isinstance(client, Client):
        raise TypeError(f"client must be a celery_etcdlock Client (from connect()), not {type(client).__name__}")
    return client


_clients: weakref.WeakSet[Client] = weakref.WeakSet()


def _reset_clients_after_fork() -> None:
    for client in list(_clients):
        client._after_fork()


os.register_at_fork(after_in_child=_reset_clients_after_fork)
