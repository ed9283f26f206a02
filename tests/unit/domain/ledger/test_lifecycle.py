"""Who may release or renew an allocation; the lease a renewal asks for."""

from __future__ import annotations

from datetime import timedelta

import pytest

from shared.domain.ledger import Access, AllocationRecord, AllocationState, may_change, renewal_end
from tests.unit.domain.ledger.builders import NOW


def record(*, tenant: str = "acme", state: AllocationState = AllocationState.ACTIVE) -> AllocationRecord:
    return AllocationRecord(
        id="al-1", request_id="r-1", tenant=tenant, kind="replica", state=state, lease_expires_at=NOW
    )


@pytest.mark.parametrize(
    ("allocation", "tenant", "access"),
    [
        (None, "acme", Access.NOT_FOUND),
        (record(), "acme", Access.OK),
        (record(), "globex", Access.FORBIDDEN),
        (record(state=AllocationState.RELEASED), "acme", Access.ENDED),
        (record(state=AllocationState.EXPIRED), "acme", Access.ENDED),
        (record(state=AllocationState.RELEASED), "globex", Access.FORBIDDEN),  # not even "it ended" to a stranger
        (record(), None, Access.OK),  # the ledger itself (the lease sweeper)
        (record(state=AllocationState.EXPIRED), None, Access.ENDED),
    ],
)
def test_may_change(allocation: AllocationRecord | None, tenant: str | None, access: Access) -> None:
    assert may_change(allocation, tenant=tenant) is access


def test_renewal_end() -> None:
    assert renewal_end(now=NOW, lease_s=120, lease_expires_at=None) == NOW + timedelta(seconds=120)
    later = NOW + timedelta(hours=1)
    assert renewal_end(now=NOW, lease_s=None, lease_expires_at=later) == later
    assert renewal_end(now=NOW, lease_s=None, lease_expires_at=NOW) is None  # ends now: already over
    assert renewal_end(now=NOW, lease_s=None, lease_expires_at=NOW - timedelta(seconds=1)) is None
