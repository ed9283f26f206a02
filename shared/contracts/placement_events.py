"""Deprecated (issue 24): the PLACEMENT stream's events live in ``shared.contracts.placement`` now. This
module re-exports them for one release so that existing imports keep working; import from there."""

from shared.contracts.placement import (
    PLACEMENT_DECIDED,
    PLACEMENT_REJECTED,
    PLACEMENT_RELEASED,
    PlacementEvent,
    PlacementEventName,
    PlacementReleasedEvent,
)

__all__ = [
    "PLACEMENT_DECIDED",
    "PLACEMENT_REJECTED",
    "PLACEMENT_RELEASED",
    "PlacementEvent",
    "PlacementEventName",
    "PlacementReleasedEvent",
]
