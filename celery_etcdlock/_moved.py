"""Old import paths of modules that moved into the layer folders in 0.3 keep working.

``import celery_etcdlock.session`` gives the module now at ``celery_etcdlock.locks.session``
(the same module object, so its state is shared), with a DeprecationWarning naming the new
path. The names exported by ``celery_etcdlock`` itself never moved.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType

#: old module path -> new module path (below celery_etcdlock)
MOVED = {
    "backends": "etcd",
    **{f"backends.{name}": f"etcd.{name}" for name in ("base", "etcd2", "etcd3", "gateway", "memory", "native")},
    "backends.transport": "etcd.transport",
    "retry": "etcd.retry",
    **{name: f"locks.{name}" for name in ("session", "client", "connect", "queue")},
    **{name: f"locks.{name}" for name in ("mutex", "rwlock", "semaphore", "election", "store")},
    "task_options": "tasks.options",
    "dedupe": "tasks.dedupe",
}
PACKAGE = __name__.rpartition(".")[0]


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path first (before the path finder, which would load a second copy)."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        old = fullname.removeprefix(f"{PACKAGE}.")
        if old == fullname or old not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = f"{PACKAGE}.{MOVED[spec.name.removeprefix(f'{PACKAGE}.')]}"
        warnings.warn(f"{spec.name} moved to {new} in celery-etcdlock 0.3", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        self._spec_of = getattr(self, "_spec_of", {})
        self._spec_of[spec.name] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # importlib stamped the old name's spec on the shared module: give it back its own
        module.__spec__ = self._spec_of.pop(module.__spec__.name if module.__spec__ else "", module.__spec__)


def install() -> None:
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModules())
