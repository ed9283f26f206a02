"""`hetsched sim --live`: the simulation asks a running stack's `placement.place` for every replica it
needs (so the stack's real decisions, ledger commits and conflicts are exercised) and releases them
through `placement.release` when the simulation retires them.

The simulated fleet (`--fleet`) must be the fleet the stack serves: a live placement is applied to the
simulation's own view, and one that does not fit it is released again and counted as a refusal.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from shared.contracts.base import Rejected
from shared.contracts.placement import (
    PlaceReply,
    PlaceRequest,
    ReleaseReply,
    ReleaseRequest,
    RenewReply,
    RenewRequest,
)
from shared.contracts.subjects import Rpc, Subjects
from shared.domain.errors import ErrorCode
from shared.domain.fleet import AcceleratorId
from shared.domain.memory import MemoryShare
from shared.domain.placement import Decision, FleetSnapshot, PlacementRequest, TpuPlacement, apply
from shared.domain.topology.tpu import TpuSlice
from shared.infra.rpc import RpcClient

SIM_LEASE_S = 24 * 3600
"""The lease a replica the simulator placed on a live stack holds (the simulator releases it when done)."""


def to_decision(request_id: str, reply: PlaceReply | Rejected) -> Decision:
    """A `placement.place` reply as the domain's Decision (what the simulation applies)."""
    if isinstance(reply, Rejected) or reply.status != "placed":
        error = reply.error
        return Decision(
            request_id=request_id,
            status="rejected",
            error_code=error.code if error is not None else ErrorCode.NO_CAPACITY,
            message=error.message if error is not None else "",
            explanation=tuple(reply.explanation) if isinstance(reply, PlaceReply) else (),
        )
    hbm = reply.hbm_per_accelerator
    share = (
        MemoryShare(
            weights=hbm.weights_bytes, kv=hbm.kv_bytes, activation=hbm.activation_bytes, workspace=hbm.workspace_bytes
        )
        if hbm is not None
        else None
    )
    tpu = None
    accelerators: tuple[str, ...] = tuple(a for p in reply.placements for a in p.accelerators)
    if reply.tpu_slice is not None:
        block = reply.tpu_slice
        origin, shape = tuple(block.origin), tuple(block.shape)
        chips = tuple(AcceleratorId.tpu(block.pod, c) for c in TpuSlice(origin, shape).coords())
        tpu = TpuPlacement(pod=block.pod, origin=origin, shape=shape, chips=chips)
        accelerators = chips
    first = reply.placements[0] if reply.placements else None
    return Decision(
        request_id=request_id,
        status="placed",
        backend=reply.backend,
        region=reply.region,
        cluster=reply.cluster,
        node=first.node if first is not None else None,
        nodes=tuple(p.node for p in reply.placements),
        sku=reply.sku,
        tp=reply.tp,
        accelerators=accelerators,
        domain=first.domain if first is not None else None,
        share=share,
        tpu=tpu,
        score=dict(reply.score),
        explanation=tuple(reply.explanation),
    )


class LivePolicy:
    """Decides by asking the stack; blocking calls on a private event loop (the simulation is synchronous)."""

    name = "hetsched-live"

    def __init__(
        self,
        *,
        nats_url: str,
        subjects: Subjects,
        timeout_s: float,
        tenant: str = "sim",
        options: dict[str, Any] | None = None,
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._tenant = tenant
        self._run = uuid.uuid4().hex[:8]
        self._rpc = self._loop.run_until_complete(
            RpcClient.connect(nats_url, subjects, timeout_s=timeout_s, name="hetsched-sim-live", **(options or {}))
        )
        self._allocations: dict[str, str] = {}
        self.refused_by_mismatch = 0

    def decide(self, snapshot: FleetSnapshot, request: PlacementRequest) -> Decision:
        place = PlaceRequest.model_validate(
            {
                "request_id": f"sim-{self._run}-{request.request_id}",
                "tenant": self._tenant,
                "model": request.model,
                "context_tokens": request.context_tokens,
                "concurrency": request.concurrency,
                "backend": request.backend,
            }
        )
        reply = self._loop.run_until_complete(
            self._rpc.ask(Rpc.PLACEMENT_PLACE, place, PlaceReply, rejection_as_reply=True)
        )
        decision = to_decision(request.request_id, reply)
        if not decision.placed or not isinstance(reply, PlaceReply) or reply.allocation_id is None:
            return decision
        try:
            apply(snapshot, decision)
        except ValueError:
            self._release(reply.allocation_id)
            self.refused_by_mismatch += 1
            return Decision(
                request_id=request.request_id,
                status="rejected",
                error_code=ErrorCode.NO_CAPACITY,
                message="the live stack placed it where the simulated fleet has no room: different fleets?",
            )
        self._allocations[request.request_id] = reply.allocation_id
        # No engine will report for it: renew at once, or the ledger ends it after its short first lease.
        renew = RenewRequest(allocation_id=reply.allocation_id, tenant=self._tenant, lease_s=SIM_LEASE_S)
        self._loop.run_until_complete(self._rpc.ask(Rpc.PLACEMENT_RENEW, renew, RenewReply))
        return decision

    def _release(self, allocation_id: str) -> None:
        release = ReleaseRequest(allocation_id=allocation_id, tenant=self._tenant)
        self._loop.run_until_complete(self._rpc.ask(Rpc.PLACEMENT_RELEASE, release, ReleaseReply))

    def released(self, decision: Decision) -> None:
        allocation = self._allocations.pop(decision.request_id, None)
        if allocation is not None:
            self._release(allocation)

    def close(self) -> None:
        for allocation in list(self._allocations.values()):
            self._release(allocation)
        self._allocations.clear()
        self._loop.run_until_complete(self._rpc.close())
        self._loop.close()
