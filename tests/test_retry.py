"""retry.call(): the first attempt runs outside tenacity; a transient failure hands over to the full policy."""

from __future__ import annotations

import logging
import time

import pytest

from celery_etcdlock import BackendUnavailable
from celery_etcdlock.etcd import retry

ENDPOINTS = ("http://127.0.0.1:1",)


@pytest.fixture(autouse=True)
def _fresh_throttle():
    """Each test starts as if no retry had been logged yet (the throttle is per process)."""
    retry._logged.clear()


def test_success_builds_no_policy(monkeypatch):
    monkeypatch.setattr(retry, "call_policy", lambda *a, **k: pytest.fail("policy built for a call that succeeded"))
    assert retry.call(30, "read x", lambda: 42, ENDPOINTS) == 42


def test_answer_is_not_retried():
    calls = []

    def fn() -> None:
        calls.append(1)
        raise KeyError("a failed compare")

    with pytest.raises(KeyError):
        retry.call(30, "write x", fn, ENDPOINTS)
    assert len(calls) == 1


def test_transient_failure_is_logged_and_retried(caplog):
    caplog.set_level(logging.WARNING, logger="celery_etcdlock.etcd.retry")
    calls = []

    def fn() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise retry.Transient(ENDPOINTS[0], "connection refused")
        return "ok"

    assert retry.call(30, "read x", fn, ENDPOINTS) == "ok"
    assert len(calls) == 3
    assert "etcd read x failed" in caplog.text and "retry 1 in" in caplog.text
    assert "retry 2 in" not in caplog.text  # within LOG_EVERY of the first: counted, not logged


def test_retry_warnings_are_throttled_per_endpoint_and_the_give_up_is_logged(caplog, monkeypatch):
    caplog.set_level(logging.WARNING, logger="celery_etcdlock.etcd.retry")
    monkeypatch.setattr(retry, "LOG_EVERY", 0.3)
    monkeypatch.setattr(retry, "backoff", __import__("tenacity").wait_fixed(0.01))
    calls = []

    def fn() -> None:
        calls.append(1)
        raise retry.Transient(ENDPOINTS[0], "connection refused")

    with pytest.raises(BackendUnavailable) as raised:
        retry.call(1.0, "read x", fn, ENDPOINTS)
    lines = [r.getMessage() for r in caplog.records]
    retries = [line for line in lines if "failed" in line]
    assert len(calls) > 20 and 2 <= len(retries) <= 5, lines  # a few lines for dozens of failures
    assert "more failures not logged" in retries[-1]
    assert lines[-1].endswith("gave up") and "connection refused" in lines[-1]
    assert str(raised.value) == f"etcd unreachable at {ENDPOINTS[0]}: connection refused"  # the endpoint once


def test_max_delay_counts_from_the_first_attempt():
    calls = []

    def fn() -> None:
        calls.append(1)
        if len(calls) == 1:
            time.sleep(0.3)  # a first attempt that takes the whole max_delay: no second one
        raise retry.Transient(ENDPOINTS[0], "timed out")

    with pytest.raises(BackendUnavailable):
        retry.call(0.2, "read x", fn, ENDPOINTS)
    assert len(calls) == 1


def test_zero_max_delay_gives_up_after_one_attempt():
    calls = []

    def fn() -> None:
        calls.append(1)
        raise retry.Transient(ENDPOINTS[0], "connection refused")

    with pytest.raises(BackendUnavailable, match="connection refused"):
        retry.call(0, "read x", fn, ENDPOINTS)
    assert len(calls) == 1
