"""Deciding a placement on the view: the view placement reads (``View``), and the snapshot as a tenant may
use it (other tenants' reservations, the rebalancer's avoided and throttled accelerators withheld)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Protocol

from services.placement.metrics import PlacementMetrics
from shared.contracts.placement import PlaceRequest
from shared.domain.placement import decide
from shared.domain.placement.types import Decision, FleetSnapshot
from shared.domain.placement.view import AssumeKey, Crossing
from shared.domain.placement.withhold import withhold
from shared.domain.reservations import ReservationBook
from shared.infra.clock import MonotonicMs
from shared.infra.fleet_view import to_domain

WITHHELD_KEPT = 4096
"""Tenants' withheld sets kept (per tenant and preemptibility, until the reservation book changes)."""


class View(Protocol):
    """What the use cases need of the read model."""

    @property
    def snapshot(self) -> FleetSnapshot: ...

    def assume(
        self, key: AssumeKey, held: Mapping[str, int], *, shared: bool = False, crossing: Crossing | None = None
    ) -> int: ...

    def confirm(self, token: int, allocation_id: str) -> None: ...

    def forget(self, token: int) -> None: ...


class Decider:
    """Decides a request on a snapshot, as its tenant may use it, and counts how long that took."""

    def __init__(
        self,
        *,
        reservations: ReservationBook,
        throttled: Callable[[], set[str]],
        timer: MonotonicMs,
        metrics: PlacementMetrics,
    ) -> None:
        # Reservations as the RESERVATION stream tells them (the read model's fold): what a tenant may not use.
        self._reservations = reservations
        self._throttled_nodes = throttled  # nodes the rebalancer throttles (REBALANCE events)
        self._timer = timer
        self._metrics = metrics
        self._withheld: dict[tuple[str, bool], tuple[int, frozenset[str]]] = {}

    def rights(self, snapshot: FleetSnapshot, request: PlaceRequest) -> FleetSnapshot:
        """The snapshot as this tenant may use it: other tenants' reserved GPUs withheld, except those a
        soft or spot reservation lends now when the replica is preemptible."""
        if request.avoid_accelerators:  # the rebalancer moving a replica off them
            snapshot = withhold(snapshot, request.avoid_accelerators)
        throttled = self._throttled_nodes()
        if throttled:  # a node whose PCIe the rebalancer throttles takes no new replica (a cold start)
            snapshot = withhold(
                snapshot,
                (
                    snapshot.nodes[n].accelerator_id(a.index)
                    for n in throttled
                    if n in snapshot.nodes
                    for a in snapshot.nodes[n].accelerators
                ),
            )
        if self._reservations.empty:
            return snapshot
        key = (request.tenant, request.preemptible)
        cached = self._withheld.get(key)
        if cached is None or cached[0] != self._reservations.version:
            if len(self._withheld) > WITHHELD_KEPT:
                self._withheld.clear()
            cached = (
                self._reservations.version,
                self._reservations.withheld(request.tenant, preemptible=request.preemptible),
            )
            self._withheld[key] = cached
        return withhold(snapshot, cached[1]) if cached[1] else snapshot

    def decide(self, snapshot: FleetSnapshot, request: PlaceRequest) -> tuple[Decision, float]:
        """The decision on what this tenant may use, and the milliseconds it took."""
        started = self._timer()
        rights = self.rights(snapshot, request)
        decision = decide(rights, to_domain(request))
        held = self._withheld.get((request.tenant, request.preemptible))
        if not decision.placed and held is not None and held[1] and not self._reservations.empty:
            withheld = held[1]
            note = f"{len(withheld)} GPU(s) reserved by other tenants were not considered" + (
                "" if request.preemptible else " (a preemptible replica may borrow those their owners lend)"
            )
            decision = replace(decision, explanation=(*decision.explanation, note))
        elapsed_ms = self._timer() - started
        self._metrics.decided(elapsed_ms)
        return decision, elapsed_ms
