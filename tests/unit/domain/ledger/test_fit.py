"""check_fit: all or nothing, one reason per accelerator; an unavailable accelerator is refused as
unavailable, not as short (its `free` is 0)."""

from __future__ import annotations

import pytest

from shared.domain.ledger import Refusal, ShareRefusal, apply_shares, check_fit
from shared.domain.memory import MemoryShare
from tests.unit.domain.ledger.builders import GB, gpu, hbm, view

V = view(gpu("n/gpu0", usable_gb=80, reserved_gb=30), gpu("n/gpu1", usable_gb=80), gpu("n/gpu2", available=False))


@pytest.mark.parametrize(
    ("shares", "refusals"),
    [
        ([("n/gpu0", hbm(50))], ()),  # 30 + 50 = 80 GB: exactly full fits
        ([("n/gpu0", MemoryShare(50 * GB, 1, 0, 0))], (ShareRefusal("n/gpu0", Refusal.SHORT, 1),)),  # a byte over
        ([("n/gpu0", hbm(40)), ("n/gpu1", hbm(90))], (ShareRefusal("n/gpu1", Refusal.SHORT, 10 * GB),)),
        ([("n/gpu9", hbm(1))], (ShareRefusal("n/gpu9", Refusal.UNKNOWN),)),
        ([("n/gpu2", hbm(1))], (ShareRefusal("n/gpu2", Refusal.UNAVAILABLE),)),
        ([("n/gpu1", hbm(1)), ("n/gpu1", hbm(1))], (ShareRefusal("n/gpu1", Refusal.DUPLICATE),)),
    ],
)
def test_check_fit(shares: list[tuple[str, MemoryShare]], refusals: tuple[ShareRefusal, ...]) -> None:
    result = check_fit(V, shares)
    assert result.refusals == refusals
    assert result.ok == (not refusals)


def test_an_unavailable_accelerator_is_refused_as_unavailable_even_when_empty() -> None:
    empty_but_lost = view(gpu("n/gpu0", usable_gb=80, reserved_gb=0, available=False))
    assert empty_but_lost["n/gpu0"].free == 0
    result = check_fit(empty_but_lost, [("n/gpu0", hbm(1))])
    assert [r.reason for r in result.refusals] == [Refusal.UNAVAILABLE]
    assert result.describe() == "n/gpu0: unavailable"


def test_describe_says_by_how_much() -> None:
    result = check_fit(V, [("n/gpu0", hbm(53.2))])  # 3.2 GB over the 50 GB free
    assert result.describe() == "n/gpu0: HBM short by 3.20 GB"


def test_apply_shares_reserves_and_returns() -> None:
    shares = [("n/gpu0", hbm(10, kv_gb=5)), ("n/gpu1", hbm(1))]
    after = apply_shares(V, shares)
    assert after["n/gpu0"].reserved == 45 * GB and after["n/gpu1"].reserved == 1 * GB
    assert V["n/gpu0"].reserved == 30 * GB  # the input is not changed
    assert apply_shares(after, shares, sign=-1) == V
