"""The fixed choices of `hetsched` options, as Enums: Typer checks them and lists them in `--help`.

The domain's own Enums where it has one (dtypes, engine hints). Each one that a contract also names has
the contract's values (tests/unit/test_cli_input.py holds them equal), so a value the CLI accepts is one
the service accepts.
"""

from __future__ import annotations

from enum import StrEnum

from shared.domain.admission.select import Hint as EngineHint  # ``AdmitRequest.hint``
from shared.domain.dtypes import Dtype  # ``PlaceRequest.dtype`` and ``kv_dtype``
from shared.domain.placement.listing import ReplicaState  # ``ReplicasRequest.state``

__all__ = [
    "Backend",
    "BadRows",
    "Dtype",
    "EngineHint",
    "RegionState",
    "ReplicaState",
    "ReservationPolicy",
    "SimPolicy",
    "SimSharing",
]


class Backend(StrEnum):
    """``PlaceRequest.backend``."""

    GPU = "gpu"
    TPU = "tpu"
    ANY = "any"


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
