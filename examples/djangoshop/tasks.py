"""The task the example's schedule runs: it logs which beat sent it (the ``etcdlock_beat`` header)."""

from typing import Any

from celery import shared_task
from celery.utils.log import get_task_logger

logger = get_task_logger(__name__)


@shared_task(name="djangoshop.heartbeat", bind=True)
def heartbeat(self: Any) -> str:
    sent = getattr(self.request, "etcdlock_beat", None) or (self.request.headers or {}).get("etcdlock_beat") or {}
    logger.info("heartbeat: run %s of %s, sent by beat %s", sent.get("run"), sent.get("entry"), sent.get("sender"))
    return str(sent.get("sender"))
