"""The Celery app of tests.djangoproj, configured from Django's settings (namespace CELERY)."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.djangoproj.settings")

app = Celery("djangoproj")
app.config_from_object("django.conf:settings", namespace="CELERY")

RUNS = os.environ.get("BEATAPP_RUNS", "djangoproj:runs")
_redis: redis.Redis | None = None


@app.task(name="djangoproj.record", bind=True)
def record(self: Any, entry: str = "") -> None:
    global _redis
    if _redis is None:
        _redis = redis.Redis.from_url(app.conf.broker_url)
    header = getattr(self.request, "etcdlock_beat", None) or (self.request.headers or {}).get("etcdlock_beat")
    _redis.rpush(RUNS, json.dumps({"entry": entry, "ran_at": time.time(), "beat": header}))
