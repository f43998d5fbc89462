"""docker-compose.yml, read since Docker does not run here: does every service name real things?

Each Celery command is parsed by Celery's own command line (the ``celery`` click group with
the app loaded, then the sub-command's options converted), so an unknown option, a bad value,
a missing app or a scheduler path that does not resolve fails here. The etcd members must form
one cluster, the URLs must point at the services that exist, and the Dockerfile must copy
files that exist. The demo's generated Procfile is checked the same way.
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import click
import pytest
import yaml
from celery.app.utils import find_app
from celery.beat import Scheduler
from celery.bin.base import CLIContext
from celery.bin.celery import celery as celery_group
from celery.concurrency import get_implementation
from celery.utils.imports import symbol_by_name

from celery_etcdlock.beat import LeaderScheduler
from celery_etcdlock.connect import parse_url

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
COMPOSE = REPO / "docker-compose.yml"
WORKERS = ["worker-1", "worker-2", "worker-3"]
BEATS = ["beat-1", "beat-2"]
ETCDS = ["etcd-1", "etcd-2", "etcd-3"]


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    compose = yaml.safe_load(COMPOSE.read_text())
    return compose["services"]


def parse_celery(argv: list[str], env: dict[str, str] | None = None) -> tuple[str, dict[str, Any], Any, dict[str, Any]]:
    """Parse ``celery ...`` as the celery program would, with ``env`` as the environment.

    Returns the sub-command, its options, the app, and the app's configuration as ``env`` made it.
    """
    assert argv[0] == "celery" or argv[1:3] == ["-m", "celery"], argv
    args = argv[1:] if argv[0] == "celery" else argv[3:]
    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        ctx = celery_group.make_context("celery", list(args))
        app_name = ctx.params["app"]
        assert app_name, f"{argv}: no -A/--app"
        config = importlib.import_module("examples.shop.celeryconfig")
        importlib.reload(config)  # read the service's environment
        app = find_app(app_name)
        app.config_from_object(config, force=True)
        ctx.obj = CLIContext(app=app, no_color=True, workdir=None, quiet=True)
        rest = [*(getattr(ctx, "_protected_args", None) or ctx.protected_args), *ctx.args]
        name, command, sub_args = celery_group.resolve_command(ctx, rest)
        assert command is not None, f"{argv}: no such celery command"
        sub = command.make_context(name, sub_args, parent=ctx)
        assert not sub.args, f"{argv}: arguments celery would not take: {sub.args}"
        _load_tasks(app)
        return str(name), sub.params, app, dict(app.conf)
    except click.UsageError as exc:
        raise AssertionError(f"{shlex.join(argv)}: {exc.format_message()}") from None
    finally:
        os.environ.clear()
        os.environ.update(saved)
        config = importlib.reload(importlib.import_module("examples.shop.celeryconfig"))
        find_app("examples.shop").config_from_object(config, force=True)  # leave the shop as it was


def command_of(service: dict[str, Any]) -> list[str]:
    command = service["command"]
    return shlex.split(command) if isinstance(command, str) else [str(a) for a in command]


def flags(argv: list[str]) -> dict[str, str]:
    return dict(a.removeprefix("--").split("=", 1) for a in argv if a.startswith("--") and "=" in a)


def test_the_stack_has_three_etcd_members_redis_three_workers_and_two_beats(services: dict[str, Any]):
    assert set(ETCDS + ["redis"] + WORKERS + BEATS) <= set(services)
    for name, service in services.items():
        for needed in service.get("depends_on", {}):
            assert needed in services, f"{name} depends on unknown service {needed}"
        for mapping in service.get("ports", []):
            assert str(mapping).startswith("127.0.0.1:"), f"{name} publishes {mapping} beyond loopback"


def test_the_etcd_members_form_one_cluster_that_serves_the_configured_api(services: dict[str, Any]):
    shop_url = parse_url(services["worker-1"]["environment"]["ETCDLOCK_URL"])
    clusters, tokens = set(), set()
    for name in ETCDS:
        service = services[name]
        image = service["image"]
        assert image.startswith("quay.io/coreos/etcd:v3.5."), image  # 3.6 has no v2 API at all
        argv = command_of(service)
        assert argv[0].endswith("etcd")
        options = flags(argv)
        assert options["name"] == name
        assert options["advertise-client-urls"] == f"http://{name}:2379"
        assert options["initial-advertise-peer-urls"] == f"http://{name}:2380"
        assert options["listen-client-urls"].endswith(":2379")
        assert options["listen-peer-urls"].endswith(":2380")
        clusters.add(options["initial-cluster"])
        tokens.add(options["initial-cluster-token"])
        if shop_url.api == "v2":
            assert options.get("enable-v2") == "true", f"{name}: etcd:// needs --enable-v2=true"
        assert service.get("healthcheck"), f"{name} has no healthcheck for depends_on to wait on"
    assert clusters == {",".join(f"{m}=http://{m}:2380" for m in ETCDS)}
    assert len(tokens) == 1


def test_workers_and_beats_are_built_from_the_example_and_point_at_the_stack(services: dict[str, Any]):
    for name in WORKERS + BEATS:
        service = services[name]
        dockerfile = REPO / service["build"]["context"] / service["build"]["dockerfile"]
        assert dockerfile.is_file(), dockerfile
        env = service["environment"]
        options = parse_url(env["ETCDLOCK_URL"])
        assert sorted(options.endpoints) == [(m, 2379) for m in ETCDS], f"{name}: {env['ETCDLOCK_URL']}"
        broker = env["SHOP_BROKER_URL"]
        assert broker.startswith("redis://redis:6379/"), broker
        for needed in ETCDS + ["redis"]:
            assert needed in service["depends_on"], f"{name} does not wait for {needed}"


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (REPO / "examples" / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
    return [(word.upper(), rest) for word, rest in (line.split(None, 1) for line in lines)]


def test_the_dockerfile_installs_the_package_with_the_redis_extra_and_copies_files_that_exist():
    instructions = dockerfile_instructions()
    copies = [rest.split() for word, rest in instructions if word == "COPY"]
    assert copies
    for *sources, _destination in copies:
        found = [path for source in sources for path in glob.glob(str(REPO / source))]
        assert found, f"COPY {sources}: nothing in the repository matches"
    installs = [shlex.split(rest) for word, rest in instructions if word == "RUN" and "pip install" in rest]
    assert [argv[argv.index("install") + 1 :] for argv in installs] == [[".[redis]"]], installs
    # Building the package reads pyproject.toml and the files it names: all must be in the image.
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    copied = {source.rstrip("*") for *sources, _ in copies for source in sources}
    assert {"celery_etcdlock", "examples", "pyproject.toml", project["readme"], *project["license-files"]} <= copied


def test_the_dockerfile_starts_from_a_pinned_python():
    (base,) = [rest for word, rest in dockerfile_instructions() if word == "FROM"]
    assert re.fullmatch(r"python:3\.\d+\.\d+-slim-\w+", base), f"FROM {base}: pin a patch version and a Debian release"


@pytest.mark.parametrize("name", WORKERS)
def test_every_worker_command_is_a_real_prefork_worker_of_the_shop(services: dict[str, Any], name: str):
    service = services[name]
    command, params, app, conf = parse_celery(command_of(service), service["environment"])
    assert command == "worker"
    assert app.main == "shop"
    assert params["pool"] is get_implementation("prefork")
    assert params["hostname"].startswith(f"{name}@")  # one node name per worker (%h expanded)
    assert conf["etcdlock_url"] == service["environment"]["ETCDLOCK_URL"]
    assert conf["broker_url"] == service["environment"]["SHOP_BROKER_URL"]
    assert {"shop.sync_customer", "shop.search", "shop.rebuild_search_index", "shop.nightly_report"} <= set(app.tasks)


@pytest.mark.parametrize("name", BEATS)
def test_every_beat_command_runs_the_leader_scheduler(services: dict[str, Any], name: str):
    service = services[name]
    command, params, app, conf = parse_celery(command_of(service), service["environment"])
    assert command == "beat"
    scheduler = symbol_by_name(params["scheduler"])
    assert scheduler is LeaderScheduler
    assert issubclass(scheduler, Scheduler)
    assert conf["etcdlock_beat_ttl"] == float(service["environment"]["ETCDLOCK_BEAT_TTL"])
    assert conf["beat_scheduler"] == params["scheduler"]  # the same, whether given or not
    tasks = {entry["task"] for entry in conf["beat_schedule"].values()}
    assert tasks <= set(app.tasks), tasks - set(app.tasks)  # every scheduled task exists


def test_the_monitor_runs_a_module_of_ours(services: dict[str, Any]):
    argv = command_of(services["monitor"])
    assert argv[:2] == ["python", "-m"]
    assert importlib.util.find_spec(argv[2]) is not None, argv[2]
    assert services["monitor"].get("profiles"), "the monitor must not start with `docker compose up`"


def test_the_documented_cli_commands_exist(services: dict[str, Any]):
    """The commands the compose file's header tells users to run."""
    lines = [line for line in COMPOSE.read_text().splitlines() if "celery -A" in line and line.startswith("#")]
    assert lines
    for line in lines:
        argv = shlex.split(line[line.index("celery -A") :])
        command, _params, _app, _conf = parse_celery(argv, services["worker-1"]["environment"])
        assert command == "etcdlock"


def test_the_demo_procfile_runs_the_same_commands(tmp_path: Path):
    from examples.demo.stack import LocalStack

    stack = LocalStack(tmp_path, workers=3, beats=2, etcd_members=3)
    entries = dict(line.split(": ", 1) for line in stack.procfile_text().splitlines())
    assert sorted(entries) == sorted(["redis", *ETCDS, *WORKERS, *BEATS])
    for name in WORKERS + BEATS:
        loop = entries[name]
        assert loop.startswith(f"while :; do SHOP_NODE={name} ") and loop.endswith("; sleep 1; done")
        argv = shlex.split(loop.removeprefix(f"while :; do SHOP_NODE={name} ").removesuffix("; sleep 1; done"))
        command, params, _app, conf = parse_celery(["celery", *argv[3:]], stack.env)
        assert conf["etcdlock_url"] == stack.env["ETCDLOCK_URL"]
        assert command == ("worker" if name in WORKERS else "beat")
        if command == "beat":
            assert symbol_by_name(params["scheduler"]) is LeaderScheduler


def _load_tasks(app: Any) -> Any:
    app.loader.import_default_modules()
    return app.tasks
