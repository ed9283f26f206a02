"""Element types of weights, KV cache and activations: the vocabulary the catalog, the memory model,
placement and the contracts share (bytes per element, the dtype a quantised model computes in)."""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from types import MappingProxyType
from typing import Final


class Dtype(StrEnum):
    """Every element type hetsched sizes memory for; ``contracts.placement.Dtype`` lists the same names."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"
    INT8 = "int8"
    INT4 = "int4"
    FP4 = "fp4"


DTYPE_BYTES: Final[Mapping[str, float]] = MappingProxyType(
    {Dtype.FP32: 4, Dtype.BF16: 2, Dtype.FP16: 2, Dtype.FP8: 1, Dtype.INT8: 1, Dtype.INT4: 0.5, Dtype.FP4: 0.5}
)
"""Bytes per element; sub-byte types are half a byte (the memory model rounds up once per tensor)."""


def dtype_bytes(name: str) -> float:
    """Bytes per element of ``name`` (``fp32`` 4, ``bf16``/``fp16`` 2, ``fp8``/``int8`` 1, ``int4``/``fp4`` 0.5)."""
    try:
        return DTYPE_BYTES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPE_BYTES)}") from None


def compute_dtype(dtype: str) -> str:
    """The dtype activations and recurrent state use for weights stored as ``dtype``.

    Quantised weights (fp8, int8, int4, fp4) still compute in 16-bit: bf16.
    """
    return dtype if dtype_bytes(dtype) >= 2 else Dtype.BF16.value
