"""A real redis-server on a free loopback port: no persistence, its own temp dir.

redis = RedisServer().start()
redis.url(db=1)                  # "redis://127.0.0.1:40125/1"
redis.client().flushall()        # a redis-py client to it (db 0)
"""

from __future__ import annotations

import os
import shutil

import redis

from tests.support.ports import HOST, free_port
from tests.support.process import ServerError, ServerProcess


class RedisServer(ServerProcess):
    """A real redis-server; ``client()`` talks to it through redis-py."""

    kind = "redis-server"
    log_name = "redis.log"

    def __init__(self) -> None:
        self.binary = os.environ.get("ETCDLOCK_REDIS_SERVER", "/usr/bin/redis-server")
        if not os.access(self.binary, os.X_OK):
            found = shutil.which("redis-server")
            if not found:
                raise ServerError("redis-server not found: install Debian's redis-server (scripts/test does)")
            self.binary = found
        super().__init__("etcdlock-redis-")
        self.port = 0
        self._client: redis.Redis | None = None

    @property
    def endpoint(self) -> str:
        return f"{HOST}:{self.port}"

    def url(self, db: int = 0) -> str:
        return f"redis://{self.endpoint}/{db}"

    def client(self) -> redis.Redis:
        """A redis-py client to db 0 of this server (one, kept until ``close()``)."""
        if self._client is None:
            self._client = redis.Redis(host=HOST, port=self.port, socket_timeout=5, socket_connect_timeout=2)
        return self._client

    # -- the process

    def ports(self) -> list[int]:
        return [self.port]

    def choose_ports(self) -> None:
        self.port = free_port()

    def argv(self) -> list[str]:
        return [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            HOST,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.dir),
            "--logfile",
            "",
            "--loglevel",
            "warning",
            "--daemonize",
            "no",
        ]

    def ready(self) -> bool:
        self.check_alive()
        try:
            return bool(self.client().ping())
        except (redis.ConnectionError, redis.TimeoutError):
            return False

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        super().close()

    def __repr__(self) -> str:
        return f"<RedisServer {self.endpoint}>"
