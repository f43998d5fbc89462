"""The package's layers run one way, and this test keeps it so.

Each module of celery_etcdlock belongs to one layer below; a module may import
modules of its own layer or of layers listed before it, never after. Only the
Celery layer and above import Celery, and only ``backends/`` imports an HTTP
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
    ("leaves", {"errors", "options", "keys", "clock", "observe"}),
    ("green", {"green"}),
    ("retry", {"retry"}),
    (
        "backends",
        {"backends", "backends.base", "backends.etcd2", "backends.etcd3", "backends.gateway", "backends.memory",
         "backends.native", "backends.transport"},
    ),  # fmt: skip
    ("session", {"session"}),
    ("client", {"client", "connect"}),
    ("queue", {"queue"}),
    ("primitives", {"mutex", "rwlock", "semaphore", "election"}),
    ("store", {"store"}),
    ("metrics", {"metrics"}),  # listens to observe; never imported by the primitives
    ("celery", {"masking", "settings", "task_options", "dedupe", "signals", "tasks", "beat"}),
    ("cli", {"cli", "testing"}),  # testing: the pytest plugin, above everything it tests
    ("package", {""}),  # __init__: the public names
]
CELERY_FROM = "celery"  # the first layer that may import Celery (and kombu)
CLIENT_LIBRARIES = {"etcd", "urllib3", "requests", "etcd3gw", "grpc"}  # only backends/ speaks to etcd


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
        if target not in MODULES:  # "from .backends import base" names a module inside a package
            continue
        assert _layer_of(target) <= layer, (
            f"{module} ({LAYERS[layer][0]} layer) imports {target} ({LAYERS[_layer_of(target)][0]} layer, above it)"
        )
    if layer < [name for name, _ in LAYERS].index(CELERY_FROM):
        assert not theirs & {"celery", "kombu", "billiard"}, f"{module} is below the Celery layer but imports Celery"
    if not module.startswith("backends"):
        assert not theirs & CLIENT_LIBRARIES, f"{module} imports an etcd/HTTP client library outside backends/"
    if LAYERS[layer][0] == "leaves":
        assert not [t for t in ours if t in MODULES], f"{module} is a leaf but imports {ours}"


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
