"""The package's layers run one way, and this test keeps it so.

Each module of celery_etcdlock belongs to one layer below; a module may import
modules of its own layer or of layers listed before it, never after. The folders
(``etcd/``, ``locks/``, ``tasks/``, ``beat/``) are runs of layers, so a folder
imports only the leaves and the folders below it; and the import graph has no cycle. Only the
Celery layer and above import Celery, and only ``etcd/`` imports an HTTP
or etcd client library. A new module must be given a layer here: the test
fails until it is.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "celery_etcdlock"

LAYERS: list[tuple[str, set[str]]] = [
    ("leaves", {"errors", "options", "keys", "clock", "observe", "_moved", "logs"}),
    ("green", {"green"}),
    (
        "etcd",
        {
            "etcd",
            "etcd.retry",
            "etcd.base",
            "etcd.transport",
            "etcd.endpoints",
            "etcd.native",
            "etcd.gateway",
            "etcd.etcd2",
            "etcd.etcd3",
            "etcd.memory",
        },
    ),  # fmt: skip
    ("locks.session", {"locks", "locks.session"}),
    ("locks.client", {"locks.client", "locks.connect"}),
    ("locks.queue", {"locks.queue"}),
    ("locks.primitives", {"locks.mutex", "locks.rwlock", "locks.semaphore", "locks.election"}),
    ("locks.store", {"locks.store"}),
    ("metrics", {"metrics"}),  # listens to observe; never imported by the primitives
    ("celery", {"masking", "settings", "signals"}),
    (
        "tasks",
        {"tasks", "tasks.options", "tasks.dedupe", "tasks.conflict", "tasks.task", "tasks.decorators", "tasks.worker"},
    ),  # fmt: skip
    (
        "beat",
        {
            "beat",
            "beat.entries",
            "beat.runtime",
            "beat.redbeat",
            "beat.runs",
            "beat.stores",
            "beat.leader",
            "beat.scheduler",
            "beat.django",
        },
    ),
    ("cli", {"cli", "cli_schedule", "testing", "_children"}),  # testing: the pytest plugin, above everything it tests
    ("package", {""}),  # __init__: the public names
]
CELERY_FROM = "celery"  # the first layer that may import Celery (and kombu)
CLIENT_LIBRARIES = {"etcd", "urllib3", "requests", "etcd3gw", "grpc"}  # only etcd/ speaks to etcd


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, module: str) -> tuple[set[str], set[str]]:
    """(modules of ours, top-level third-party packages) that ``path`` imports anywhere in it."""
    ours, theirs = set(), set()
    parts = module.split(".") if module else []
    package_parts = parts if path.name == "__init__.py" else parts[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("celery_etcdlock"):
                    ours.add(alias.name.removeprefix("celery_etcdlock").lstrip("."))
                else:
                    theirs.add(alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[: len(package_parts) - (node.level - 1)] if node.level > 1 else package_parts
                target = ".".join([*base, *(node.module.split(".") if node.module else [])])
                # "from . import retry" imports the module retry; "from .x import y" imports x
                ours.update([f"{target}.{a.name}".lstrip(".") for a in node.names] if not node.module else [target])
            elif node.module and node.module.startswith("celery_etcdlock"):
                ours.add(node.module.removeprefix("celery_etcdlock").lstrip("."))
            elif node.module:
                theirs.add(node.module.split(".")[0])
    return ours, theirs


def _layer_of(module: str) -> int:
    for index, (_, members) in enumerate(LAYERS):
        if module in members:
            return index
    raise AssertionError(f"module {module or '__init__'} has no layer: add it to LAYERS in {__file__}")


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


@pytest.mark.parametrize("module", sorted(MODULES), ids=lambda m: m or "__init__")
def test_imports_run_one_way(module: str) -> None:
    layer = _layer_of(module)
    ours, theirs = _imports(MODULES[module], module)
    for target in ours:
        if target not in MODULES:  # "from .etcd import base" names a module inside a package
            continue
        assert _layer_of(target) <= layer, (
            f"{module} ({LAYERS[layer][0]} layer) imports {target} ({LAYERS[_layer_of(target)][0]} layer, above it)"
        )
    if layer < [name for name, _ in LAYERS].index(CELERY_FROM):
        assert not theirs & {"celery", "kombu", "billiard"}, f"{module} is below the Celery layer but imports Celery"
    if module.split(".")[0] != "etcd":
        assert not theirs & CLIENT_LIBRARIES, f"{module} imports an etcd/HTTP client library outside etcd/"
    if LAYERS[layer][0] == "leaves":
        assert not [t for t in ours if t in MODULES], f"{module} is a leaf but imports {ours}"


FOLDERS = sorted({module.split(".")[0] for module in MODULES if "." in module})


@pytest.mark.parametrize("folder", FOLDERS)
def test_a_folder_is_one_run_of_layers(folder: str) -> None:
    """No module outside the folder sits between two of its layers: the folder is one step of the stack."""
    inside = {_layer_of(m) for m in MODULES if m.split(".")[0] == folder}
    between = sorted(m for m in MODULES if m.split(".")[0] != folder and min(inside) < _layer_of(m) < max(inside))
    assert not between, f"{between} sit between layers of {folder}/: move them, or the folder's modules"


def test_the_modules_sit_in_folders() -> None:
    """The backends, primitives and task classes live in folders; the top holds the leaves and entry points."""
    top = sorted(m for m in MODULES if "." not in m and m not in FOLDERS and m)
    assert top == sorted(["_children", "_moved", "cli", "cli_schedule", "clock", "errors", "green", "keys", "logs",
                          "masking", "metrics", "observe", "options", "settings", "signals",
                          "testing"]), top  # fmt: skip


def test_the_import_graph_has_no_cycle() -> None:
    graph = {m: {t for t in _imports(MODULES[m], m)[0] if t in MODULES and t != m} for m in MODULES}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(module) :], module]))
        if module not in done:
            for target in sorted(graph[module]):
                visit(target, [*path, module])
            done.add(module)

    for module in sorted(graph):
        visit(module, [])


OLD_PATHS = ["celery_etcdlock.session", "celery_etcdlock.mutex", "celery_etcdlock.backends.etcd3",
             "celery_etcdlock.retry", "celery_etcdlock.task_options", "celery_etcdlock.dedupe"]  # fmt: skip


def test_the_old_import_paths_still_work() -> None:
    """0.2's module paths give the moved module itself (one copy of its state), with a DeprecationWarning."""
    code = f"""
import importlib, warnings
from celery_etcdlock._moved import MOVED
for old in {OLD_PATHS!r}:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    new = "celery_etcdlock." + MOVED[old.removeprefix("celery_etcdlock.")]
    assert module is importlib.import_module(new), old
    assert module.__spec__.name == new, (old, module.__spec__.name)
    assert [w for w in caught if w.category is DeprecationWarning and new in str(w.message)], (old, caught)
from celery_etcdlock.backends.etcd3 import Etcd3Backend
from celery_etcdlock.etcd.etcd3 import Etcd3Backend as Same
assert Etcd3Backend is Same
from celery_etcdlock.beat import LeaderScheduler
from celery_etcdlock.tasks import SingletonTask
import celery_etcdlock.testing, celery_etcdlock.metrics, celery_etcdlock.signals
print("OK")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "OK", done.stdout + done.stderr


def test_every_layer_member_exists() -> None:
    missing = sorted(m for _, members in LAYERS for m in members if m not in MODULES)
    assert not missing, f"LAYERS names modules that do not exist: {missing}"


def test_the_primitives_work_without_celery(etcd_url: str) -> None:
    """A process that uses only the primitives never imports Celery, kombu or the other API's client."""
    code = f"""
import sys
from celery_etcdlock import Election, Mutex, RWLock, connect
client = connect({etcd_url!r})
with Mutex(client, "no-celery", ttl=5) as lock:
    assert lock.held
with RWLock(client, "no-celery-rw", ttl=5).read():
    pass
loaded = sorted(m for m in ("celery", "kombu", "billiard") if m in sys.modules)
assert not loaded, loaded
print("OK")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "OK", done.stdout + done.stderr


HOOKS_HOME = "tasks.worker"  # every Celery signal hook of the package, in one place


def _uses_celery_signals(node: ast.AST) -> bool:
    if isinstance(node, ast.ImportFrom):
        names = {a.name for a in node.names}
        return node.module == "celery.signals" or (node.module == "celery" and "signals" in names)
    return isinstance(node, ast.Import) and any(a.name == "celery.signals" for a in node.names)


def test_only_the_hooks_module_uses_celerys_signals() -> None:
    """What this package does to a worker or beat has one answer: celery_etcdlock/tasks/worker.py."""
    users = sorted({m for m, path in MODULES.items() for node in ast.walk(ast.parse(path.read_text()))
                    if _uses_celery_signals(node)})  # fmt: skip
    assert users == [HOOKS_HOME], f"modules other than {HOOKS_HOME} use Celery's signals: {users}"
