"""The Celery app of examples.djangoshop: configured from Django's settings (namespace CELERY)."""

import os

from celery import Celery

# Before the app is made, so that Celery's Django fix-up sets Django up in every beat and worker.
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "examples.djangoshop.settings")

app = Celery("djangoshop")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
