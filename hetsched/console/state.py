"""What `GET /api/state` sends the console page: the fleet, the ledger, reservations, recent placements and
the rebalancer in one JSON document. Pure: built from replies already fetched (``collect`` fetches them)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from datetime import datetime
from itertools import combinations
from typing import Any

from pydantic import BaseModel

from shared.contracts.base import Rejected
from shared.contracts.fleet import DomainView, FleetGetReply, TpuPodView
from shared.contracts.ledger import AcceleratorLedgerView, SnapshotReply
from shared.contracts.rebalance import RebalanceStatusReply, RebalanceStatusRequest
from shared.contracts.reservation import (
    ReservationReportReply,
    ReservationReportRequest,
    ReservationStatusReply,
    ReservationStatusRequest,
)
from shared.contracts.subjects import Rpc
from shared.contracts.topology import NodeProfilePayload
from shared.domain.fleet import AcceleratorId
from shared.infra.rpc import RpcClient

# `reservation.status` is asked once per tenant that holds a reservation, at most this many at a time.
TENANTS_IN_FLIGHT = 16
FABRIC = "fabric"  # the edge code between GPUs of one multi-node NVLink clique (GH200 NVL, NVL72)


def _id(value: str) -> AcceleratorId | None:
    try:
        return AcceleratorId.parse(value)
    except ValueError:
        return None


def nvlink_edges(domain: DomainView, profiles: dict[str, NodeProfilePayload]) -> list[list[str]]:
    """``[a, b, code]`` for each NVLink between two members of ``domain``: on one node, the link code of
    its profile's matrix (``NV18``); across nodes, ``fabric`` between members of one clique."""
    clique_of = {member: n for n, clique in enumerate(domain.cliques) for member in clique}
    edges: list[list[str]] = []
    for a, b in combinations(domain.members, 2):
        left, right = _id(a), _id(b)
        if left is None or right is None or left.gpu_index is None or right.gpu_index is None:
            continue
        if left.host == right.host:
            profile = profiles.get(left.host)
            if profile is None:
                continue
            try:
                code = profile.links[left.gpu_index][right.gpu_index]
            except IndexError:
                continue
            if code.startswith("NV"):
                edges.append([a, b, code])
        elif a in clique_of and clique_of[a] == clique_of.get(b):
            edges.append([a, b, FABRIC])
    return edges


def _gpu(acc_id: str, index: int, hbm_total: int, domain: str | None, held: AcceleratorLedgerView | None) -> Any:
    return {
        "id": acc_id,
        "index": index,
        "domain": domain,
        "hbm_total_bytes": hbm_total,
        "hbm_usable_bytes": held.hbm_usable_bytes if held else hbm_total,
        "hbm_reserved_bytes": held.hbm_reserved_bytes if held else 0,
        "available": held.available if held else True,
        "shared": held.shared if held else False,
        "allocations": list(held.allocations) if held else [],
    }


def pods_of(pods: Iterable[TpuPodView], ledger: dict[str, AcceleratorLedgerView]) -> list[dict[str, Any]]:
    """The TPU pods, each with the chips that hold something (an idle pod is drawn from its shape alone)."""
    pods = list(pods)
    chips: dict[str, list[dict[str, Any]]] = {pod.name: [] for pod in pods}
    for acc in ledger.values():
        parsed = _id(acc.id)
        if parsed is None or parsed.chip is None or parsed.host not in chips:
            continue
        chips[parsed.host].append(
            {
                "id": acc.id,
                "coord": list(parsed.chip),
                "hbm_usable_bytes": acc.hbm_usable_bytes,
                "hbm_reserved_bytes": acc.hbm_reserved_bytes,
                "available": acc.available,
                "allocations": list(acc.allocations),
            }
        )
    return [
        {
            "name": pod.name,
            "region": pod.region,
            "cluster": pod.cluster,
            "type": pod.type,
            "shape": pod.shape,
            "chips": pod.chips,
            "hbm_per_chip_bytes": pod.hbm_per_chip,
            # Only the chips holding something: an idle 8x8x8 pod is drawn from its shape alone.
            "held": sorted((c for c in chips[pod.name] if c["allocations"]), key=lambda c: c["coord"]),
        }
        for pod in pods
    ]


def _reservations(
    report: ReservationReportReply | None, statuses: Iterable[ReservationStatusReply]
) -> dict[str, Any] | None:
    if report is None:
        return None
    return {
        **report.model_dump(mode="json"),
        "reservations": [view.model_dump(mode="json") for reply in statuses for view in reply.reservations],
    }


def reservations_summary(
    report: ReservationReportReply | None, statuses: Iterable[ReservationStatusReply]
) -> dict[str, Any] | None:
    """The report and each reservation as a row: how many accelerators, not which (the node drill-down
    says which GPU is reserved by whom)."""
    if report is None:
        return None
    rows = []
    for reply in statuses:
        for view in reply.reservations:
            row = view.model_dump(mode="json", exclude={"accelerators", "borrowers", "preemptions"})
            rows.append({**row, "accelerators_count": len(view.accelerators), "borrowers_count": len(view.borrowers)})
    return {**report.model_dump(mode="json"), "reservations": rows}


def build_state(
    *,
    now: datetime,
    fleet: FleetGetReply | None,
    ledger: SnapshotReply | None,
    report: ReservationReportReply | None = None,
    statuses: Iterable[ReservationStatusReply] = (),
    rebalancer: RebalanceStatusReply | None = None,
    placements: list[dict[str, Any]] | None = None,
    allocations: dict[str, dict[str, Any]] | None = None,
    errors: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The page's document. A part whose service did not answer is null (``fleet``) or empty, and
    ``errors`` says which and why; the page shows the rest."""
    held = {acc.id: acc for acc in (ledger.accelerators if ledger else [])}
    nodes: list[dict[str, Any]] = []
    domains: list[dict[str, Any]] = []
    if fleet is not None:
        profiles = {n.name: n.profile for n in fleet.nodes if n.profile is not None}
        for node in fleet.nodes:
            nodes.append(
                {
                    "name": node.name,
                    "region": node.region,
                    "cluster": node.cluster,
                    "rack": node.rack,
                    "sku": node.sku,
                    "kind": node.kind,
                    "state": node.state,
                    "gpus": [
                        _gpu(a.id, a.index, a.hbm_total_bytes, a.domain, held.get(a.id))
                        for a in sorted(node.accelerators, key=lambda a: a.index)
                    ],
                }
            )
        for domain in fleet.domains:
            if len(domain.members) < 2:
                continue  # a GPU alone (PCIe): no NVLink to draw
            domains.append(
                {
                    "id": domain.id,
                    "kind": domain.kind,
                    "members": domain.members,
                    "cliques": domain.cliques,
                    "edges": nvlink_edges(domain, profiles),
                }
            )
    return {
        "generated_at": now.isoformat(),
        "errors": errors or {},
        "nodes": nodes,
        "domains": domains,
        "tpu_pods": pods_of(fleet.tpu_pods, held) if fleet is not None else [],
        "cross_domain_used": ledger.cross_domain_used if ledger else {},
        "reservations": _reservations(report, statuses),
        "placements": placements or [],
        "allocations": allocations or {},
        "rebalancer": rebalancer.model_dump(mode="json") if rebalancer is not None else None,
    }


async def answer_of(
    errors: dict[str, str], part: str, ask: Callable[[], Awaitable[BaseModel]], reply: type[BaseModel]
) -> Any:
    """The reply, or None with the reason in ``errors[part]`` (a refusal, no answer, a timeout)."""
    try:
        answer = await ask()
    except Exception as exc:
        errors[part] = f"{type(exc).__name__}: {exc}"[:300]
        return None
    if isinstance(answer, Rejected):
        errors[part] = f"{answer.error.code}: {answer.error.message}"[:300]
        return None
    if not isinstance(answer, reply):
        errors[part] = f"unexpected reply {type(answer).__name__}"
        return None
    return answer


async def reservations_of(
    rpc: RpcClient, errors: dict[str, str]
) -> tuple[ReservationReportReply | None, list[ReservationStatusReply]]:
    """``reservation.report``, then ``reservation.status`` for every tenant it names (``TENANTS_IN_FLIGHT`` at a
    time): a reserved GPU of any tenant shows as reserved, never as free."""
    report = await answer_of(
        errors,
        "reservations",
        lambda: rpc.ask(Rpc.RESERVATION_REPORT, ReservationReportRequest(), ReservationReportReply),
        ReservationReportReply,
    )
    if report is None:
        return None, []
    tenants = sorted(report.by_tenant)
    in_flight = asyncio.Semaphore(TENANTS_IN_FLIGHT)

    def status_of(tenant: str) -> Callable[[], Awaitable[BaseModel]]:
        request = ReservationStatusRequest(tenant=tenant)

        async def ask() -> BaseModel:
            async with in_flight:
                return await rpc.ask(Rpc.RESERVATION_STATUS, request, ReservationStatusReply)

        return ask

    answers = await asyncio.gather(
        *(answer_of(errors, "reservations", status_of(t), ReservationStatusReply) for t in tenants)
    )
    return report, [a for a in answers if a is not None]


async def rebalancer_of(rpc: RpcClient, errors: dict[str, str]) -> RebalanceStatusReply | None:
    answer: RebalanceStatusReply | None = await answer_of(
        errors,
        "rebalancer",
        lambda: rpc.ask(Rpc.REBALANCE_STATUS, RebalanceStatusRequest(), RebalanceStatusReply),
        RebalanceStatusReply,
    )
    return answer


async def collect(
    rpc: RpcClient,
    *,
    now: Callable[[], datetime],
    placements: list[dict[str, Any]] | None = None,
    allocations: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Ask every service at once (``fleet.get`` with profiles, ``ledger.snapshot``, ``reservation.report``
    then ``reservation.status`` per tenant, ``rebalance.status``) and build the page's document."""
    errors: dict[str, str] = {}
    fleet, ledger, (report, statuses), rebalancer = await asyncio.gather(
        answer_of(errors, "fleet", lambda: rpc.fleet(profiles=True), FleetGetReply),
        answer_of(errors, "ledger", rpc.ledger_snapshot, SnapshotReply),
        reservations_of(rpc, errors),
        rebalancer_of(rpc, errors),
    )
    return build_state(
        now=now(),
        fleet=fleet,
        ledger=ledger,
        report=report,
        statuses=statuses,
        rebalancer=rebalancer,
        placements=placements,
        allocations=allocations,
        errors=errors,
    )
