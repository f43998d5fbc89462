"""The shop's settings: Celery's own, plus the documented ``etcdlock_*`` ones.

Each can be overridden from the environment (the demo and docker-compose.yml
do), e.g. ``ETCDLOCK_URL=etcd3://etcd-1:2379,etcd-2:2379,etcd-3:2379``.
"""

import os

broker_url = os.environ.get("SHOP_BROKER_URL", "redis://127.0.0.1:6379/0")
task_ignore_result = True
worker_prefetch_multiplier = 1  # a busy worker leaves new messages to idle ones
broker_connection_retry_on_startup = True

# celery_etcdlock
etcdlock_url = os.environ.get("ETCDLOCK_URL", "etcd3://127.0.0.1:2379")
etcdlock_prefix = os.environ.get("ETCDLOCK_PREFIX", "/shop")
etcdlock_ttl = float(os.environ.get("ETCDLOCK_TTL", "10"))
etcdlock_beat_ttl = float(os.environ.get("ETCDLOCK_BEAT_TTL", "5"))
etcdlock_retry_max_delay = float(os.environ.get("ETCDLOCK_RETRY_MAX_DELAY", "30"))

# Only the elected beat sends; start as many beats as you like.
beat_scheduler = "celery_etcdlock.beat:LeaderScheduler"
beat_max_loop_interval = 1.0  # seconds; this schedule runs every few seconds

# Every few seconds, so that the demo shows something; a real shop would say crontab(hour=3).
beat_schedule = {
    "sync-customer-1": {"task": "shop.sync_customer", "schedule": 2.0, "args": (1,)},
    "sync-customer-2": {"task": "shop.sync_customer", "schedule": 2.0, "args": (2,)},
    "sync-customer-3": {"task": "shop.sync_customer", "schedule": 3.0, "args": (3,)},
    "search-shoes": {"task": "shop.search", "schedule": 1.0, "args": ("shoes",)},
    "search-socks": {"task": "shop.search", "schedule": 1.5, "args": ("socks",)},
    "rebuild-search-index": {"task": "shop.rebuild_search_index", "schedule": 6.0},
    "nightly-report": {"task": "shop.nightly_report", "schedule": 4.0},
}

# Where tasks log their runs for the demo's view (examples.shop.runlog); defaults to the broker.
shop_runlog_url = os.environ.get("SHOP_RUNLOG_URL", broker_url)
