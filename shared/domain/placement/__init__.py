"""The pure placement core (DESIGN §4 "Placement pipeline"): a scheduling framework of small
plugins over a fleet snapshot, ``decide`` for one replica, ``milp`` for an exact batch reference."""

from shared.domain.placement.decide import decide, explain
from shared.domain.placement.framework import DEFAULT_PROFILE, Profile
from shared.domain.placement.registry import DEFAULT_REGISTRY
from shared.domain.placement.types import (
    AcceleratorCapacity,
    Decision,
    FleetSnapshot,
    PlacementRequest,
    RejectionClass,
    Slo,
    TpuPlacement,
    TpuPodState,
    apply,
)

__all__ = [
    "DEFAULT_PROFILE",
    "DEFAULT_REGISTRY",
    "AcceleratorCapacity",
    "Decision",
    "FleetSnapshot",
    "PlacementRequest",
    "Profile",
    "RejectionClass",
    "Slo",
    "TpuPlacement",
    "TpuPodState",
    "apply",
    "decide",
    "explain",
]
