"""Per-key quotas (``shared.domain.gateway.quota``): requests and tokens per minute."""

from __future__ import annotations

import math

from shared.domain.gateway.quota import Quota, retry_after


def test_requests_per_minute_refill_continuously() -> None:
    quota = Quota(rpm=2, tpm=None)
    assert quota.admit(10, 100.0) is None and quota.admit(10, 100.0) is None
    wait = quota.admit(10, 100.0)
    assert wait is not None and math.isclose(wait, 30.0)  # one request every 30 s
    assert quota.admit(10, 129.0) is not None
    assert quota.admit(10, 130.0) is None


def test_tokens_per_minute_and_a_request_larger_than_the_minute() -> None:
    quota = Quota(rpm=None, tpm=1000)
    assert quota.admit(600, 0.0) is None
    wait = quota.admit(600, 0.0)
    assert wait is not None and math.isclose(wait, 12.0)  # 200 more tokens at 1000/min
    assert quota.admit(1001, 0.0) == math.inf
    assert retry_after(0.2) == 1 and retry_after(12.0) == 12


def test_a_refused_request_takes_nothing() -> None:
    quota = Quota(rpm=1, tpm=100)
    assert quota.admit(200, 0.0) == math.inf
    assert quota.admit(50, 0.0) is None  # the refused one took neither its request nor its tokens


def test_no_limits_admit_everything() -> None:
    quota = Quota(rpm=None, tpm=None)
    assert all(quota.admit(10**6, 0.0) is None for _ in range(100))
