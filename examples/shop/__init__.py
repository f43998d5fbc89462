"""A small shop on Celery, safe to scale out with celery_etcdlock.

Run as many workers and beats as you like, on as many hosts::

    celery -A examples.shop worker -n worker-1@%h
    celery -A examples.shop beat -S celery_etcdlock.beat:LeaderScheduler

Only the elected beat sends the schedule; ``sync_customer`` runs at most once
at a time per customer, ``nightly_report`` once at a time overall, and
``rebuild_search_index`` never while a ``search`` reads the index.
Settings come from ``examples.shop.celeryconfig`` (environment overrides there).
"""

from .app import app

__all__ = ["app"]
