"""Log lines of a bounded size, whatever the user's data: a lock named after a 2 MB argument logs 200 characters.

    logger.info("task %s skipped: %s is held by %s", task, name, holder)   # name: 2,000,179 characters
    # -> task t skipped: task/t/xxxx...(2000179 characters, sha256 1f3a5c...) is held by ...

``install()`` (the package's import calls it) wraps the logging module's
record factory once: every record of a ``celery_etcdlock`` logger has each
argument longer than ``MAX_ARGUMENT`` characters (as ``%s`` would show it)
replaced by ``shorten()`` of it. Records of other loggers are left alone, and
the cost falls only on records that are emitted (logging makes a record only
after its level check). The hash is the one a hashed key ends in (see keys.py),
so a shortened name can be matched with what ``celery etcdlock locks`` lists.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any

PACKAGE = "celery_etcdlock"
MAX_ARGUMENT = 200  # characters of one argument of a log line
_HEAD = 120


def shorten(text: str, limit: int = MAX_ARGUMENT) -> str:
    """``text`` if it is at most ``limit`` characters, else its head, its length and the start of its SHA-256."""
    if len(text) <= limit:
        return text
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return f"{text[: min(_HEAD, limit)]}...({len(text)} characters, sha256 {digest})"


def _bounded(value: Any) -> Any:
    if isinstance(value, (int, float, bool)) or value is None:
        return value
    try:
        shown = value if isinstance(value, str) else str(value)
    except Exception:  # a broken __str__ is logging's to report, as it would without us
        return value
    return shorten(shown) if len(shown) > MAX_ARGUMENT else value


def _ours(name: str) -> bool:
    return name == PACKAGE or name.startswith(PACKAGE + ".")


def _bounding(factory: Callable[..., logging.LogRecord]) -> Callable[..., logging.LogRecord]:
    def make_bounded_record(name: str, *args: Any, **kwargs: Any) -> logging.LogRecord:
        record = factory(name, *args, **kwargs)
        if _ours(name) and record.args:
            if isinstance(record.args, tuple):
                record.args = tuple(_bounded(arg) for arg in record.args)
            elif isinstance(record.args, dict):
                record.args = {key: _bounded(arg) for key, arg in record.args.items()}
        return record

    make_bounded_record.bounds_celery_etcdlock = True  # type: ignore[attr-defined]
    return make_bounded_record


def install() -> None:
    """Bound the arguments of this package's log records from now on (idempotent)."""
    factory = logging.getLogRecordFactory()
    if not getattr(factory, "bounds_celery_etcdlock", False):
        logging.setLogRecordFactory(_bounding(factory))
