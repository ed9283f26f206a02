"""The node agents' word on placement's replicas, without servers: ``EngineStates`` (replica_state reports
kept per rank, trusted from the replica's own nodes, stale ones absent), admission choosing only ready
replicas and naming their endpoint, and ``placement.assignments``' parts of a replica per node."""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime, timedelta
from typing import Any

from services.placement.admission import AdmissionHandlers, Fairness
from services.placement.assignments import assignment_of, assignments_of, replica_nodes
from services.placement.engines import EngineStates
from services.placement.records import PlacedReplica
from services.placement.renewals import Renewals
from services.placement.replicas import ReplicaBook, replica_of
from shared.contracts.base import Rejected
from shared.contracts.engines import ReplicaStateEvent
from shared.contracts.placement import (
    AcceleratorShare,
    AdmitReply,
    AdmitRequest,
    EngineLaunch,
    NodeBinding,
    NodePlacement,
    PlaceReply,
    RenewReply,
    RenewRequest,
    TpuSlice,
)
from shared.contracts.topology import EngineStatusEvent
from shared.domain.admission import AdmitPolicy
from shared.domain.placement.listing import ReplicaState
from shared.infra.catalog import load_models

MODELS = load_models()
GB = 10**9
T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
log = logging.getLogger("test.lifecycle")


class Wall:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now


def _share() -> AcceleratorShare:
    return AcceleratorShare(
        weights_bytes=8 * GB, kv_bytes=20 * GB, activation_bytes=GB, workspace_bytes=GB, total_bytes=30 * GB
    )


def _binding(node: str, gpus: list[int]) -> NodeBinding:
    return NodeBinding(
        node=node,
        cuda_visible_devices=",".join(map(str, gpus)),
        tp_rank_order=gpus,
        numa_node=0,
        cpu_set="0-23",
    )


LAUNCH = EngineLaunch(vllm=["--tensor-parallel-size", "4"], sglang=["--tp-size", "4"], env={"A": "1"})


def two_nodes(allocation_id: str = "al-pp") -> PlaceReply:
    """llama3-70b, TP=4 x PP=2 over two nodes (stage 0 on n-b: the binding's first node is the head)."""
    on_b = NodePlacement(node="n-b", accelerators=[f"n-b/gpu{i}" for i in range(4)])
    on_a = NodePlacement(node="n-a", accelerators=[f"n-a/gpu{i}" for i in range(4, 8)])
    return PlaceReply(
        status="placed",
        request_id="r-pp",
        allocation_id=allocation_id,
        model="llama3-70b",
        backend="gpu",
        sku="H100-SXM-80GB",
        tp=4,
        pp=2,
        placements=[on_a, on_b],
        stages=[[on_b], [on_a]],
        hbm_per_accelerator=_share(),
        binding=[_binding("n-b", [0, 1, 2, 3]), _binding("n-a", [4, 5, 6, 7])],
        launch=LAUNCH,
        dtype="fp8",
    )


def one_node(allocation_id: str, node: str = "n-1", model: str = "llama3.1-8b") -> PlaceReply:
    return PlaceReply(
        status="placed",
        request_id=f"r-{allocation_id}",
        allocation_id=allocation_id,
        model=model,
        backend="gpu",
        tp=1,
        placements=[NodePlacement(node=node, accelerators=[f"{node}/gpu0"])],
        hbm_per_accelerator=_share(),
        binding=[_binding(node, [0])],
        launch=LAUNCH,
    )


def report(replica_id: str, node: str, state: str, *, rank: int = 0, ranks: int = 1, **extra: Any) -> ReplicaStateEvent:
    return ReplicaStateEvent(replica_id=replica_id, node=node, state=state, rank=rank, ranks=ranks, **extra)  # type: ignore[arg-type]


# -- placement.assignments --------------------------------------------------------------------------------


def test_a_two_node_replica_is_assigned_rank_by_rank_with_each_nodes_binding() -> None:
    reply = two_nodes()
    assert replica_nodes(reply) == ["n-b", "n-a"]
    lease = T0 + timedelta(minutes=5)
    head = assignment_of("n-b", tenant="acme", reply=reply, lease_expires_at=lease, models=MODELS)
    tail = assignment_of("n-a", tenant="acme", reply=reply, lease_expires_at=lease, models=MODELS, draining=True)
    assert head is not None and tail is not None
    assert (head.rank, head.ranks, head.head_node) == (0, 2, "n-b")
    assert (tail.rank, tail.ranks, tail.head_node) == (1, 2, "n-b")
    assert head.binding is not None and head.binding.tp_rank_order == [0, 1, 2, 3]
    assert tail.binding is not None and tail.binding.tp_rank_order == [4, 5, 6, 7]
    assert (head.model, head.dtype, head.sku, head.tp, head.pp, head.backend) == (
        "llama3-70b",
        "fp8",
        "H100-SXM-80GB",
        4,
        2,
        "gpu",
    )
    assert head.launch == LAUNCH and head.lease_expires_at == lease
    assert (head.draining, tail.draining) == (False, True)
    assert assignment_of("n-c", tenant="acme", reply=reply, lease_expires_at=lease, models=MODELS) is None


def test_a_tpu_replica_is_assigned_to_its_pods_name() -> None:
    reply = PlaceReply(
        status="placed",
        request_id="r-tpu",
        allocation_id="al-tpu",
        model="llama3-8b",
        backend="tpu",
        tp=4,
        tpu_slice=TpuSlice(pod="v5e-pod-1", origin=[0, 0], shape=[2, 2]),
    )
    part = assignment_of("v5e-pod-1", tenant="acme", reply=reply, lease_expires_at=None, models=MODELS)
    assert part is not None and (part.backend, part.rank, part.ranks, part.binding) == ("tpu", 0, 1, None)
    assert part.dtype == MODELS["llama3-8b"].dtype  # the request named none: the catalog's


def test_a_nodes_assignments_from_placed_decisions_with_a_preemption_deadline() -> None:
    deadline = T0 + timedelta(seconds=30)

    def row(reply: PlaceReply) -> PlacedReplica:
        assert reply.allocation_id is not None
        return PlacedReplica(
            tenant="acme",
            request_id=reply.request_id,
            allocation_id=reply.allocation_id,
            reply=reply.model_dump(mode="json", exclude={"allocation_id"}),
            lease_expires_at=T0,
            placed_at=T0,
        )

    rows = [row(one_node("al-1")), row(one_node("al-2")), row(one_node("al-3", node="n-2"))]
    rows.append(PlacedReplica("acme", "r-bad", "al-bad", {"status": "??"}, None, T0))  # unreadable: left out
    parts = assignments_of("n-1", rows, models=MODELS, draining={"al-2"}, stop_by={"al-1": deadline})
    assert [(p.replica_id, p.draining, p.stop_by) for p in parts] == [("al-1", False, deadline), ("al-2", True, None)]
    assert assignments_of("nowhere", rows, models=MODELS, draining=set(), stop_by={}) == []


# -- the agents' reports ----------------------------------------------------------------------------------


def _engines(*replies: PlaceReply, stale_s: float = 15.0) -> tuple[EngineStates, ReplicaBook, Wall]:
    book = ReplicaBook(models=MODELS)
    for reply in replies:
        replica = replica_of("acme", reply, MODELS)
        assert replica is not None
        book.add(replica)
    wall = Wall()
    return EngineStates(nodes_of=book.nodes_of, stale_s=stale_s, clock=wall), book, wall


def test_reports_count_only_from_the_replicas_own_nodes() -> None:
    engines, _book, wall = _engines(two_nodes())
    assert not engines.report(report("al-pp", "n-c", "ready", ranks=2), wall())  # not one of its nodes
    assert not engines.report(report("al-nope", "n-a", "ready"), wall())  # not one of placement's replicas
    assert engines.folded("al-pp") is None
    assert engines.report(report("al-pp", "n-b", "ready", ranks=2, endpoint="http://n-b:8000"), wall())
    assert engines.state("al-pp", draining=False, serving=False) is ReplicaState.STARTING  # rank 1 unheard
    assert engines.endpoint("al-pp") is None
    assert engines.report(report("al-pp", "n-a", "ready", rank=1, ranks=2), wall())
    assert engines.state("al-pp", draining=False, serving=False) is ReplicaState.READY
    assert engines.endpoint("al-pp") == "http://n-b:8000"
    assert engines.state("al-pp", draining=True, serving=True) is ReplicaState.DRAINING


def test_stale_reports_leave_the_engine_rule() -> None:
    engines, _book, wall = _engines(one_node("al-1"), stale_s=2.0)
    engines.report(report("al-1", "n-1", "loading"), wall())
    assert engines.state("al-1", draining=False, serving=True) is ReplicaState.LOADING
    assert not engines.admissible("al-1")
    wall.now += timedelta(seconds=3)
    assert engines.folded("al-1") is None
    assert engines.state("al-1", draining=False, serving=True) is ReplicaState.READY  # engine_status says so
    assert engines.state("al-1", draining=False, serving=False) is ReplicaState.PLACED
    assert engines.admissible("al-1") and not engines.alive("al-1")


def test_a_replica_that_ended_takes_its_ranks_with_it() -> None:
    engines, book, wall = _engines(one_node("al-1"))
    engines.report(report("al-1", "n-1", "ready"), wall())
    assert engines.reported(set()) == {"al-1": ReplicaState.READY}
    book.remove("al-1")
    assert engines.reported(set()) == {}


# -- admission: ready replicas only, with their endpoint ---------------------------------------------------


def _status(replica_id: str, node: str) -> EngineStatusEvent:
    return EngineStatusEvent(
        replica_id=replica_id,
        node=node,
        queue_depth=0,
        kv_used_bytes=0,
        kv_total_bytes=20 * GB,
        latency_p50_ms=50.0,
        latency_p99_ms=90.0,
        healthy=True,
    )


async def test_admission_chooses_only_ready_replicas_and_names_the_endpoint() -> None:
    replies = [one_node("al-1", node="n-1"), one_node("al-2", node="n-2"), one_node("al-3", node="n-3")]
    engines, book, wall = _engines(*replies)
    clock_ms = [1_000_000.0]
    admission = AdmissionHandlers(
        book=book,
        rpc=None,  # type: ignore[arg-type]
        models=MODELS,
        groups={},
        policy=AdmitPolicy(),
        fairness=Fairness(),
        timer=lambda: clock_ms[0],
        log=log,
        admissible=engines.admissible,
        endpoint=engines.endpoint,
    )
    for i in (1, 2, 3):
        admission.on_engine_status(_status(f"al-{i}", f"n-{i}"))  # every engine healthy by its status
    engines.report(report("al-1", "n-1", "failed", reason="exited with code 1"), wall())
    engines.report(report("al-2", "n-2", "loading"), wall())
    engines.report(report("al-3", "n-3", "ready", endpoint="http://n-3:8100"), wall())

    def ask(rid: str) -> AdmitRequest:
        return AdmitRequest(request_id=rid, tenant="acme", model="llama3.1-8b", input_tokens=100, output_tokens=10)

    for rid in ("a", "b", "c"):
        reply = await admission.admit(ask(rid))
        assert isinstance(reply, AdmitReply) and reply.status == "admitted", reply
        assert (reply.replica_id, reply.endpoint) == ("al-3", "http://n-3:8100")
    engines.report(report("al-3", "n-3", "draining", endpoint="http://n-3:8100"), wall())
    refused = await admission.admit(ask("d"))
    assert isinstance(refused, Rejected)
    engines.report(report("al-2", "n-2", "ready", endpoint="http://n-2:8100"), wall())
    moved = await admission.admit(ask("e"))
    assert isinstance(moved, AdmitReply) and (moved.replica_id, moved.endpoint) == ("al-2", "http://n-2:8100")


# -- renewal while the ranks report -----------------------------------------------------------------------


class _Leases:
    """The store's and unit of work's part Renewals uses: a replica's tenant and lease end."""

    def __init__(self, ends: dict[str, datetime]) -> None:
        self.ends = ends

    async def read(self, fn: Any) -> Any:
        return await fn(None)

    async def lease_of(self, *, session: Any, allocation_id: str) -> tuple[str, datetime] | None:
        end = self.ends.get(allocation_id)
        return ("acme", end) if end is not None else None


class _FirstLeases:
    def __init__(self, on_first: set[str]) -> None:
        self.on_first = on_first

    def asked(self, allocation_id: str) -> int | None:
        return 3600 if allocation_id in self.on_first else None


async def test_a_reporting_replica_is_renewed_when_less_than_half_its_lease_is_left_and_never_shortened() -> None:
    wall = Wall()
    leases = _Leases(
        {
            "al-due": T0 + timedelta(seconds=20),  # 20 s of a 60 s lease left: due
            "al-long": T0 + timedelta(days=7),  # its caller renewed it for a week: not shortened
            "al-first": T0 + timedelta(seconds=5),  # on its first lease: the first-lease rule extends it
        }
    )
    asked: list[RenewRequest] = []

    async def renew(request: RenewRequest) -> RenewReply:
        asked.append(request)
        end = wall() + timedelta(seconds=request.lease_s)
        leases.ends[request.allocation_id] = end
        return RenewReply(status="renewed", lease_expires_at=end)

    renewals = Renewals(
        store=leases,  # type: ignore[arg-type]
        uow=leases,  # type: ignore[arg-type]
        renew=renew,
        first_leases=_FirstLeases({"al-first"}),  # type: ignore[arg-type]
        lease_s=60,
        clock=wall,
        log=log,
    )
    for replica in ("al-due", "al-long", "al-first", "al-gone"):
        renewals.reported(replica)
    await asyncio.sleep(0.01)
    assert [(r.allocation_id, r.tenant, r.lease_s) for r in asked] == [("al-due", "acme", 60)]
    renewals.reported("al-due")  # renewed a moment ago: a full lease left, nothing to do
    wall.now += timedelta(seconds=29)
    renewals.reported("al-due")
    await asyncio.sleep(0.01)
    assert len(asked) == 1
    wall.now += timedelta(seconds=2)  # 29 s of 60 left: due again
    renewals.reported("al-due")
    await asyncio.sleep(0.01)
    assert [r.allocation_id for r in asked] == ["al-due", "al-due"]
