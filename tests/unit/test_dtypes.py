"""One dtype vocabulary: the contracts, the memory model and the catalog parser name the same types."""

from __future__ import annotations

from typing import get_args

from shared.contracts.placement import Dtype as WireDtype
from shared.domain.dtypes import DTYPE_BYTES, Dtype, compute_dtype, dtype_bytes


def test_the_wire_names_every_dtype_and_no_other() -> None:
    assert get_args(WireDtype) == tuple(Dtype)


def test_every_dtype_has_a_width() -> None:
    assert set(DTYPE_BYTES) == set(Dtype)
    assert all(dtype_bytes(d) > 0 for d in Dtype)


def test_quantised_weights_compute_in_bf16() -> None:
    assert {d: compute_dtype(d) for d in Dtype if dtype_bytes(d) < 2} == dict.fromkeys(
        ("fp8", "int8", "int4", "fp4"), "bf16"
    )
