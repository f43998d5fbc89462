"""The retry policies around every etcd call, composed from tenacity's pieces.

Backends classify each failure: ``Transient`` (connection refused or reset,
a request timeout, an etcd 5xx, a leader election in progress) is worth
retrying, possibly on another endpoint; anything else (a failed compare, a
key that already exists, bad credentials) is an answer and is never retried.

- ``call_policy(max_delay, operation, started)``: one operation, exponential
  backoff with jitter, for at most ``max_delay`` seconds
  (``etcdlock_retry_max_delay``) from ``started``.
  ``call()`` runs an operation under it, building it only once a first
  attempt has failed: almost every call succeeds at once, and a tenacity
  ``Retrying`` costs more to build and run than the rest of the client's
  work on a request.
- ``renewal_policy(deadline)``: a renewal, retried only while it can still
  land before the holder's deadline; after that the lock is lost anyway.

When a policy gives up, ``run()`` raises ``BackendUnavailable`` naming the
endpoints tried. Retries are logged at WARNING, but not every one: the first
failure at an endpoint, then at most one line per ``LOG_EVERY`` seconds per
endpoint (saying how many were not logged), then the giving up. Every retry
and every giving up is reported to ``observe`` (``RETRY``, ``FAILED``, with
the endpoint: a URL without credentials), for the metrics.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import tenacity
import tenacity.stop

from .. import clock, green, observe
from ..errors import BackendUnavailable

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Transient(Exception):
    """A failure worth retrying; raised by backends, never seen by users."""

    def __init__(self, endpoint: str, cause: BaseException | str) -> None:
        super().__init__(f"{endpoint}: {cause}")
        self.endpoint = endpoint
        self.reason = str(cause)


retry_if_transient = tenacity.retry_if_exception_type(Transient)
backoff = tenacity.wait_exponential(multiplier=0.05, max=2.0) + tenacity.wait_random(0, 0.1)
quick_backoff = tenacity.wait_exponential(multiplier=0.05, max=0.5) + tenacity.wait_random(0, 0.05)


LOG_EVERY = 10.0  # seconds between two retry warnings about one endpoint

_logged: dict[str, tuple[float, int]] = {}  # endpoint -> (when a retry was last logged, retries not logged since)
_logged_lock = green.native_lock()  # a renewer thread logs retries too, under gevent a native one


def _log_retry(operation: str, report: bool = True) -> Callable[[tenacity.RetryCallState], None]:
    def log(state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        delay = state.next_action.sleep if state.next_action else 0.0
        endpoint = exc.endpoint if isinstance(exc, Transient) else ""
        if report and observe.listening():  # every retry, logged or not
            observe.report(observe.Event(observe.RETRY, endpoint=endpoint, operation=operation))
        now = time.monotonic()
        with _logged_lock:
            last, quiet = _logged.get(endpoint, (-LOG_EVERY, 0))
            if now - last < LOG_EVERY:
                _logged[endpoint] = (last, quiet + 1)
                return
            _logged[endpoint] = (now, 0)
        more = f" ({quiet} more failures not logged)" if quiet else ""
        logger.warning("etcd %s failed (%s); retry %d in %.2fs%s", operation, exc, state.attempt_number, delay, more)

    return log


class _stop_after_delay_since(tenacity.stop.stop_base):
    """``stop_after_delay``, counted from ``started`` (monotonic) rather than from the policy's own start."""

    def __init__(self, started: float, max_delay: float) -> None:
        self.started = started
        self.max_delay = max_delay

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        ended = retry_state.outcome_timestamp
        return (ended if ended is not None else time.monotonic()) - self.started >= self.max_delay


def call_policy(max_delay: float, operation: str, started: float) -> tenacity.Retrying:
    """Retry a transient failure until ``max_delay`` seconds have passed since ``started`` (monotonic)."""
    return tenacity.Retrying(
        retry=retry_if_transient,
        wait=backoff,
        stop=_stop_after_delay_since(started, max_delay),
        before_sleep=_log_retry(operation),
        reraise=True,
    )


def renewal_policy(
    deadline: float, operation: str, sleep: Callable[[float], None] | None = None, report: bool = True
) -> tenacity.Retrying:
    """Retry a transient failure only while the next attempt could beat ``deadline`` (on ``clock.now()``).

    ``sleep`` pauses between attempts, and ``report=False`` keeps the retries from ``observe``: a
    renewer under gevent is a native thread, which must not wait on the green locks of a listener.
    """
    return tenacity.Retrying(
        sleep=sleep or tenacity.nap.sleep,
        retry=retry_if_transient,
        wait=quick_backoff,
        stop=tenacity.stop_before_delay(max(0.0, deadline - clock.now())),
        before_sleep=_log_retry(operation, report),
        reraise=True,
    )


def run(
    policy: tenacity.Retrying, fn: Callable[[], T], endpoints: tuple[str, ...], operation: str = "", report: bool = True
) -> T:
    """Run ``fn`` under ``policy``; a last ``Transient`` becomes ``BackendUnavailable``."""
    try:
        return policy(fn)
    except Transient as exc:
        if len(endpoints) == 1 and exc.endpoint == endpoints[0]:
            message = f"etcd unreachable at {exc.endpoint}: {exc.reason}"
        else:
            message = f"etcd unreachable at {', '.join(endpoints)} (the last failure, at {exc.endpoint}: {exc.reason})"
        with _logged_lock:
            _logged.pop(exc.endpoint, None)  # the next failure there is news again
        logger.warning("%s; gave up", message)
        if report and observe.listening():
            observe.report(observe.Event(observe.FAILED, endpoint=exc.endpoint, operation=operation))
        raise BackendUnavailable(message, endpoints=endpoints) from exc


def call(max_delay: float, operation: str, fn: Callable[[], T], endpoints: tuple[str, ...]) -> T:
    """Run ``fn`` under ``call_policy``, with its first attempt outside tenacity.

    The policy is built only if that attempt fails transiently; it then starts from that
    failure (its first attempt re-raises it: same log line, same backoff before the next
    one) and its deadline counts from before the first attempt, as if it had run it.
    """
    started = time.monotonic()
    try:
        return fn()
    except Transient as exc:
        failed: Transient | None = exc

    def replay() -> T:
        nonlocal failed
        if failed is not None:
            exc, failed = failed, None
            raise exc
        return fn()

    return run(call_policy(max_delay, operation, started), replay, endpoints, operation)
