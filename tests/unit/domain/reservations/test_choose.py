"""``choose``: which accelerators a ``count`` + ``sku`` + ``region`` reservation takes. Whole nodes first
(an owner's TP groups stay inside one NVLink domain), never one another reservation holds or another
tenant uses, only the SKU and region asked, and None when there are not enough."""

from __future__ import annotations

import pytest

from shared.domain.reservations import Slot, choose

H100 = "H100-SXM-80GB"
A100 = "A100-SXM-80GB"


def slots(node: str, n: int, sku: str = H100, region: str = "us-west-1") -> list[Slot]:
    return [Slot(f"{node}/gpu{i}", node, sku, region, "c1") for i in range(n)]


def gpus(node: str, *indexes: int) -> list[str]:
    return [f"{node}/gpu{i}" for i in indexes]


# us-west-1: n1 and n2 with 8 H100, n3 with 4 H100, n4 with 8 A100; eu-west-1: n5 with 8 H100.
INVENTORY = [
    *slots("n1", 8),
    *slots("n2", 8),
    *slots("n3", 4),
    *slots("n4", 8, A100),
    *slots("n5", 8, region="eu-west-1"),
]
BY_ID = {s.id: s for s in INVENTORY}
ALL8 = range(8)

CASES = [
    # (id, count, sku, region, taken, used_by_others, expected)
    ("a whole node", 8, H100, "us-west-1", [], [], gpus("n1", *ALL8)),
    ("the 4-GPU node whole rather than half of an 8", 4, H100, "us-west-1", [], [], gpus("n3", 0, 1, 2, 3)),
    ("two whole nodes", 16, H100, "us-west-1", [], [], gpus("n1", *ALL8) + gpus("n2", *ALL8)),
    # n1 whole (8), then 2 more from the smallest node that has 2: n3 (4) before n2 (8).
    ("whole nodes, then the smallest remainder", 10, H100, "us-west-1", [], [], gpus("n1", *ALL8) + gpus("n3", 0, 1)),
    (
        "every H100 of the region",
        20,
        H100,
        "us-west-1",
        [],
        [],
        gpus("n1", *ALL8) + gpus("n2", *ALL8) + gpus("n3", *range(4)),
    ),
    ("one more than there are", 21, H100, "us-west-1", [], [], None),
    # n1/gpu0 is another reservation's: n1 has 7, n2 is the whole node.
    ("a node another reservation touches is not whole", 8, H100, "us-west-1", ["n1/gpu0"], [], gpus("n2", *ALL8)),
    (
        "taken nodes leave the rest",
        12,
        H100,
        "us-west-1",
        gpus("n1", *ALL8),
        [],
        gpus("n2", *ALL8) + gpus("n3", *range(4)),
    ),
    # n1 and n2 each have 7 free (another tenant on n1/gpu0 and n2/gpu3): n1's 7, then 1 from n3.
    (
        "used by another tenant",
        8,
        H100,
        "us-west-1",
        [],
        ["n1/gpu0", "n2/gpu3"],
        gpus("n1", 1, 2, 3, 4, 5, 6, 7) + gpus("n3", 0),
    ),
    ("taken and used together leave too few", 8, H100, "us-west-1", gpus("n1", *ALL8), gpus("n2", *range(5)), None),
    ("the SKU asked", 8, A100, "us-west-1", [], [], gpus("n4", *ALL8)),
    ("not enough of the SKU although enough GPUs", 9, A100, "us-west-1", [], [], None),
    ("the region asked", 3, H100, "eu-west-1", [], [], gpus("n5", 0, 1, 2)),
    ("a SKU the region does not have", 1, A100, "eu-west-1", [], [], None),
    ("an unknown SKU", 1, "B200", "us-west-1", [], [], None),
]


@pytest.mark.parametrize(
    ("count", "sku", "region", "taken", "used", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_choose(
    count: int, sku: str, region: str, taken: list[str], used: list[str], expected: list[str] | None
) -> None:
    chosen = choose(INVENTORY, count=count, sku=sku, region=region, taken=set(taken), used_by_others=set(used))
    if expected is None:
        assert chosen is None
        return
    assert chosen is not None
    assert sorted(chosen) == sorted(expected)
    # What holds for any answer, whatever the order of preference:
    assert len(chosen) == count == len(set(chosen))
    assert not set(chosen) & (set(taken) | set(used))
    assert all(BY_ID[a].sku == sku and BY_ID[a].region == region for a in chosen)


def test_choose_does_not_depend_on_the_inventory_order() -> None:
    for _, count, sku, region, taken, used, _expected in CASES:
        forward = choose(INVENTORY, count=count, sku=sku, region=region, taken=set(taken), used_by_others=set(used))
        backward = choose(
            list(reversed(INVENTORY)), count=count, sku=sku, region=region, taken=set(taken), used_by_others=set(used)
        )
        assert (sorted(forward) if forward else None) == (sorted(backward) if backward else None)
