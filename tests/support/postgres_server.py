"""A real PostgreSQL server (Debian's postgresql): a fresh cluster by initdb, on a free loopback port.

    pg = PostgresServer().start()
    pg.create_database("shop", template="migrated")     # CREATE DATABASE, optionally from a template
    pg.url("shop")                                       # "postgresql://postgres@127.0.0.1:40125/shop"
    pg.writes_by("beat-1234")                            # INSERT/UPDATE/DELETE statements that client made

The server logs every data-changing statement with the client's application_name
(``log_statement=mod``), so a test can prove who wrote to the database. It runs as
the ``postgres`` user when the tests run as root (PostgreSQL refuses root). fsync is
off: it is a throw-away cluster.
"""

from __future__ import annotations

import glob
import os
import pwd
import re
import shutil
import subprocess
from typing import Any

from tests.support.ports import HOST, free_port
from tests.support.process import ServerError, ServerProcess


def postgres_bindir() -> str:
    """The directory of initdb and postgres: Debian's /usr/lib/postgresql/<version>/bin, else the PATH's."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if found:
        return os.path.dirname(found[-1])
    initdb = shutil.which("initdb")
    if initdb:
        return os.path.dirname(initdb)
    raise ServerError("PostgreSQL's initdb not found: install Debian's postgresql (scripts/setup-system does)")


class PostgresServer(ServerProcess):
    kind = "postgres"
    log_name = "postgres.log"

    def __init__(self, log_statement: str = "mod") -> None:
        self.log_statement = log_statement  # "all" logs reads too (bench/bench_beat.py counts them)
        self.bindir = postgres_bindir()
        super().__init__("etcdlock-postgres-")
        self.port = 0
        self.data = self.dir / "data"
        self.user: str | None = None
        if os.geteuid() == 0:  # initdb and postgres refuse to run as root
            self.user = "postgres"
            entry = pwd.getpwnam(self.user)
            os.chown(self.dir, entry.pw_uid, entry.pw_gid)
        self._initdb()

    def _initdb(self) -> None:
        done = subprocess.run(
            [f"{self.bindir}/initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
             "--no-sync", "--locale=C.UTF-8"],
            capture_output=True, text=True, user=self.user, timeout=120,
        )  # fmt: skip
        if done.returncode != 0:
            raise ServerError(f"initdb failed ({done.returncode}): {done.stderr.strip()[-2000:]}")

    @property
    def endpoint(self) -> str:
        return f"{HOST}:{self.port}"

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@{self.endpoint}/{database}"

    def ports(self) -> list[int]:
        return [self.port]

    def choose_ports(self) -> None:
        self.port = free_port()

    def popen_kwargs(self) -> dict[str, Any]:
        return {"user": self.user} if self.user else {}

    def argv(self) -> list[str]:
        settings = {
            "listen_addresses": HOST,
            "port": str(self.port),
            "unix_socket_directories": str(self.dir),
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            "log_statement": self.log_statement,
            "log_line_prefix": "app=%a ",
            "logging_collector": "off",
            "max_connections": "200",
        }
        return [f"{self.bindir}/postgres", "-D", str(self.data), *[f"-c{k}={v}" for k, v in settings.items()]]

    def ready(self) -> bool:
        self.check_alive()
        try:
            self.sql("SELECT 1")
        except ServerError:
            return False
        return True

    def sql(self, statement: str, database: str = "postgres") -> str:
        """Run one statement with psql as the superuser; its output (unaligned, no headers)."""
        done = subprocess.run(
            ["psql", "-h", HOST, "-p", str(self.port), "-U", "postgres", "-d", database, "-XAtq",
             "-v", "ON_ERROR_STOP=1", "-c", statement],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        if done.returncode != 0:
            raise ServerError(f"psql: {done.stderr.strip()}")
        return done.stdout

    def create_database(self, name: str, template: str | None = None) -> str:
        self.sql(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else ""))
        return self.url(name)

    def writes_by(self, application_name: str) -> list[str]:
        """The data-changing statements a client with that application_name sent, from the server's log."""
        return self.statements_by(application_name)

    def statements_by(self, application_name: str) -> list[str]:
        """The statements the server logged for that application_name (all of them with log_statement="all")."""
        text = self.log_path.read_text(errors="replace")
        pattern = re.compile(rf"^app={re.escape(application_name)} LOG:  statement: (.*)$", re.M)
        return pattern.findall(text)

    def __repr__(self) -> str:
        return f"<PostgresServer {self.endpoint}>"
