"""The Celery app of the task benchmark's workers: ``celery -A bench.taskapp worker``.

The benchmark starts each worker with BENCH_REDIS_URL (broker, result backend
and celery-singleton's lock store) and BENCH_ETCD_URL (``etcdlock_url``) in its
environment, and imports this module itself to send the tasks. The tasks have
the same body, returning their argument; each argument is a key of its own,
so no two runs ever conflict:

- ``bench.plain``: a plain ``@app.task``, the reference;
- ``bench.singleton``: ``@singleton_task(key=["i"])``, ours, on the worker's etcd;
- ``bench.celery_singleton``: celery-singleton's ``Singleton`` base (a Redis key
  taken at enqueue, deleted when the run ends), if celery-singleton is installed.

Nothing else is configured: the rest is what a user gets by default.

With BENCH_CPROFILE_DIR set (``bench_tasks --profile``), each pool child runs
every task under a ``cProfile`` profiler of that task's name, and writes
``<task name>-<pid>.prof`` into that directory when it exits: exact call
counts per run (a profiler slows what it measures, so no timing is taken from
such a worker).
"""

from __future__ import annotations

import cProfile
import os
from collections import defaultdict
from typing import Any

from celery import Celery, signals

from celery_etcdlock import singleton_task

REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
ETCD_URL = os.environ.get("BENCH_ETCD_URL", "etcd://127.0.0.1:2379")

app = Celery("bench", broker=REDIS_URL, backend=REDIS_URL)
app.conf.update(etcdlock_url=ETCD_URL, singleton_backend_url=REDIS_URL, broker_connection_retry_on_startup=True)


@app.task(name="bench.plain")
def plain(i: int) -> int:
    return i


@singleton_task(app=app, name="bench.singleton", key=["i"])
def singleton(i: int) -> int:
    return i


try:
    from celery_singleton import Singleton
except ImportError:  # the bench group is not installed: the benchmark says so and leaves it out
    celery_singleton = None
else:

    @app.task(base=Singleton, name="bench.celery_singleton")
    def celery_singleton(i: int) -> int:
        return i


PROFILE_DIR = os.environ.get("BENCH_CPROFILE_DIR")
_profilers: defaultdict[str, cProfile.Profile] = defaultdict(cProfile.Profile)


if PROFILE_DIR:

    @signals.task_prerun.connect
    def _profile_run(task: Any, **_: Any) -> None:
        _profilers[task.name].enable()

    @signals.task_postrun.connect
    def _end_profile_run(task: Any, **_: Any) -> None:
        _profilers[task.name].disable()

    @signals.worker_process_shutdown.connect
    def _write_profiles(**_: Any) -> None:
        for name, profiler in _profilers.items():
            profiler.dump_stats(os.path.join(PROFILE_DIR, f"{name}-{os.getpid()}.prof"))
