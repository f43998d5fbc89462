"""A tiny Django project with django-celery-beat, for the LeaderDatabaseScheduler tests.

    DJANGOPROJ_DB=postgresql://postgres@127.0.0.1:5432/shop BEATAPP_BROKER=redis://127.0.0.1:6379/0 \\
    ETCDLOCK_URL=etcd3://127.0.0.1:2379 \\
        celery -A tests.djangoproj beat -S celery_etcdlock.beat:LeaderDatabaseScheduler
    celery -A tests.djangoproj worker -P solo

- ``DJANGOPROJ_DB``: ``postgresql://user@host:port/name`` or ``sqlite:////abs/path.sqlite3``;
  ``DJANGOPROJ_APP_NAME``: PostgreSQL's application_name (default ``djangoproj-<pid>``), so that
  the server's log says which process wrote what;
- ``BEATAPP_BROKER``, ``BEATAPP_RUNS``, ``BEATAPP_QUEUE``, ``ETCDLOCK_URL``, ``ETCDLOCK_PREFIX``,
  ``BEATAPP_BEAT_TTL``: as in tests/beatapp.py.

The schedule lives in the database (the tests write it with the ORM). The task
``djangoproj.record`` appends ``{"entry", "ran_at", "beat"}`` to the Redis list
``BEATAPP_RUNS``: ``beat`` is the ``etcdlock_beat`` header its beat sent it with.
"""
