"""The shop's tasks, each with the lock it needs.

- ``sync_customer(customer_id)``: pulls a customer's orders from the CRM;
  two syncs of one customer at once would apply orders twice, so it is a
  singleton *per customer* (other customers sync in parallel).
- ``rebuild_search_index()`` rewrites the index: the writer side of the
  ``search-index`` read-write lock. ``search(q)`` reads it: many at once,
  never during a rebuild, and a waiting rebuild is not starved by searches.
- ``nightly_report()``: one at a time, cluster-wide; a run that finds the
  previous one still going is skipped.

Each task records its run (lock name, fencing token, worker, times) through
``examples.shop.runlog``, which is how the demo shows and checks them.
"""

import random
import time

from celery_etcdlock import rwlock_task, singleton_task

from . import runlog
from .app import app


@singleton_task(app=app, name="shop.sync_customer", key=["customer_id"], lock_ttl=8, bind=True)
def sync_customer(self, customer_id: int) -> dict:
    with runlog.run(self, mode="write", key=str(customer_id)):
        time.sleep(random.uniform(1.0, 3.0))  # talk to the CRM
    return {"customer_id": customer_id}


@rwlock_task(app=app, name="shop.rebuild_search_index", lock="search-index", mode="write", lock_ttl=8, bind=True)
def rebuild_search_index(self) -> dict:
    with runlog.run(self, mode="write"):
        time.sleep(1.5)  # rewrite the index
    return {"rebuilt": True}


@rwlock_task(app=app, name="shop.search", lock="search-index", mode="read", lock_ttl=8, lock_timeout=20, bind=True)
def search(self, q: str) -> dict:
    with runlog.run(self, mode="read", key=q):
        time.sleep(random.uniform(0.2, 0.6))  # query the index
    return {"q": q, "hits": random.randint(0, 40)}


@singleton_task(app=app, name="shop.nightly_report", lock_ttl=6, bind=True)
def nightly_report(self) -> dict:
    with runlog.run(self, mode="write"):
        time.sleep(6.0)  # crunch the day's orders
    return {"report": time.strftime("%Y-%m-%d")}
