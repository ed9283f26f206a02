"""Placement's own view of the fleet, a pure fold kept by the kit's read side (``shared.infra.follow``;
what is followed and where each event goes: ``services.placement.follows``): seeded from `fleet.get` and
`ledger.snapshot` (paged RPC) and kept current from the TOPOLOGY and LEDGER streams, with each node's PCIe
utilisation from GPU telemetry (the TELEMETRY stream, ``HETSCHED_PLACEMENT_PCIE_WINDOW_S``: see
``shared.domain.placement.view.PcieWindow``; a node counts as busy only once placement has watched it for a
whole window, from its start or resync on); the reservations (RESERVATION, folded from its first sequence)
and the rebalancer's throttles and draining replicas (REBALANCE). No other service's tables are read.

The kit starts the feeds before the seed and applies what they buffered on top of it, so a sync cannot
miss an event between the snapshots and the streams; an event the snapshots already hold changes nothing
(the fold in ``shared.domain.placement.view`` counts each allocation once per accelerator).

How stale the view may be is reported in placement's health (check ``view``): ``ok`` while every event
older than ``HETSCHED_PLACEMENT_STALE_AFTER_MS`` is applied; otherwise how many events wait and how old
the newest applied one is. A stale view costs a retry, never an over-commit: the ledger checks every
commit against its own rows. ``HETSCHED_PLACEMENT_REFRESH_MS`` > 0 re-seeds the whole view that often
(off by default: the streams keep it current).
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Callable, Mapping
from datetime import datetime

from pydantic import BaseModel, ValidationError

from shared.contracts.base import Rejected
from shared.contracts.fleet import FleetDescribeReply, FleetDescribeRequest
from shared.contracts.ledger import LedgerEventName
from shared.contracts.rebalance import (
    NodeThrottleEvent,
    PlanEvent,
    ReplicaDrainingEvent,
)
from shared.contracts.reservation import ReservationEvent
from shared.contracts.subjects import Rpc
from shared.contracts.topology import NodeProfilePayload, TopologyEventName
from shared.domain.hardware import Sku
from shared.domain.models import ModelSpec
from shared.domain.placement.filters.demand import fleet_regions
from shared.domain.placement.types import FleetSnapshot
from shared.domain.placement.view import DEFAULT_PCIE_WINDOW_S, AssumeKey, Crossing, FleetView
from shared.domain.reservations import ReservationBook
from shared.infra.clock import Clock
from shared.infra.fleet_view import apply_event, view_from
from shared.infra.reservations import reservation_of
from shared.infra.rpc import RpcClient

# Events after which capacity may have freed: the queue is retried once the view holds them.
FREEING = frozenset(
    {
        LedgerEventName.ALLOCATION_RELEASED,
        LedgerEventName.ALLOCATION_EXPIRED,
        LedgerEventName.CAPACITY_CHANGED,
        TopologyEventName.NODE_PROFILED,
        TopologyEventName.NODE_CHANGED,
        TopologyEventName.NODE_RECOVERED,
    }
)
DESCRIBE_AT_ONCE = 8


class SyncError(Exception):
    """A snapshot the view is seeded from could not be had."""


class ReadModel:
    """The view decisions read: the fleet (``view``), the reservations (``book``), the rebalancer's throttled
    nodes and draining replicas. Folds are synchronous and do no IO; ``load`` fetches the seed."""

    def __init__(
        self,
        *,
        rpc: RpcClient,
        skus: Mapping[str, Sku],
        models: Mapping[str, ModelSpec],
        clock: Clock,
        log: logging.Logger,
        resync_ms: int = 0,
        pcie_window_s: float = DEFAULT_PCIE_WINDOW_S,
    ) -> None:
        self._rpc = rpc
        self._skus = dict(skus)
        self._models = dict(models)
        self._clock = clock
        self._log = log
        self.resync_s = resync_ms / 1000
        self._pcie_window_s = pcie_window_s
        self.view = FleetView(skus=self._skus, models=self._models, pcie_window_s=pcie_window_s)
        self.synced_at: datetime | None = None
        self.book = ReservationBook()
        self.throttled: set[str] = set()
        self.draining: set[str] = set()
        self._regions_of: FleetSnapshot | None = None
        self._regions: frozenset[str] = frozenset()

    # -- what decisions use ----------------------------------------------------------------------

    @property
    def snapshot(self) -> FleetSnapshot:
        return self.view.snapshot

    def regions(self) -> frozenset[str]:
        """The fleet's regions, lost nodes' included (what a request may name); worked out again only when
        the snapshot is a new one."""
        snapshot = self.view.snapshot
        if self._regions_of is not snapshot:
            self._regions_of, self._regions = snapshot, fleet_regions(snapshot)
        return self._regions

    def assume(
        self, key: AssumeKey, held: Mapping[str, int], *, shared: bool = False, crossing: Crossing | None = None
    ) -> int:
        return self.view.assume(key, held, shared=shared, crossing=crossing)

    def confirm(self, token: int, allocation_id: str) -> None:
        self.view.confirm(token, allocation_id)

    def forget(self, token: int) -> None:
        self.view.forget(token)

    def knows_node(self, name: str) -> bool:
        """Whether ``name`` is a node or TPU pod of the fleet view (True until the view first synced: it
        cannot tell yet)."""
        return self.synced_at is None or name in self.view.profiles or name in self.view.pods

    def holds(self, allocation_id: str) -> bool:
        """The view still counts this allocation's bytes."""
        return self.view.ledger.holds(allocation_id)

    # -- folds -----------------------------------------------------------------------------------

    def apply(self, name: str, payload: BaseModel, at: datetime) -> None:
        """One TOPOLOGY, LEDGER or TELEMETRY (gpu) event into the fleet view."""
        try:
            apply_event(self.view, name, payload, at=at)
        except ValueError as exc:  # e.g. a profile whose link matrix does not match its GPUs
            self._log.warning("ignoring an event the view cannot apply", extra={"type": name, "error": str(exc)})

    def reservation(self, payload: ReservationEvent) -> bool:
        """A reservation's whole state; whether the book changed."""
        return self.book.apply(reservation_of(payload.reservation))

    def throttle(self, payload: NodeThrottleEvent, *, on: bool) -> None:
        """The rebalancer throttles a node's PCIe (no new replica: a cold start would load its weights over
        a saturated link), or ended it."""
        if on:
            self.throttled.add(payload.node)
        else:
            self.throttled.discard(payload.node)

    def preempted(self) -> dict[str, datetime]:
        """Borrowed replicas told to leave (a reservation's preemptions): allocation id -> the deadline."""
        return {p.allocation_id: p.deadline_at for reservation in self.book.active() for p in reservation.preemptions}

    def replica_draining(self, payload: ReplicaDrainingEvent) -> None:
        """Admission sends a draining replica nothing new."""
        self.draining.add(payload.allocation_id)

    def plan_finished(self, payload: PlanEvent) -> None:
        self.draining.difference_update(step.allocation_id for step in payload.plan.steps)

    # -- the seed --------------------------------------------------------------------------------

    async def load(self) -> Callable[[], None]:
        """Fetch the snapshots and build a view from them; what it returns makes it the view (decisions
        whose commits are in flight stay counted)."""
        view = await self._seed()

        def install() -> None:
            view.adopt(self.view)
            self.view = view
            # The view is long-lived and large (a fleet of 1,024 nodes is about a million objects): kept out
            # of the cyclic collector's full passes, each of which would otherwise stall the loop ~100 ms.
            gc.collect()
            gc.freeze()
            self.synced_at = self._clock()
            self._log.info(
                "placement synced its fleet view",
                extra={"nodes": len(view.profiles), "accelerators": len(view.ledger.usable), "pods": len(view.pods)},
            )

        return install

    async def _seed(self) -> FleetView:
        fleet = await self._rpc.fleet(profiles=True)
        if isinstance(fleet, Rejected):
            raise SyncError(f"fleet.get refused: {fleet.error.message}")
        ledger = await self._rpc.ledger_snapshot()
        if isinstance(ledger, Rejected):
            raise SyncError(f"ledger.snapshot refused: {ledger.error.message}")
        profiles = {n.name: n.profile for n in fleet.nodes if n.profile is not None}
        profiles.update(await self._describe([n.name for n in fleet.nodes if n.profile is None]))
        return view_from(
            fleet=fleet,
            profiles=profiles,
            ledger=ledger,
            skus=self._skus,
            models=self._models,
            pcie_window_s=self._pcie_window_s,
        )

    async def _describe(self, names: list[str]) -> dict[str, NodeProfilePayload]:
        """Profiles ``fleet.get`` did not send (a topology service that ignores ``profiles``), one by one."""
        gate = asyncio.Semaphore(DESCRIBE_AT_ONCE)

        async def one(name: str) -> tuple[str, NodeProfilePayload | None]:
            async with gate:
                reply = await self._rpc.ask(Rpc.FLEET_DESCRIBE, FleetDescribeRequest(node=name), FleetDescribeReply)
            if isinstance(reply, Rejected):
                return name, None  # gone since fleet.get: its events follow
            try:
                return name, NodeProfilePayload.model_validate(reply.profile)
            except ValidationError:
                return name, None

        found = await asyncio.gather(*(one(name) for name in names))
        return {name: profile for name, profile in found if profile is not None}
