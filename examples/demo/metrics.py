"""What the shop's workers and beats say on their /metrics endpoints, added up for the demo's summary.

    scraped = scrape({"worker-1": "http://127.0.0.1:41234/metrics", ...})
    totals = summarise(scraped)      # acquisitions by outcome, wait p95, losses, who leads
    print(describe(totals))

It reads the endpoints as Prometheus would (examples/shop/metrics.py serves
them; a prefork worker's adds up its pool processes). A process that is down
is left out; without prometheus_client, there is nothing to say.
"""

from __future__ import annotations

import math
import urllib.request
from typing import Any

Sample = tuple[str, dict[str, str], float]


def scrape(urls: dict[str, str], timeout: float = 3.0) -> dict[str, list[Sample]] | None:
    """The celery_etcdlock samples each endpoint serves now (None: prometheus_client is not installed)."""
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        return None
    scraped: dict[str, list[Sample]] = {}
    for name, url in urls.items():
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - loopback
                text = response.read().decode()
        except OSError:
            continue  # down, or restarting
        scraped[name] = [
            (s.name, dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(text)
            if family.name.startswith("celery_etcdlock_")
            for s in family.samples
        ]
    return scraped


def _total(samples: list[Sample], name: str, **labels: str) -> float:
    return sum(v for n, ls, v in samples if n == name and all(ls.get(k) == x for k, x in labels.items()))


def quantile(q: float, buckets: dict[float, float]) -> float | None:
    """``histogram_quantile``: the q-quantile of cumulative ``{upper bound: count}``, interpolated in its bucket."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] == 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower  # beyond the last finite bucket: its bound is all that is known
            return lower + (bound - lower) * ((rank - below) / (count - below) if count > below else 1.0)
        lower, below = bound, count
    return lower


def summarise(scraped: dict[str, list[Sample]]) -> dict[str, Any]:
    everything = [s for samples in scraped.values() for s in samples]
    buckets: dict[float, float] = {}
    for name, labels, value in everything:
        if name == "celery_etcdlock_wait_seconds_bucket":
            bound = float(labels["le"])
            buckets[bound] = buckets.get(bound, 0.0) + value
    return {
        "scraped": sorted(scraped),
        "acquisitions": {
            outcome: int(_total(everything, "celery_etcdlock_acquisitions_total", outcome=outcome))
            for outcome in ("acquired", "skipped", "refused", "timed_out")
        },
        "wait_p95_seconds": quantile(0.95, buckets),
        "lost": int(_total(everything, "celery_etcdlock_locks_lost_total")),
        "leaders": sorted(
            name for name, samples in scraped.items() if _total(samples, "celery_etcdlock_leader") >= 1
        ),
        "beat_runs_sent": {
            name: int(_total(samples, "celery_etcdlock_beat_runs_sent_total"))
            for name, samples in sorted(scraped.items())
            if _total(samples, "celery_etcdlock_beat_runs_sent_total")
        },
    }


def describe(totals: dict[str, Any]) -> list[str]:
    acquisitions = totals["acquisitions"]
    p95 = totals["wait_p95_seconds"]
    sent = ", ".join(f"{name} {count}" for name, count in totals["beat_runs_sent"].items()) or "none"
    return [
        f"  metrics ({len(totals['scraped'])} /metrics endpoints): locks acquired {acquisitions['acquired']},"
        f" skipped {acquisitions['skipped']}, refused {acquisitions['refused']},"
        f" timed out {acquisitions['timed_out']}; wait p95 {'-' if p95 is None else f'{p95:.2f}s'};"
        f" locks lost {totals['lost']}",
        f"  metrics: {', '.join(totals['leaders']) or 'nobody'} leads (celery_etcdlock_leader);"
        f" runs sent since each beat started: {sent}",
    ]
