"""A repeated commit of an allocation that has ended: refused, never answered as committed (a retry of
``placement/<id>`` must not learn of a reservation that holds nothing)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from shared.domain.errors import ErrorCode
from shared.domain.ledger import Duplicate, ExistingAllocation, Refused, plan_commits
from tests.unit.domain.ledger.builders import NOW, gpu, hbm, intent, view

V = view(gpu("n/gpu0", usable_gb=80))


@pytest.mark.parametrize("state", ["released", "expired"])
def test_a_repeat_of_an_ended_allocation_is_a_conflict(state: str) -> None:
    stored = ExistingAllocation("al-9", NOW - timedelta(minutes=1), (("n/gpu0", hbm(2)),), state=state)
    outcome = plan_commits(
        [intent(("n/gpu0", hbm(2)), rid="r-9")],
        view=V,
        existing={("acme", "r-9"): stored},
        now=NOW,
        default_lease_s=60,
    ).outcomes[0]
    assert isinstance(outcome, Refused) and outcome.code is ErrorCode.CONFLICT
    assert "al-9" in outcome.message and state in outcome.message


def test_a_repeat_of_an_active_allocation_is_still_a_duplicate() -> None:
    stored = ExistingAllocation("al-9", NOW + timedelta(minutes=1), (("n/gpu0", hbm(2)),))
    outcome = plan_commits(
        [intent(("n/gpu0", hbm(2)), rid="r-9")],
        view=V,
        existing={("acme", "r-9"): stored},
        now=NOW,
        default_lease_s=60,
    ).outcomes[0]
    assert isinstance(outcome, Duplicate) and outcome.allocation_id == "al-9"
