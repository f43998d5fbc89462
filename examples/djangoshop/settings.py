"""Django settings of examples.djangoshop, from the environment.

- ``PGHOST``, ``PGPORT``, ``PGDATABASE``, ``PGUSER``, ``PGPASSWORD``: the PostgreSQL database,
  as libpq names them (the password only ever from the environment);
- ``SHOP_BROKER_URL``, ``ETCDLOCK_URL``, ``ETCDLOCK_PREFIX``, ``ETCDLOCK_BEAT_TTL``: as for the shop.
"""

import os

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-only-not-secret")
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = ["django.contrib.contenttypes", "django_celery_beat", "examples.djangoshop"]
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "HOST": os.environ.get("PGHOST", "127.0.0.1"),
        "PORT": os.environ.get("PGPORT", "5432"),
        "NAME": os.environ.get("PGDATABASE", "shop"),
        "USER": os.environ.get("PGUSER", "shop"),
        "PASSWORD": os.environ.get("PGPASSWORD", ""),
        "OPTIONS": {"connect_timeout": 5},
    }
}

# Celery, read by examples/djangoshop/celery.py (namespace CELERY)
CELERY_BROKER_URL = os.environ.get("SHOP_BROKER_URL", "redis://127.0.0.1:6379/1")
CELERY_TASK_IGNORE_RESULT = True
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BEAT_MAX_LOOP_INTERVAL = 1  # how often the leader looks for edits in the database (default 5 s)

# celery_etcdlock: its own beat name, so that these beats elect their own leader beside the shop's
CELERY_ETCDLOCK_URL = os.environ.get("ETCDLOCK_URL", "etcd3://127.0.0.1:2379")
CELERY_ETCDLOCK_PREFIX = os.environ.get("ETCDLOCK_PREFIX", "/shop")
CELERY_ETCDLOCK_BEAT_TTL = float(os.environ.get("ETCDLOCK_BEAT_TTL", "5"))
CELERY_ETCDLOCK_BEAT_NAME = "djangoshop"
