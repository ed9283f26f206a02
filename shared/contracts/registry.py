"""Every request subject and every event with its model: what the AsyncAPI document is made from."""

from __future__ import annotations

from pydantic import BaseModel

from shared.contracts import engines, fleet, health, ledger, placement, rebalance, reservation, routing, topology
from shared.contracts.subjects import Context, Rpc

RPCS: dict[Rpc, tuple[type[BaseModel], type[BaseModel]]] = {
    **{rpc: (health.HealthRequest, health.HealthReply) for rpc in Rpc if rpc.value.endswith(".health")},
    Rpc.FLEET_GET: (fleet.FleetGetRequest, fleet.FleetGetReply),
    Rpc.FLEET_DESCRIBE: (fleet.FleetDescribeRequest, fleet.FleetDescribeReply),
    Rpc.TOPOLOGY_REPORT: (topology.TopologyReportRequest, topology.TopologyReportReply),
    Rpc.LEDGER_COMMIT: (ledger.CommitRequest, ledger.CommitReply),
    Rpc.LEDGER_COMMIT_BATCH: (ledger.CommitBatchRequest, ledger.CommitBatchReply),
    Rpc.LEDGER_RELEASE: (ledger.LedgerReleaseRequest, ledger.LedgerReleaseReply),
    Rpc.LEDGER_RENEW: (ledger.LedgerRenewRequest, ledger.LedgerRenewReply),
    Rpc.LEDGER_SNAPSHOT: (ledger.SnapshotRequest, ledger.SnapshotReply),
    Rpc.LEDGER_PREEMPT: (ledger.LedgerPreemptRequest, ledger.LedgerPreemptReply),
    Rpc.PLACEMENT_PLACE: (placement.PlaceRequest, placement.PlaceReply),
    Rpc.PLACEMENT_EXPLAIN: (placement.PlaceRequest, placement.PlaceReply),
    Rpc.PLACEMENT_RELEASE: (placement.ReleaseRequest, placement.ReleaseReply),
    Rpc.PLACEMENT_RENEW: (placement.RenewRequest, placement.RenewReply),
    Rpc.PLACEMENT_ADMIT: (placement.AdmitRequest, placement.AdmitReply),
    Rpc.PLACEMENT_REPLICAS: (placement.ReplicasRequest, placement.ReplicasReply),
    Rpc.PLACEMENT_ASSIGNMENTS: (engines.AssignmentsRequest, engines.AssignmentsReply),
    Rpc.RESERVATION_CREATE: (reservation.ReservationCreateRequest, reservation.ReservationCreateReply),
    Rpc.RESERVATION_CANCEL: (reservation.ReservationCancelRequest, reservation.ReservationCancelReply),
    Rpc.RESERVATION_STATUS: (reservation.ReservationStatusRequest, reservation.ReservationStatusReply),
    Rpc.RESERVATION_REPORT: (reservation.ReservationReportRequest, reservation.ReservationReportReply),
    Rpc.RESERVATION_RECLAIM: (reservation.ReservationReclaimRequest, reservation.ReservationReclaimReply),
    Rpc.ROUTE_SELECT: (routing.RouteSelectRequest, routing.RouteSelectReply),
    Rpc.ROUTE_REGION: (routing.RouteRegionRequest, routing.RouteRegionReply),
    Rpc.REBALANCE_STATUS: (rebalance.RebalanceStatusRequest, rebalance.RebalanceStatusReply),
}

EVENTS: dict[tuple[Context, str], type[BaseModel]] = {
    (Context.TOPOLOGY, topology.NODE_PROFILED): topology.NodeProfileEvent,
    (Context.TOPOLOGY, topology.NODE_CHANGED): topology.NodeProfileEvent,
    (Context.TOPOLOGY, topology.NODE_REMOVED): topology.NodeStateEvent,
    (Context.TOPOLOGY, topology.NODE_LOST): topology.NodeStateEvent,
    (Context.TOPOLOGY, topology.NODE_RECOVERED): topology.NodeStateEvent,
    (Context.TOPOLOGY, topology.NODE_PROFILE_FAILED): topology.NodeProfileFailedEvent,
    (Context.TOPOLOGY, topology.TPU_POD_PROFILED): topology.TpuPodEvent,
    (Context.TELEMETRY, topology.GPU_TELEMETRY): topology.GpuTelemetryEvent,
    (Context.TELEMETRY, topology.ENGINE_STATUS): topology.EngineStatusEvent,
    (Context.TELEMETRY, topology.REPLICA_STATE): engines.ReplicaStateEvent,
    (Context.LEDGER, ledger.ALLOCATION_COMMITTED): ledger.AllocationEvent,
    (Context.LEDGER, ledger.ALLOCATION_RELEASED): ledger.AllocationEvent,
    (Context.LEDGER, ledger.ALLOCATION_EXPIRED): ledger.AllocationEvent,
    (Context.LEDGER, ledger.ALLOCATIONS_FLAGGED): ledger.AllocationsFlaggedEvent,
    (Context.LEDGER, ledger.CAPACITY_CHANGED): ledger.CapacityChangedEvent,
    (Context.LEDGER, ledger.DRIFT_DETECTED): ledger.DriftEvent,
    (Context.PLACEMENT, placement.PLACEMENT_DECIDED): placement.PlacementEvent,
    (Context.PLACEMENT, placement.PLACEMENT_REJECTED): placement.PlacementEvent,
    (Context.PLACEMENT, placement.PLACEMENT_RELEASED): placement.PlacementReleasedEvent,
    **{(Context.RESERVATION, name): reservation.ReservationEvent for name in reservation.ReservationEventName},
    (Context.REBALANCE, rebalance.RebalanceEventName.DETECTOR_FIRED): rebalance.DetectorEvent,
    (Context.REBALANCE, rebalance.RebalanceEventName.DETECTOR_CLEARED): rebalance.DetectorEvent,
    (Context.REBALANCE, rebalance.RebalanceEventName.PLAN_CREATED): rebalance.PlanEvent,
    (Context.REBALANCE, rebalance.RebalanceEventName.PLAN_STEP): rebalance.PlanEvent,
    (Context.REBALANCE, rebalance.RebalanceEventName.PLAN_FINISHED): rebalance.PlanEvent,
    (Context.REBALANCE, rebalance.RebalanceEventName.THROTTLE_STARTED): rebalance.NodeThrottleEvent,
    (Context.REBALANCE, rebalance.RebalanceEventName.THROTTLE_ENDED): rebalance.NodeThrottleEvent,
    (Context.REBALANCE, rebalance.RebalanceEventName.REPLICA_DRAINING): rebalance.ReplicaDrainingEvent,
    (Context.REBALANCE, rebalance.RebalanceEventName.DRIFT_ALARM): rebalance.DriftAlarmEvent,
    (Context.ROUTING, routing.ROUTE_SWITCHED): routing.RouteSwitchedEvent,
    (Context.ROUTING, routing.REGION_STATE_CHANGED): routing.RegionStateEvent,
}
