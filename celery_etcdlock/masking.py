"""Keeps the password of ``etcdlock_url`` out of Celery's settings dumps, from the package's import on.

    import celery_etcdlock                      # enough: this module is installed by the package's __init__
    app.conf.etcdlock_url = "etcd3://user:secret@etcd:2379"
    app.bugreport()                             # ... etcdlock_url: 'etcd3://user:********@etcd:2379'
    app.conf.humanize(censored=True)            # the same; so do ``celery report`` and ``celery inspect conf``

Celery hides only names with PASS, KEY, SECRET (...) in them, and the URLs of
brokers and result backends. Its ``Settings.table()`` looks
``celery.app.utils.filter_hidden_settings`` up at each call, so wrapping that
one function covers every dump.

The package must not import Celery (its primitives work without it), so
``install()`` wraps the filter at once if Celery is already loaded, and
otherwise the moment ``celery.app.utils`` is first imported (a one-shot import
hook that then removes itself).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

from .options import redact

CELERY_UTILS = "celery.app.utils"


def is_etcdlock_url(key: object) -> bool:
    return isinstance(key, str) and "etcdlock_url" in key.lower()  # etcdlock_url, CELERY_ETCDLOCK_URL, ...


def _masking(filter_hidden_settings: Any) -> Any:
    def filter_hidden_settings_and_etcdlock_urls(conf: Mapping[Any, Any]) -> dict[Any, Any]:
        filtered = filter_hidden_settings(conf)
        return {k: redact(v) if is_etcdlock_url(k) and isinstance(v, str) else v for k, v in filtered.items()}

    filter_hidden_settings_and_etcdlock_urls.masks_etcdlock_urls = True  # type: ignore[attr-defined]
    return filter_hidden_settings_and_etcdlock_urls


def _wrap(utils: ModuleType) -> None:
    if not getattr(utils.filter_hidden_settings, "masks_etcdlock_urls", False):
        utils.filter_hidden_settings = _masking(utils.filter_hidden_settings)  # type: ignore[attr-defined]


class _WrapOnImport(importlib.abc.MetaPathFinder):
    """Finds ``celery.app.utils`` as the path finder does, and wraps its filter once it has run."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != CELERY_UTILS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        loader = getattr(spec, "loader", None)
        if spec is None or not isinstance(loader, importlib.abc.Loader) or not hasattr(loader, "exec_module"):
            return None  # an unusual install: leave it to the other finders (settings.py still wraps it)
        original = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original(module)
            _wrap(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        _uninstall_hook()
        return spec


_hook = _WrapOnImport()


def _uninstall_hook() -> None:
    if _hook in sys.meta_path:
        sys.meta_path.remove(_hook)


def install() -> None:
    """Mask ``etcdlock_url`` in Celery's dumps now, or when Celery loads (idempotent)."""
    utils = sys.modules.get(CELERY_UTILS)
    if utils is not None and hasattr(utils, "filter_hidden_settings"):
        _uninstall_hook()
        _wrap(utils)
    elif _hook not in sys.meta_path:
        sys.meta_path.insert(0, _hook)
