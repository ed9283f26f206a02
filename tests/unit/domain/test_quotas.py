"""Per-tenant quotas (issue 23 row 7) and the queue's visiting order (row 4), pure: limits with overrides
(0 unlimited), the refusal at the boundary, the tally of what each tenant's replicas hold, round robin."""

from __future__ import annotations

import pytest

from shared.domain.placement.queue import round_robin
from shared.domain.quotas import Holdings, Quota, Quotas, exceeded, parse_overrides


def test_a_tenants_limit_is_its_override_else_the_setting_and_zero_is_unlimited() -> None:
    quotas = Quotas(
        limits={Quota.GPUS_PLACED: 16, Quota.QUEUED_REQUESTS: 0},
        overrides={"acme": {Quota.GPUS_PLACED: 64}, "globex": {Quota.GPUS_PLACED: 0}},
    )
    assert quotas.limit("acme", Quota.GPUS_PLACED) == 64
    assert quotas.limit("globex", Quota.GPUS_PLACED) is None  # its override: unlimited
    assert quotas.limit("initech", Quota.GPUS_PLACED) == 16
    assert quotas.limit("initech", Quota.QUEUED_REQUESTS) is None
    assert quotas.limit("initech", Quota.GPUS_RESERVED) is None  # not set at all


@pytest.mark.parametrize(
    ("used", "asked", "refused"),
    [
        (0, 16, False),  # 0 + 16 = 16: exactly the limit
        (15, 1, False),
        (16, 1, True),  # 17 > 16
        (10, 7, True),
        (20, 0, False),  # past a lowered limit, asking nothing new: kept
    ],
)
def test_a_request_is_refused_only_past_the_limit(used: int, asked: int, refused: bool) -> None:
    quotas = Quotas(limits={Quota.GPUS_RESERVED: 16})
    over = exceeded(quotas, "acme", Quota.GPUS_RESERVED, used=used, asked=asked)
    assert (over is not None) is refused
    if over is not None:
        assert over.details() == {"quota": "gpus_reserved", "limit": 16, "used": used, "asked": asked}
        assert "gpus_reserved" in over.message and "limit 16" in over.message and f"in use {used}" in over.message
        assert "HETSCHED_QUOTA_GPUS_RESERVED_PER_TENANT" in over.message


def test_overrides_name_known_quotas_with_limits_of_zero_or_more() -> None:
    assert parse_overrides({"acme": {"gpus_placed": 8, "queued_requests": 0}}) == {
        "acme": {Quota.GPUS_PLACED: 8, Quota.QUEUED_REQUESTS: 0}
    }
    with pytest.raises(ValueError, match="no quota 'gpus'"):
        parse_overrides({"acme": {"gpus": 8}})
    with pytest.raises(ValueError, match=">= 0"):
        parse_overrides({"acme": {"gpus_placed": -1}})


def test_holdings_count_each_accelerator_once_per_tenant() -> None:
    holdings = Holdings()
    holdings.add("al-1", "acme", ["n1/gpu0", "n1/gpu1"])
    holdings.add("al-2", "acme", ["n1/gpu1"])  # a shared GPU: still one
    holdings.add("al-1", "acme", ["n1/gpu0", "n1/gpu1"])  # the same allocation told twice
    holdings.add("al-3", "globex", ["n1/gpu1"])
    assert holdings.held("acme") == 2 and holdings.held("globex") == 1
    assert holdings.adds("acme", ["n1/gpu1", "n1/gpu2", "n1/gpu3"]) == 2
    holdings.end("al-2")
    assert holdings.held("acme") == 2  # gpu1 is still al-1's
    holdings.end("al-1")
    assert holdings.held("acme") == 0 and holdings.held("globex") == 1


def test_an_allocation_that_ended_is_not_counted_again_when_its_commit_is_told_late() -> None:
    holdings = Holdings()
    holdings.end("al-1")  # the release event came before the start-up load named it
    holdings.add("al-1", "acme", ["n1/gpu0"])
    assert holdings.held("acme") == 0


def test_holdings_forget_the_oldest_ends_past_the_bound() -> None:
    holdings = Holdings(ends_remembered=2)
    for allocation in ("al-1", "al-2", "al-3"):
        holdings.end(allocation)
    holdings.add("al-1", "acme", ["n1/gpu0"])  # forgotten: counted (a start-up load never names one this old)
    holdings.add("al-3", "acme", ["n1/gpu1"])  # remembered: not counted
    assert holdings.held("acme") == 1


def test_a_commit_in_flight_counts_until_it_is_confirmed_or_forgotten() -> None:
    holdings = Holdings()
    holdings.hold(1, "acme", ["n1/gpu0", "n1/gpu1"])
    holdings.hold(2, "acme", ["n1/gpu2"])
    assert holdings.held("acme") == 3
    holdings.forget(2)
    holdings.forget(2)  # idempotent
    assert holdings.held("acme") == 2
    holdings.confirm(1, "al-1")
    assert holdings.held("acme") == 2  # now the allocation's
    holdings.add("al-1", "acme", ["n1/gpu0", "n1/gpu1"])  # its event, after the answer
    holdings.end("al-1")
    assert holdings.held("acme") == 0


def test_the_queue_is_visited_round_robin_by_tenant_each_in_arrival_order() -> None:
    arrivals = ["acme:1", "acme:2", "acme:3", "globex:1", "acme:4", "initech:1", "globex:2"]
    order = round_robin(arrivals, tenant=lambda item: item.split(":")[0])
    # Turn 1: each tenant's first (tenants by their oldest); turn 2: the seconds; then acme's rest.
    assert order == ["acme:1", "globex:1", "initech:1", "acme:2", "globex:2", "acme:3", "acme:4"]
    assert round_robin([], tenant=str) == []
