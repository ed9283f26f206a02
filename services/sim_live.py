"""`hetsched sim --live`: the simulation asks a running stack's `placement.place` for every replica it
needs (so the stack's real decisions, ledger commits and conflicts are exercised) and releases them
through `placement.release` when the simulation retires them.

The simulated fleet (`--fleet`) must be the fleet the stack serves: a live placement is applied to the
simulation's own view, and one that does not fit it is released again and counted as a refusal.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import nats

from shared.contracts.subjects import Rpc, Subjects
from shared.domain.memory import MemoryShare
from shared.domain.placement import Decision, FleetSnapshot, PlacementRequest, TpuPlacement, apply
from shared.domain.placement.types import chip_id
from shared.domain.topology.tpu import TpuSlice


def to_decision(request_id: str, reply: dict[str, Any]) -> Decision:
    """A `placement.place` reply as the domain's Decision (what the simulation applies)."""
    if reply.get("status") != "placed":
        error = reply.get("error") or {}
        return Decision(
            request_id=request_id,
            status="rejected",
            error_code=error.get("code", "no_capacity"),
            message=error.get("message", ""),
            explanation=tuple(reply.get("explanation", [])),
        )
    hbm = reply["hbm_per_accelerator"]
    share = MemoryShare(weights=hbm["weights"], kv=hbm["kv"], activation=hbm["activation"], workspace=hbm["workspace"])
    tpu = None
    accelerators: tuple[str, ...] = tuple(a for p in reply.get("placements", []) for a in p["accelerators"])
    if reply.get("tpu_slice"):
        block = reply["tpu_slice"]
        chips = tuple(
            chip_id(block["pod"], c) for c in TpuSlice(tuple(block["origin"]), tuple(block["shape"])).coords()
        )
        tpu = TpuPlacement(pod=block["pod"], origin=tuple(block["origin"]), shape=tuple(block["shape"]), chips=chips)
        accelerators = chips
    first = (reply.get("placements") or [{}])[0]
    return Decision(
        request_id=request_id,
        status="placed",
        backend=reply.get("backend"),
        region=reply.get("region"),
        cluster=reply.get("cluster"),
        node=first.get("node"),
        nodes=tuple(p["node"] for p in reply.get("placements", [])),
        sku=reply.get("sku"),
        tp=reply.get("tp"),
        accelerators=accelerators,
        domain=first.get("domain"),
        share=share,
        tpu=tpu,
        score=reply.get("score", {}),
        explanation=tuple(reply.get("explanation", [])),
    )


class LivePolicy:
    """Decides by asking the stack; blocking calls on a private event loop (the simulation is synchronous)."""

    name = "hetsched-live"

    def __init__(self, *, nats_url: str, subjects: Subjects, tenant: str = "sim", timeout_s: float = 10.0) -> None:
        self._loop = asyncio.new_event_loop()
        self._subjects = subjects
        self._timeout = timeout_s
        self._tenant = tenant
        self._run = uuid.uuid4().hex[:8]
        self._nc = self._loop.run_until_complete(nats.connect(nats_url, connect_timeout=3))
        self._allocations: dict[str, str] = {}
        self.refused_by_mismatch = 0

    def _call(self, rpc: Rpc, body: dict[str, Any]) -> dict[str, Any]:
        msg = self._loop.run_until_complete(
            self._nc.request(self._subjects.rpc(rpc), json.dumps(body).encode(), timeout=self._timeout)
        )
        reply: dict[str, Any] = json.loads(msg.data)
        return reply

    def decide(self, snapshot: FleetSnapshot, request: PlacementRequest) -> Decision:
        body = {
            "request_id": f"sim-{self._run}-{request.request_id}",
            "tenant": self._tenant,
            "model": request.model,
            "context_tokens": request.context_tokens,
            "concurrency": request.concurrency,
            "backend": request.backend,
        }
        reply = self._call(Rpc.PLACEMENT_PLACE, body)
        decision = to_decision(request.request_id, reply)
        if not decision.placed:
            return decision
        try:
            apply(snapshot, decision)
        except ValueError:
            self._release(reply["allocation_id"])
            self.refused_by_mismatch += 1
            return Decision(
                request_id=request.request_id,
                status="rejected",
                error_code="no_capacity",
                message="the live stack placed it where the simulated fleet has no room: different fleets?",
            )
        self._allocations[request.request_id] = reply["allocation_id"]
        return decision

    def _release(self, allocation_id: str) -> None:
        self._call(Rpc.PLACEMENT_RELEASE, {"allocation_id": allocation_id, "tenant": self._tenant})

    def released(self, decision: Decision) -> None:
        allocation = self._allocations.pop(decision.request_id, None)
        if allocation is not None:
            self._release(allocation)

    def close(self) -> None:
        for allocation in list(self._allocations.values()):
            self._release(allocation)
        self._allocations.clear()
        self._loop.run_until_complete(self._nc.close())
        self._loop.close()
