"""Rebalancer contracts (`hetsched.rebalance.status`) and the events of the REBALANCE stream."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Literal

from pydantic import Field

from shared.contracts.base import Contract, Float, Int, Request

# the domain's definitions, one each (`X as X` re-exports them as this module's names)
from shared.domain.rebalance.plans import PlanKind as PlanKind
from shared.domain.rebalance.plans import PlanState as PlanState
from shared.domain.rebalance.plans import StepAction as StepAction
from shared.domain.rebalance.plans import StepState as StepState


class RebalanceEventName(StrEnum):
    """Event names of the REBALANCE stream (`<prefix>.events.rebalance.<name>`)."""

    DETECTOR_FIRED = "detector_fired"
    DETECTOR_CLEARED = "detector_cleared"
    PLAN_CREATED = "plan_created"
    PLAN_STEP = "plan_step"  # a step done or failed
    PLAN_FINISHED = "plan_finished"  # done, failed or rolled back
    THROTTLE_STARTED = "throttle_started"  # placement takes no new replica (cold start) on the node
    THROTTLE_ENDED = "throttle_ended"
    REPLICA_DRAINING = "replica_draining"  # admission sends it no new request: it is being moved
    DRIFT_ALARM = "drift_alarm"  # an allocation's observed HBM is off its reservation by > 10%


class RebalanceStatusRequest(Request):
    """Empty: `{}`."""


class TargetView(Contract):
    key: str = Field(description="What the detector watches: a replica, node, pod or allocation.", examples=["n1"])
    phase: Literal["ok", "pending", "firing"] = Field(description="Its state.", examples=["pending"])
    since: datetime = Field(description="Pending: when the condition started; firing: when it fired.")
    value: Float = Field(description="The last sample.", examples=[0.91])


class DetectorView(Contract):
    name: str = Field(description="`hbm_hot`, `hbm_cold`, `tpu_fragmentation`, `pcie_hot`, ...", examples=["hbm_hot"])
    threshold: Float = Field(description="Its threshold.", examples=[0.85])
    window_s: Float = Field(description="How long the condition must hold.", examples=[60])
    above: bool = Field(default=True, description="Fires above the threshold (False: below).")
    state: Literal["ok", "pending", "firing"] = Field(description="Firing if any target fires.", examples=["ok"])
    targets: list[TargetView] = Field(default_factory=list, description="Targets not ok.")


class StepView(Contract):
    action: StepAction = Field(description="Place a copy, or release the old one.")
    allocation_id: str = Field(description="The replica being moved (its allocation).", examples=["al-..."])
    avoid: list[str] = Field(default_factory=list, description="Accelerators the copy may not use.")
    new_allocation_id: str | None = Field(default=None, description="The copy, once placed.")
    state: StepState = Field(default="pending", description="Its state.")


class PlanView(Contract):
    plan_id: str = Field(description="Plan id.", examples=["rb-1"])
    kind: PlanKind = Field(description="What it does.", examples=["consolidate"])
    state: PlanState = Field(description="Its state.", examples=["running"])
    cluster: str = Field(description="`<region>/<cluster>` (the rate limit's unit).", examples=["us-west-1/c1"])
    target: str = Field(description="The node, pod or replica it is about.", examples=["dgx-h100-02"])
    reason: str = Field(description="Why (the detector and its figure).", examples=["hbm_cold 0.12 for 300 s"])
    created_at: datetime = Field(description="Created.")
    steps: list[StepView] = Field(default_factory=list, description="Make-before-break: places, then releases.")


class ActionView(Contract):
    at: datetime = Field(description="When.")
    plan_id: str | None = Field(default=None, description="Its plan, if any.")
    what: str = Field(description="What happened.", examples=["placed al-2 for al-1 (consolidate)"])


class RebalanceStatusReply(Contract):
    status: Literal["ok"] = Field(default="ok", description="`ok`.", examples=["ok"])
    detectors: list[DetectorView] = Field(default_factory=list, description="Each detector and its targets.")
    plans: list[PlanView] = Field(default_factory=list, description="Plans open or running (and the last finished).")
    recent: list[ActionView] = Field(default_factory=list, description="The last actions, newest first.")


class DetectorEvent(Contract):
    """Payload of `detector_fired` / `detector_cleared`."""

    detector: str = Field(description="Detector.", examples=["hbm_hot"])
    key: str = Field(description="Target.", examples=["al-..."])
    value: Float = Field(description="The sample that made it change.", examples=[0.91])
    threshold: Float = Field(description="Threshold.", examples=[0.85])
    window_s: Float = Field(description="Window.", examples=[60])


class PlanEvent(Contract):
    """Payload of `plan_created` / `plan_step` / `plan_finished`: the plan as it is now."""

    plan: PlanView = Field(description="The plan.")
    step: Int | None = Field(default=None, description="plan_step: the step's index.")
    note: str | None = Field(default=None, description="What happened (e.g. the placement's refusal).")


class NodeThrottleEvent(Contract):
    """Payload of `throttle_started` / `throttle_ended`."""

    node: str = Field(description="Node.", examples=["dgx-h100-01"])
    value: Float = Field(description="PCIe utilisation that started or ended it.", examples=[0.82])
    restated: bool = Field(
        default=False,
        description="`throttle_started` only: a throttle that started before, published again so a reader folding "
        "the stream from a later first sequence knows it (`value`: its latest sample). See docs/RETENTION.md.",
        examples=[False],
    )


class ReplicaDrainingEvent(Contract):
    """Payload of `replica_draining`: admission sends the replica no new request (its requests in flight
    finish on it, then the rebalancer releases it)."""

    allocation_id: str = Field(description="The replica's allocation.", examples=["al-..."])
    plan_id: str = Field(description="The plan moving it.", examples=["rb-1"])
    restated: bool = Field(
        default=False,
        description="A replica told draining before, told again while its plan runs (docs/RETENTION.md).",
        examples=[False],
    )


class DriftAlarmEvent(Contract):
    """Payload of `drift_alarm`: observed HBM on the allocation's GPUs differs from what it reserved by more
    than the threshold (10% of the allocation)."""

    allocation_id: str = Field(description="Allocation.", examples=["al-..."])
    observed_bytes: Int = Field(description="HBM in use on its GPUs per telemetry.", examples=[30_000_000_000])
    reserved_bytes: Int = Field(description="What it reserved there.", examples=[20_000_000_000])
    ratio: Float = Field(description="|observed - reserved| / reserved.", examples=[0.5])
