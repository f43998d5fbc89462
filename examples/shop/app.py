"""The shop's Celery app, configured from ``examples.shop.celeryconfig``."""

from celery import Celery

app = Celery("shop", include=["examples.shop.tasks"])
app.config_from_object("examples.shop.celeryconfig")

# The run log and the metrics endpoint listen to worker and beat signals: import them wherever the app is loaded.
from . import metrics, runlog  # noqa: E402,F401
