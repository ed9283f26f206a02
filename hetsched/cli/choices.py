"""The fixed choices of `hetsched` options, as Enums: Typer checks them and lists them in `--help`.

Each one that a contract also names has the contract's values (tests/unit/test_cli_input.py holds
them equal), so a value the CLI accepts is one the service accepts.
"""

from __future__ import annotations

from enum import StrEnum


class Backend(StrEnum):
    """``PlaceRequest.backend``."""

    GPU = "gpu"
    TPU = "tpu"
    ANY = "any"


class Dtype(StrEnum):
    """``PlaceRequest.dtype`` and ``kv_dtype``."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"
    INT8 = "int8"
    INT4 = "int4"
    FP4 = "fp4"


class EngineHint(StrEnum):
    """``AdmitRequest.hint``."""

    AUTO = "auto"
    TRANSFORMER = "transformer"
    SSM = "ssm"
    MOE = "moe"


class RegionState(StrEnum):
    """``RouteRegionRequest.state``."""

    UP = "up"
    DRAIN = "drain"
    DOWN = "down"


class ReservationPolicy(StrEnum):
    """``ReservationCreateRequest.policy`` (docs/RESERVATIONS.md)."""

    SOFT = "soft"
    HARD = "hard"
    SPOT = "spot"


class SimPolicy(StrEnum):
    """The simulator's placement policies (``shared.domain.sim.POLICIES``)."""

    HETSCHED = "hetsched"
    GPU_INDEX = "gpu-index"
    RANDOM = "random"
    FIRST_FIT = "first-fit"
    CHEAPEST_SKU = "cheapest-sku"


class SimSharing(StrEnum):
    """`hetsched sim --sharing`: every replica exclusive, small models shared, or both side by side."""

    EXCLUSIVE = "exclusive"
    SHARED = "shared"
    COMPARE = "compare"


class BadRows(StrEnum):
    """`hetsched sim --bad-rows`: a bad trace row stops the run naming it, or is left out and counted."""

    REJECT = "reject"
    SKIP = "skip"
