"""Where the console's fleet pages get their data (`/api/summary`, `/api/nodes`, `/api/node`), kept cheap on a
fleet of thousands of GPUs:

- the fleet (``fleet.get``, without profiles) is asked again only when topology publishes an event (a node
  profiled, changed, lost, recovered, removed) or after ``FLEET_MAX_AGE_S``; in between, its ``FleetIndex``
  is reused;
- each collection asks the ledger's snapshot, the reservations and the rebalancer, folds them onto the index
  in one pass (``FleetView``) and serialises the summary once; requests arriving while it runs share it, and
  a collection younger than ``REUSE_S`` answers the next request as is;
- a node's NVLink link matrix (``fleet.describe``) is asked when its drill-down is opened, and kept while the
  fleet does not change."""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from hetsched.console.feed import PlacementFeed
from hetsched.console.fleetview import FleetIndex, FleetView, Holdings, summary_document
from hetsched.console.state import answer_of, rebalancer_of, reservations_of, reservations_summary
from shared.contracts.fleet import FleetDescribeReply, FleetDescribeRequest, FleetGetReply
from shared.contracts.ledger import SnapshotReply
from shared.contracts.subjects import Rpc
from shared.contracts.topology import NodeProfilePayload
from shared.infra.rpc import RpcClient

FLEET_MAX_AGE_S = 30.0  # the fleet is asked again at least this often, topology event or not
REUSE_S = 0.5  # a collection this young answers the next request without asking the services again
DETAIL_MAX_AGE_S = 2.0  # a group's nodes and a node's GPUs are read from a collection at most this old
PROFILES_KEPT = 256  # link matrices of the nodes opened last


@dataclass(frozen=True)
class Collected:
    """One collection: the fleet view (None until the fleet has answered once) and the summary's JSON."""

    view: FleetView | None
    summary: bytes
    at: float  # monotonic seconds
    errors: dict[str, str]


class FleetSource:
    def __init__(
        self,
        rpc: RpcClient,
        *,
        now: Callable[[], datetime],
        feed: PlacementFeed | None = None,
        extra: dict[str, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._rpc = rpc
        self._now = now
        self._feed = feed
        self._extra = extra or {}
        self._clock = clock
        self._index: FleetIndex | None = None
        self._fleet_at = float("-inf")
        self._fleet_dirty = True
        self._version = 0
        self._last: Collected | None = None
        self._running: asyncio.Task[Collected] | None = None
        self._profiles: OrderedDict[str, tuple[int, NodeProfilePayload | None]] = OrderedDict()

    def fleet_changed(self) -> None:
        """Topology published an event: the next collection asks for the fleet again."""
        self._fleet_dirty = True

    async def current(self, *, max_age_s: float = REUSE_S) -> Collected:
        """The last collection if it is at most ``max_age_s`` old, else a new one (shared by the requests
        that arrive while it runs)."""
        last = self._last
        if last is not None and self._clock() - last.at <= max_age_s:
            return last
        if self._running is None or self._running.done():
            self._running = asyncio.create_task(self._collect())
        return await asyncio.shield(self._running)

    async def _fleet(self, errors: dict[str, str]) -> FleetIndex | None:
        fresh = not self._fleet_dirty and self._clock() - self._fleet_at <= FLEET_MAX_AGE_S
        if self._index is not None and fresh:
            return self._index
        self._fleet_dirty = False  # an event arriving while this runs marks it again
        reply = await answer_of(errors, "fleet", self._rpc.fleet, FleetGetReply)
        if reply is None:
            self._fleet_dirty = True
            return self._index  # the last fleet known; `errors` says it could not be refreshed
        self._version += 1
        self._index = FleetIndex.of(reply, version=self._version)
        self._fleet_at = self._clock()
        return self._index

    async def _collect(self) -> Collected:
        started = self._clock()
        version = self._version
        errors: dict[str, str] = {}
        index, ledger, (report, statuses), rebalancer = await asyncio.gather(
            self._fleet(errors),
            answer_of(errors, "ledger", self._rpc.ledger_snapshot, SnapshotReply),
            reservations_of(self._rpc, errors),
            rebalancer_of(self._rpc, errors),
        )
        asked = self._clock()
        view = FleetView.of(index, ledger, Holdings.of(statuses, rebalancer)) if index is not None else None
        placements = self._feed.placements() if self._feed is not None else []
        if self._feed is not None and self._feed.problem:
            errors["placements"] = self._feed.problem
        shown = [row["allocation_id"] for row in placements if row.get("allocation_id")]
        document = summary_document(
            view,
            now=self._now(),
            errors=errors,
            reservations=reservations_summary(report, statuses),
            rebalancer=rebalancer,
            placements=placements,
            allocations=self._feed.labels(shown) if self._feed is not None else {},
            cross_domain_used=ledger.cross_domain_used if ledger is not None else {},
        )
        # What this collection cost: asking the services, then folding and serialising.
        document["timing"] = {
            "ask_ms": round((asked - started) * 1000, 1),
            "fold_ms": 0.0,
            "fleet_asked": self._version != version,  # False: the fleet's index was reused
        }
        document.update(self._extra)
        document["timing"]["fold_ms"] = round((self._clock() - asked) * 1000, 1)
        collected = Collected(view, json.dumps(document).encode(), self._clock(), errors)
        self._last = collected
        return collected

    async def profile(self, node: str, version: int) -> NodeProfilePayload | None:
        """The node's profile (its link matrix) from ``fleet.describe``, kept while the fleet is unchanged;
        None when topology cannot say (the drill-down then shows the GPUs without NVLink edges)."""
        kept = self._profiles.get(node)
        if kept is not None and kept[0] == version:
            self._profiles.move_to_end(node)
            return kept[1]
        errors: dict[str, str] = {}
        reply = await answer_of(
            errors,
            "profile",
            lambda: self._rpc.ask(Rpc.FLEET_DESCRIBE, FleetDescribeRequest(node=node), FleetDescribeReply),
            FleetDescribeReply,
        )
        profile = None
        if reply is not None:
            try:
                profile = NodeProfilePayload.model_validate(reply.profile)
            except ValueError:
                profile = None
        self._profiles[node] = (version, profile)
        self._profiles.move_to_end(node)
        while len(self._profiles) > PROFILES_KEPT:
            self._profiles.popitem(last=False)
        return profile

    def labels(self, allocation_ids: list[str]) -> dict[str, dict[str, Any]]:
        return self._feed.labels(allocation_ids) if self._feed is not None else {}
