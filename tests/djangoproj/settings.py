"""Django settings of tests.djangoproj, from the environment (see tests/djangoproj/__init__.py)."""

from __future__ import annotations

import os
from urllib.parse import urlsplit


def database(url: str) -> dict[str, object]:
    parts = urlsplit(url)
    if parts.scheme == "sqlite":
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": parts.path, "OPTIONS": {"timeout": 30}}
    if parts.scheme in ("postgres", "postgresql"):
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": parts.path.lstrip("/"),
            "USER": parts.username or "postgres",
            "HOST": parts.hostname,
            "PORT": parts.port,
            "OPTIONS": {
                "application_name": os.environ.get("DJANGOPROJ_APP_NAME", f"djangoproj-{os.getpid()}"),
                "connect_timeout": 5,
            },
        }
    raise ValueError(f"DJANGOPROJ_DB: not a postgresql:// or sqlite:// URL: {url!r}")


SECRET_KEY = "tests-only"
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = ["django.contrib.contenttypes", "django_celery_beat"]
DATABASES = {"default": database(os.environ.get("DJANGOPROJ_DB", "sqlite:////tmp/djangoproj.sqlite3"))}
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"

CELERY_BROKER_URL = os.environ.get("BEATAPP_BROKER", "redis://127.0.0.1:6379/0")
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("BEATAPP_QUEUE", "djangoproj")
CELERY_TASK_IGNORE_RESULT = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BEAT_MAX_LOOP_INTERVAL = 1  # how often the leader looks for changes in the database
CELERY_RESULT_EXPIRES = None  # no celery.backend_cleanup entry
CELERY_ETCDLOCK_URL = os.environ.get("ETCDLOCK_URL", "etcd3://127.0.0.1:2379")
CELERY_ETCDLOCK_PREFIX = os.environ.get("ETCDLOCK_PREFIX") or None
CELERY_ETCDLOCK_BEAT_TTL = float(os.environ.get("BEATAPP_BEAT_TTL", "10"))
CELERY_ETCDLOCK_RETRY_MAX_DELAY = 5
CELERY_ETCDLOCK_BEAT_NAME = os.environ.get("BEATAPP_BEAT_NAME", "djangoproj")
