"""The Django variant of the example: its schedule in django-celery-beat, run by leader-only beats.

    docker compose --profile django up --build        # postgres, migrate, 2 beats, a worker
    docker compose --profile django logs -f django-worker

Without Docker, on a PostgreSQL and etcd and Redis of yours (PG* as libpq reads them):

    export DJANGO_SETTINGS_MODULE=examples.djangoshop.settings PGHOST=127.0.0.1 PGUSER=postgres PGDATABASE=shop
    python -m django shop_migrate                      # migrate, then the example's PeriodicTask
    celery -A examples.djangoshop beat -S celery_etcdlock.beat:LeaderDatabaseScheduler   # twice: one sends
    celery -A examples.djangoshop worker -P solo

The schedule is ``PeriodicTask`` rows (``shop_migrate`` creates one, ``djangoshop.heartbeat``
every 5 s); add or edit entries with the ORM or the Django admin, and the leader picks them up.
"""

from .celery import app as celery_app  # as Celery's Django guide has it: the app loads with Django

__all__ = ["celery_app"]
