"""Example projects for celery_etcdlock: ``examples.shop`` (a Celery app) and ``examples.demo`` (its live demo)."""
