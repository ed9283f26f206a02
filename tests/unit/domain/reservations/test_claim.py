"""What a new reservation may take (``claim``): named GPUs and their shared SKU and region, clashes counted
and never named, the free count of a request by count, and requests wrong before anything is read."""

from __future__ import annotations

import pytest

from shared.domain.errors import ErrorCode
from shared.domain.reservations import Claim, Refused, Slot, claim_count, claim_named, free, in_use, unclaimable


def slots(node: str, n: int, *, sku: str = "H100", region: str = "r1") -> dict[str, Slot]:
    return {
        f"{node}/gpu{i}": Slot(id=f"{node}/gpu{i}", node=node, sku=sku, region=region, cluster=f"{region}/c")
        for i in range(n)
    }


FLEET = slots("a", 4) | slots("b", 2) | slots("c", 2, sku="H200") | slots("d", 2, region="r2")


def test_named_gpus_share_a_sku_and_region_or_name_none() -> None:
    assert claim_named(["a/gpu0", "b/gpu1"], known=FLEET, taken=set(), used_by_others=set()) == Claim(
        ("a/gpu0", "b/gpu1"), "H100", "r1"
    )
    mixed = claim_named(["a/gpu0", "c/gpu0", "d/gpu0"], known=FLEET, taken=set(), used_by_others=set())
    assert mixed == Claim(("a/gpu0", "c/gpu0", "d/gpu0"), None, None)


def test_a_named_gpu_outside_the_fleet_is_not_found() -> None:
    refused = claim_named(["a/gpu0", "z/gpu0"], known=FLEET, taken=set(), used_by_others=set())
    assert isinstance(refused, Refused) and refused.code is ErrorCode.NOT_FOUND and "z/gpu0" in refused.message


@pytest.mark.parametrize(("taken", "others", "count"), [({"a/gpu0"}, set(), 1), ({"a/gpu0"}, {"a/gpu1"}, 2)])
def test_a_clash_counts_reserved_and_used_gpus_and_names_none(taken: set[str], others: set[str], count: int) -> None:
    refused = claim_named(["a/gpu0", "a/gpu1", "a/gpu2"], known=FLEET, taken=taken, used_by_others=others)
    assert refused == in_use(count, 3)
    assert isinstance(refused, Refused) and refused.code is ErrorCode.CONFLICT and "gpu" not in refused.message
    assert refused.details == {"in_use": count}


def test_by_count_takes_free_gpus_of_the_sku_and_region_whole_nodes_first() -> None:
    claim = claim_count(FLEET.values(), count=2, sku="H100", region="r1", taken=set(), used_by_others=set())
    assert claim == Claim(("b/gpu0", "b/gpu1"), "H100", "r1")


def test_by_count_short_of_gpus_says_how_many_are_free() -> None:
    taken, others = {"a/gpu0", "c/gpu0"}, {"b/gpu0", "d/gpu0"}
    assert free(FLEET.values(), sku="H100", region="r1", taken=taken, used_by_others=others) == 4
    refused = claim_count(FLEET.values(), count=5, sku="H100", region="r1", taken=taken, used_by_others=others)
    assert isinstance(refused, Refused) and refused.code is ErrorCode.NO_CAPACITY
    assert refused.details == {"free": 4} and refused.message.startswith("4 H100 GPU(s) in r1")
    assert isinstance(
        claim_count(FLEET.values(), count=4, sku="H100", region="r1", taken=taken, used_by_others=others), Claim
    )


@pytest.mark.parametrize(
    ("accelerators", "sku", "code"),
    [
        (None, "NOPE", ErrorCode.UNKNOWN_SKU),
        (["pod/0.1"], None, ErrorCode.INVALID_REQUEST),
        (["no-slash"], None, ErrorCode.INVALID_REQUEST),
        (None, "H100", None),
        (["a/gpu0"], "NOPE", None),  # named GPUs: the SKU is theirs, not the request's
    ],
)
def test_what_is_wrong_before_anything_is_read(
    accelerators: list[str] | None, sku: str | None, code: ErrorCode | None
) -> None:
    refused = unclaimable(accelerators, sku=sku, skus={"H100", "H200"})
    assert (refused.code if refused is not None else None) is code
