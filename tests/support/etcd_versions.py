"""Which etcd the tests run: the releases scripts/etcd-build made, and the test kinds over them.

    etcd_path("3.7")          # <cache>/v3.7.3/etcd, the newest 3.7 built (ServerError if none)
    etcdctl_path("3.5")       # its etcdctl
    KINDS["v3-3.6"]           # EtcdKind(api="v3", version="3.6", enable_v2=False)
    selected_kinds(every=True)  # the kinds a test marked ``every_etcd`` runs on

The kinds: ``v2-3.4`` (Debian's etcd with --enable-v2), ``v2-3.5`` (3.5 with --enable-v2, the
last release line with v2), ``v3-3.5``, ``v3-3.6``, ``v3-3.7``. A test marked ``every_etcd``
runs on each; every other test runs on its API's ``DEFAULT_KIND``.

``ETCDLOCK_TEST_ETCD=3.4,3.7`` (versions or kind names, a comma list) narrows both: the fast lane.
The builds live in ``$ETCDLOCK_ETCD_CACHE`` (default ``.etcd/`` in the repo), one folder a release
(``v3.6.16/etcd``, ``v3.6.16/etcdctl``). Without a build, its kinds skip with one line saying what
to install, except under CI=true, where that is a failure.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.process import ServerError

REPO = Path(__file__).resolve().parents[2]
#: the release lines scripts/etcd-build builds (3.4 is Debian's etcd-server)
BUILT_LINES = ("3.5", "3.6", "3.7")
DEBIAN_ETCD = "/usr/bin/etcd"
DEBIAN_ETCDCTL = "/usr/bin/etcdctl"


@dataclass(frozen=True)
class EtcdKind:
    """One server a test can run on: an API of one etcd release line."""

    name: str
    api: str
    version: str
    enable_v2: bool

    @property
    def scheme(self) -> str:
        return "etcd" if self.api == "v2" else "etcd3"


KINDS = {
    kind.name: kind
    for kind in (
        EtcdKind("v2-3.4", "v2", "3.4", True),
        EtcdKind("v2-3.5", "v2", "3.5", True),
        EtcdKind("v3-3.5", "v3", "3.5", False),
        EtcdKind("v3-3.6", "v3", "3.6", False),
        EtcdKind("v3-3.7", "v3", "3.7", False),
    )
}
#: what a test not marked ``every_etcd`` runs on: v2 on Debian's 3.4 (no build needed), v3 on
#: the newest release.
DEFAULT_KIND = {"v2": KINDS["v2-3.4"], "v3": KINDS["v3-3.7"]}


def cache_dir() -> Path:
    return Path(os.environ.get("ETCDLOCK_ETCD_CACHE") or REPO / ".etcd")


def _release(path: Path) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", path.name))


def build_dir(line: str) -> Path:
    """The folder of the newest build of release line ``line`` ("3.6"); ServerError if none."""
    builds = [
        d
        for d in cache_dir().glob(f"v{line}.*")
        if re.fullmatch(rf"v{re.escape(line)}\.\d+", d.name) and (d / "etcd").is_file() and (d / "etcdctl").is_file()
    ]
    if not builds:
        raise ServerError(f"etcd {line} is not built in {cache_dir()}: run scripts/etcd-build (needs Go 1.26 or newer)")
    return max(builds, key=_release)


def etcd_path(line: str) -> str:
    """The etcd executable of release line ``line``: Debian's for "3.4", else the newest build."""
    if line == "3.4":
        return os.environ.get("ETCDLOCK_ETCD34", DEBIAN_ETCD)
    if line not in BUILT_LINES:
        raise ValueError(f"etcd version must be 3.4 or one of {', '.join(BUILT_LINES)}, not {line!r}")
    return str(build_dir(line) / "etcd")


def etcdctl_path(line: str) -> str:
    """The etcdctl of release line ``line`` (Debian's etcd-client for "3.4")."""
    if line == "3.4":
        return DEBIAN_ETCDCTL
    return str(build_dir(line) / "etcdctl")


def missing(line: str) -> str | None:
    """Why release line ``line`` cannot run here (one line), or None."""
    try:
        path = etcd_path(line)
    except ServerError as exc:
        return str(exc)
    if not os.access(path, os.X_OK):
        return f"etcd {line} not found at {path}: install Debian's etcd-server (scripts/setup-system does)"
    return None


def _selection() -> list[str]:
    return [w.strip() for w in os.environ.get("ETCDLOCK_TEST_ETCD", "").split(",") if w.strip()]


def check_selection() -> None:
    """ETCDLOCK_TEST_ETCD names only known versions or kinds (ValueError naming the unknown)."""
    known = set(KINDS) | {k.version for k in KINDS.values()}
    unknown = [w for w in _selection() if w not in known]
    if unknown:
        raise ValueError(f"ETCDLOCK_TEST_ETCD: unknown {unknown}; known: {', '.join(sorted(known))}")


def wanted(kind: EtcdKind) -> bool:
    """ETCDLOCK_TEST_ETCD lets ``kind`` run (unset: every kind)."""
    return version_wanted(kind.api, kind.version)


def version_wanted(api: str, version: str) -> bool:
    """ETCDLOCK_TEST_ETCD lets ``api`` of etcd ``version`` run (a cluster's v3 on 3.4, too)."""
    chosen = _selection()
    return not chosen or version in chosen or f"{api}-{version}" in chosen


def require(version: str) -> None:
    """Skip the running test when etcd ``version`` is not here (one line naming what to install);
    under CI=true fail instead: CI never skips a version."""
    reason = missing(version)
    if reason:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI needs etcd {version}: {reason}", pytrace=False)
        pytest.skip(reason)


def selected_kinds(apis: list[str], every: bool) -> list[EtcdKind]:
    """The kinds a test runs on: each kind of ``apis`` if ``every``, else each API's default kind.

    ETCDLOCK_TEST_ETCD narrows both: a default it leaves out gives way to the newest kind of that
    API it names, and an API none of whose kinds it names is left out.
    """
    if every:
        return [k for k in KINDS.values() if k.api in apis and wanted(k)]
    kinds = []
    for api in apis:
        # the default kind, or where the selection leaves it out, the newest one it names
        chosen = [k for k in KINDS.values() if k.api == api and wanted(k)]
        if chosen:
            kinds.append(DEFAULT_KIND[api] if DEFAULT_KIND[api] in chosen else chosen[-1])
    return kinds
