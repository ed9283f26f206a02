"""An unknown name's refusal lists the known names, the closest first, and offers the closest one."""

from __future__ import annotations

import pytest

from shared.domain.names import LISTED, closest_first, unknown_name

SKUS = ("H100-SXM-80GB", "H100-PCIE-80GB", "H200-SXM-141GB", "GH200-96GB", "L40S-48GB", "TPU-V5E")
REGIONS = ("us-west-1", "us-east-1", "eu-west-1")


@pytest.mark.parametrize(
    ("given", "names", "close"),
    [
        # begins a name (tier 0), then holds it (tier 1): "H200" -> H200-SXM-141GB, then GH200-96GB
        ("H200", SKUS, ["H200-SXM-141GB", "GH200-96GB"]),
        ("h100", SKUS, ["H100-SXM-80GB", "H100-PCIE-80GB"]),  # case-insensitive; the more similar one first
        # difflib's ratio >= 0.6: 'us-west-2' ~ us-west-1 (8/9 = 0.89), then the two at 6/9 = 0.67
        ("us-west-2", REGIONS, ["us-west-1", "eu-west-1", "us-east-1"]),
        ("atlantis", REGIONS, []),
        ("", REGIONS, []),
    ],
)
def test_the_closest_names_come_first(given: str, names: tuple[str, ...], close: list[str]) -> None:
    found, rest = closest_first(given, names)
    assert found == close
    assert rest == sorted(set(names) - set(close))


def test_the_message_offers_the_closest_and_lists_every_known_name() -> None:
    assert unknown_name("SKU", "H200", SKUS) == (
        "unknown SKU 'H200' (did you mean 'H200-SXM-141GB'?); known: H200-SXM-141GB, GH200-96GB, "
        "H100-PCIE-80GB, H100-SXM-80GB, L40S-48GB, TPU-V5E"
    )
    assert (
        unknown_name("region", "mars-1", REGIONS) == "unknown region 'mars-1'; known: eu-west-1, us-east-1, us-west-1"
    )
    assert unknown_name("model", "x", [], prefix="no model or model group 'x'") == (
        "no model or model group 'x'; no model is known yet"
    )


def test_a_long_list_is_cut_and_the_callers_name_is_echoed_short() -> None:
    names = [f"model-{i:03d}" for i in range(LISTED + 5)]
    message = unknown_name("model", "z" * 500, names)
    assert message.startswith("unknown model '" + "z" * 80 + "'; known: model-000, ")
    assert message.endswith(f"model-{LISTED - 1:03d} and 5 more")
