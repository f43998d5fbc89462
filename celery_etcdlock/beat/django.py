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
"""

from __future__ import annotations

from typing import Any

EXTRA = "celery-etcdlock[django]"

try:
    import django
    import django_celery_beat  # noqa: F401  (the package alone needs no settings; its models do)
    from django.conf import settings as django_settings
except ModuleNotFoundError:
    raise ImportError(
        f"celery_etcdlock.beat.LeaderDatabaseScheduler needs django-celery-beat: pip install '{EXTRA}'"
    ) from None


def _django_ready() -> None:
    from django.apps import apps
    from django.core.exceptions import ImproperlyConfigured

    try:
        configured = django_settings.configured
    except ImproperlyConfigured:
        configured = False
    if not configured:
        raise ImportError(
            "celery_etcdlock.beat.LeaderDatabaseScheduler: Django is not configured: set DJANGO_SETTINGS_MODULE "
            "before the Celery app loads (proj/celery.py, as Celery's Django guide shows)"
        )
    if not apps.ready:
        django.setup()  # what Celery's Django fix-up does in a worker; beat may get here first


_django_ready()

try:
    from django_celery_beat.models import PeriodicTask, PeriodicTasks
    from django_celery_beat.schedulers import DatabaseScheduler
except ModuleNotFoundError as exc:
    if (exc.name or "").split(".")[0] != "django_celery_beat":
        raise
    raise ImportError(
        f"celery_etcdlock.beat.LeaderDatabaseScheduler needs django-celery-beat: pip install '{EXTRA}'"
    ) from None
except RuntimeError as exc:  # "Model class ... doesn't declare an explicit app_label": not in INSTALLED_APPS
    raise ImportError(
        f"celery_etcdlock.beat.LeaderDatabaseScheduler: add 'django_celery_beat' to INSTALLED_APPS ({exc})"
    ) from None

from django.db import DatabaseError, connections, router  # noqa: E402

from .leader import leader_only  # noqa: E402


class DatabaseNotReady(SystemExit):
    """The beat cannot start on this database; ``str()`` says why and what to do (no traceback)."""

    def __str__(self) -> str:
        return str(self.code)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


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
