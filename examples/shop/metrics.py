"""The shop's workers and beats serve their Prometheus metrics over HTTP, on ``SHOP_METRICS_PORT``.

    SHOP_METRICS_PORT=9808 PROMETHEUS_MULTIPROC_DIR=/tmp/shop-metrics \\
        celery -A examples.shop worker --pool=prefork
    curl -s http://127.0.0.1:9808/metrics | grep celery_etcdlock_
    python -m examples.shop.metrics          # the same, from a shell on that host (docker compose exec worker-1 ...)

celery_etcdlock keeps its metrics by itself once prometheus_client is installed
(``pip install 'celery-etcdlock[metrics]'``): all the shop adds is the endpoint.

A prefork worker's locks are taken in its pool processes, so the shop runs its
workers in Prometheus multiprocess mode: ``PROMETHEUS_MULTIPROC_DIR`` is set in
the environment before the worker starts (one directory per worker, on its own
host), every process writes its values to files there, and the endpoint, served
by the worker's main process, adds them up. Without that variable (a beat, or a
solo worker) it serves the process's own registry.

``SHOP_METRICS_ADDR`` is the address to listen on (default 127.0.0.1; the
docker-compose stack listens on its network). Without ``SHOP_METRICS_PORT``, or
without prometheus_client, nothing is served.
"""

from __future__ import annotations

import logging
import os
import sys
import urllib.request
from typing import Any

from celery import signals

logger = logging.getLogger(__name__)

PORT = "SHOP_METRICS_PORT"
ADDR = "SHOP_METRICS_ADDR"
MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"

# It must exist before the first metric is made (celery_etcdlock's, at the worker's start).
if os.environ.get(MULTIPROC_DIR):
    os.makedirs(os.environ[MULTIPROC_DIR], exist_ok=True)


def serve() -> int | None:
    """Serve /metrics on ``SHOP_METRICS_PORT`` from this process, in a thread; the port, or None."""
    port = os.environ.get(PORT)
    if not port:
        return None
    try:
        from prometheus_client import REGISTRY, CollectorRegistry, start_http_server
        from prometheus_client.multiprocess import MultiProcessCollector
    except ImportError:
        logger.warning("%s is set but prometheus_client is not installed: no metrics endpoint", PORT)
        return None
    registry = REGISTRY
    if os.environ.get(MULTIPROC_DIR):
        registry = CollectorRegistry()
        MultiProcessCollector(registry)  # every process of this worker, added up
    try:
        start_http_server(int(port), addr=os.environ.get(ADDR, "127.0.0.1"), registry=registry)
    except OSError as exc:  # a metrics endpoint is never worth a worker
        logger.warning("metrics endpoint not started on port %s: %s", port, exc)
        return None
    logger.info("metrics on http://%s:%s/metrics", os.environ.get(ADDR, "127.0.0.1"), port)
    return int(port)


@signals.worker_init.connect
def _worker_serves_metrics(**_: Any) -> None:
    serve()  # in the main process, before the pool starts


@signals.beat_init.connect
def _beat_serves_metrics(**_: Any) -> None:
    serve()


def main() -> int:
    """Print this host's celery_etcdlock metrics, as served on ``SHOP_METRICS_PORT``."""
    port = os.environ.get(PORT)
    if not port:
        print(f"{PORT} is not set", file=sys.stderr)
        return 2
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:  # noqa: S310
        text = response.read().decode()
    print("\n".join(line for line in text.splitlines() if line.startswith("celery_etcdlock_")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
