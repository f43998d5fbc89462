"""The retry policies around every etcd call, composed from tenacity's pieces.

Backends classify each failure: ``Transient`` (connection refused or reset,
a request timeout, an etcd 5xx, a leader election in progress) is worth
retrying, possibly on another endpoint; anything else (a failed compare, a
key that already exists, bad credentials) is an answer and is never retried.

- ``call_policy(max_delay)``: one operation, exponential backoff with jitter,
  for at most ``max_delay`` seconds (``etcdlock_retry_max_delay``).
- ``renewal_policy(deadline)``: a renewal, retried only while it can still
  land before the holder's deadline; after that the lock is lost anyway.

When a policy gives up, ``run()`` raises ``BackendUnavailable`` naming the
endpoints tried.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import tenacity
from celery.utils.log import get_logger

from .errors import BackendUnavailable

logger = get_logger(__name__)

T = TypeVar("T")


class Transient(Exception):
    """A failure worth retrying; raised by backends, never seen by users."""

    def __init__(self, endpoint: str, cause: BaseException | str) -> None:
        super().__init__(f"{endpoint}: {cause}")
        self.endpoint = endpoint


retry_if_transient = tenacity.retry_if_exception_type(Transient)
backoff = tenacity.wait_exponential(multiplier=0.05, max=2.0) + tenacity.wait_random(0, 0.1)
quick_backoff = tenacity.wait_exponential(multiplier=0.05, max=0.5) + tenacity.wait_random(0, 0.05)


def _log_retry(operation: str) -> Callable[[tenacity.RetryCallState], None]:
    def log(state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        delay = state.next_action.sleep if state.next_action else 0.0
        logger.warning("etcd %s failed (%s); retry %d in %.2fs", operation, exc, state.attempt_number, delay)

    return log


def call_policy(max_delay: float, operation: str) -> tenacity.Retrying:
    """Retry a transient failure for up to ``max_delay`` seconds."""
    return tenacity.Retrying(
        retry=retry_if_transient,
        wait=backoff,
        stop=tenacity.stop_after_delay(max_delay),
        before_sleep=_log_retry(operation),
        reraise=True,
    )


def renewal_policy(deadline: float, operation: str) -> tenacity.Retrying:
    """Retry a transient failure only while the next attempt could beat ``deadline`` (monotonic)."""
    return tenacity.Retrying(
        retry=retry_if_transient,
        wait=quick_backoff,
        stop=tenacity.stop_before_delay(max(0.0, deadline - time.monotonic())),
        before_sleep=_log_retry(operation),
        reraise=True,
    )


def run(policy: tenacity.Retrying, fn: Callable[[], T], endpoints: tuple[str, ...]) -> T:
    """Run ``fn`` under ``policy``; a last ``Transient`` becomes ``BackendUnavailable``."""
    try:
        return policy(fn)
    except Transient as exc:
        raise BackendUnavailable(f"etcd unreachable at {', '.join(endpoints)}: {exc}", endpoints=endpoints) from exc
