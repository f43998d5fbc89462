"""``LeaderDatabaseScheduler``: django-celery-beat's ``DatabaseScheduler``, leader-only.

    pip install 'celery-etcdlock[django]'
    celery -A proj beat -S celery_etcdlock.beat:LeaderDatabaseScheduler
    # or, in Django's settings: CELERY_BEAT_SCHEDULER = "celery_etcdlock.beat:LeaderDatabaseScheduler"

The schedule stays in the database, edited in the Django admin or the ORM;
``leader_only(DatabaseScheduler)`` with the hooks below is what makes it
leader-only. Only the leader reads the schedule after the start, picks up
changes (django-celery-beat's change tracking, checked at every tick) and
writes ``last_run_at`` / ``total_run_count``. A follower writes nothing to the
database and never calls ``sync()``. A process that takes over re-reads every
entry from the database, and an entry whose ``last_run_at`` there is older
than the run recorded in etcd (the old leader sent it, then died before its
``sync()``) takes the recorded one, so it is not sent again.

At start (not for celery's banner copy) the beat checks that Django's database
answers and has django-celery-beat's tables, and stops with one line that says
what is wrong (``DatabaseNotReady``, a ``SystemExit``) rather than a traceback
from deep inside Django. Importing this module without the extra raises
``ImportError`` naming it; with Django not configured, ``ImportError`` saying so.
When it is celery beat that imports it (``-S``), the same words are one line on
stderr (or the log) and the beat exits with status 78, as for bad settings.
"""

from __future__ import annotations

import os
import sys
from types import FrameType
from typing import Any, NoReturn

from ..settings import refuse_start

NAME = "celery_etcdlock.beat.LeaderDatabaseScheduler"
EXTRA = "celery-etcdlock[django]"
SETUP = (
    f"pip install '{EXTRA}', add 'django_celery_beat' to INSTALLED_APPS and run "
    "`python manage.py migrate django_celery_beat`"
)


def _loaded_by_celery_beat() -> bool:
    """Whether celery.beat's ``Service.get_scheduler`` is importing us (``celery beat -S``, ``worker -B``)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "get_scheduler" and frame.f_globals.get("__name__") == "celery.beat":
            return True
        frame = frame.f_back
    return False


def _cannot_load(problem: str) -> NoReturn:
    """``ImportError`` saying ``problem``; when celery beat loads us, one line and exit status 78 instead.

    Celery catches nothing around its scheduler's import: an ImportError would end
    the beat in a traceback of fifty lines whose last one is ours.
    """
    if _loaded_by_celery_beat():
        refuse_start(f"celery_etcdlock: the beat does not start: {NAME}{problem}")
    raise ImportError(f"{NAME}{problem}") from None


try:
    import django
    import django_celery_beat  # noqa: F401  (the package alone needs no settings; its models do)
    from django.conf import settings as django_settings
except ImportError as exc:
    missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
    if (missing or "").split(".")[0] in ("django", "django_celery_beat"):
        _cannot_load(f" needs django-celery-beat, which is not installed: {SETUP}")
    _cannot_load(f" needs django-celery-beat, which does not import ({type(exc).__name__}: {exc}): {SETUP}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _django_ready() -> None:
    from django.apps import apps

    # ``settings.configured`` is only true once something has read a setting: the variable is what counts
    if not (django_settings.configured or os.environ.get("DJANGO_SETTINGS_MODULE")):
        _cannot_load(
            ": Django is not configured: set DJANGO_SETTINGS_MODULE in the Celery app module before the app is "
            "made (os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'proj.settings') in proj/celery.py, as "
            "the Celery and django-celery-beat docs show), or call django.setup() there"
        )
    if apps.ready:
        return
    try:
        django.setup()  # what Celery's Django fix-up does in a worker; beat may get here first
    except Exception as exc:  # the settings module is missing or broken: Django's error, in one line
        module = os.environ.get("DJANGO_SETTINGS_MODULE")
        _cannot_load(
            f": Django's setup failed (DJANGO_SETTINGS_MODULE={module!r}): {type(exc).__name__}: {_first_line(exc)}"
        )


_django_ready()

try:
    from django_celery_beat.models import PeriodicTask, PeriodicTasks
    from django_celery_beat.schedulers import DatabaseScheduler
except ImportError as exc:
    if (exc.name or "").split(".")[0] != "django_celery_beat":
        raise
    _cannot_load(f" needs django-celery-beat, which is not installed: {SETUP}")
except RuntimeError as exc:  # "Model class ... doesn't declare an explicit app_label": not in INSTALLED_APPS
    _cannot_load(f": add 'django_celery_beat' to INSTALLED_APPS and run `python manage.py migrate` ({exc})")

from django.db import DatabaseError, connections, router  # noqa: E402

from .leader import leader_only  # noqa: E402


class DatabaseNotReady(SystemExit):
    """The beat cannot start on this database; ``str()`` says why and what to do (no traceback)."""

    def __str__(self) -> str:
        return str(self.code)


def check_database() -> None:
    """Raise ``DatabaseNotReady`` unless django-celery-beat's tables can be read."""
    alias = router.db_for_read(PeriodicTask)
    connection = connections[alias]
    where = f"database {alias!r} ({connection.vendor})"
    try:
        connection.ensure_connection()
    except DatabaseError as exc:
        raise DatabaseNotReady(
            f"celery-etcdlock: beat cannot start: the {where} does not answer: {_first_line(exc)}"
        ) from None
    try:
        tables = set(connection.introspection.table_names())
    except DatabaseError as exc:
        raise DatabaseNotReady(f"celery-etcdlock: beat cannot start: the {where}: {_first_line(exc)}") from None
    missing = sorted({PeriodicTask._meta.db_table, PeriodicTasks._meta.db_table} - tables)
    if missing:
        raise DatabaseNotReady(
            f"celery-etcdlock: beat cannot start: the {where} has no table {', '.join(missing)}: "
            "run `python manage.py migrate django_celery_beat`"
        )


class LeaderDatabaseScheduler(leader_only(DatabaseScheduler)):  # type: ignore[misc]
    """django-celery-beat's DatabaseScheduler, leader-only; checks the database at its start."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not kwargs.get("lazy"):  # celery's banner builds a lazy copy: only the real one checks
            check_database()
        super().__init__(*args, **kwargs)


__all__ = ["DatabaseNotReady", "LeaderDatabaseScheduler", "check_database"]
