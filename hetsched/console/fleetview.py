"""The console's fleet at scale: a summary per region, cluster and SKU, the nodes of one group a page at a time,
and one node's GPUs, each GPU in one of the states the page's legend names (placed, lent, reserved hard or soft,
free, unavailable). Pure: built from replies already fetched.

Two layers keep a poll cheap on a fleet of thousands of GPUs. ``FleetIndex`` is what topology says (nodes, their
GPUs, groups, NVLink domains): built once per fleet reply and kept while the fleet does not change. ``FleetView``
folds one ledger snapshot, the reservations and the rebalancer's targets onto it in one pass over the GPUs
(per-node tallies, then per-group sums of those tallies); the summary, a group's page of nodes and a node's
detail are read from it without another pass."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from hetsched.console.state import nvlink_edges, pods_of
from shared.contracts.fleet import DomainView, FleetGetReply, NodeView
from shared.contracts.ledger import AcceleratorLedgerView, SnapshotReply
from shared.contracts.rebalance import RebalanceStatusReply
from shared.contracts.reservation import ReservationStatusReply
from shared.contracts.topology import NodeProfilePayload

# The states of a GPU, in the order the legend lists them (and the page stacks them in a bar).
PLACED = "placed"  # holds a replica (its owner's, when it is reserved)
LENT = "lent"  # reserved by one tenant, holding a borrower's replica
RESERVED_HARD = "reserved_hard"  # reserved (hard policy), no replica on it yet
RESERVED_SOFT = "reserved_soft"  # reserved (soft or spot policy: lendable), no replica on it yet
FREE = "free"  # neither placed nor reserved
UNAVAILABLE = "unavailable"  # its node is lost (or the ledger marks it unavailable)
STATES = (PLACED, LENT, RESERVED_HARD, RESERVED_SOFT, FREE, UNAVAILABLE)
# One letter per GPU in a node row (``"ppsf"``): a node's GPUs in a few bytes.
LETTERS = {PLACED: "p", LENT: "l", RESERVED_HARD: "h", RESERVED_SOFT: "s", FREE: "f", UNAVAILABLE: "x"}

GROUPINGS = ("region", "cluster", "sku")
PAGE_MAX = 500  # nodes per page of a group, at most
ALERTS_SHOWN = 20  # the summary lists the first alerts (sorted by node); the count covers all


class ViewError(ValueError):
    """A question the view cannot answer: ``status`` is the HTTP status (400 malformed, 404 unknown)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


# -- what topology says: built once per fleet reply ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class GpuEntry:
    id: str
    index: int
    hbm_total_bytes: int
    domain: str | None


@dataclass(frozen=True, slots=True)
class NodeEntry:
    name: str
    region: str
    cluster: str  # ``<region>/<cluster>``: cluster names repeat across regions
    rack: str
    sku: str
    kind: str | None
    state: str
    gpus: tuple[GpuEntry, ...]

    def key(self, grouping: str) -> str:
        return self.region if grouping == "region" else self.cluster if grouping == "cluster" else self.sku


@dataclass(frozen=True)
class FleetIndex:
    """Topology's fleet, arranged for the console: nodes by name and by group, domains by node."""

    nodes: dict[str, NodeEntry]
    groups: dict[str, dict[str, tuple[str, ...]]]  # grouping -> key -> node names, sorted
    domains_of: dict[str, tuple[DomainView, ...]]  # node -> the NVLink domains its GPUs are in
    tpu_pods: tuple[Any, ...] = ()
    version: int = 0

    @classmethod
    def of(cls, fleet: FleetGetReply, *, version: int = 0) -> FleetIndex:
        nodes = {node.name: _entry(node) for node in sorted(fleet.nodes, key=lambda n: n.name)}
        groups: dict[str, dict[str, list[str]]] = {g: {} for g in GROUPINGS}
        for node in nodes.values():
            for grouping in GROUPINGS:
                groups[grouping].setdefault(node.key(grouping), []).append(node.name)
        domains_of: dict[str, list[DomainView]] = {}
        for domain in fleet.domains:
            for host in {member.split("/", 1)[0] for member in domain.members}:
                domains_of.setdefault(host, []).append(domain)
        return cls(
            nodes=nodes,
            groups={g: {k: tuple(v) for k, v in sorted(keys.items())} for g, keys in groups.items()},
            domains_of={k: tuple(v) for k, v in domains_of.items()},
            tpu_pods=tuple(fleet.tpu_pods),
            version=version,
        )


def _entry(node: NodeView) -> NodeEntry:
    return NodeEntry(
        name=node.name,
        region=node.region,
        cluster=f"{node.region}/{node.cluster}",
        rack=node.rack,
        sku=node.sku,
        kind=node.kind,
        state=node.state,
        gpus=tuple(
            GpuEntry(a.id, a.index, a.hbm_total_bytes, a.domain)
            for a in sorted(node.accelerators, key=lambda a: a.index)
        ),
    )


# -- who holds what: reservations and the rebalancer's targets, as lookups --------------------------


@dataclass(frozen=True, slots=True)
class Reserved:
    reservation_id: str
    tenant: str
    policy: str


@dataclass
class Holdings:
    """Per accelerator: its reservation and the borrowers' allocations on it; firing alerts per key."""

    reserved: dict[str, Reserved] = field(default_factory=dict)
    borrowed: dict[str, set[str]] = field(default_factory=dict)  # accelerator -> borrowers' allocation ids
    firing: dict[str, list[str]] = field(default_factory=dict)  # node / allocation / pod -> "hbm_hot 0.93"

    @classmethod
    def of(
        cls, statuses: Iterable[ReservationStatusReply] = (), rebalancer: RebalanceStatusReply | None = None
    ) -> Holdings:
        holdings = cls()
        for reply in statuses:
            for view in reply.reservations:
                entry = Reserved(view.reservation_id, view.tenant, str(view.policy))
                for acc in view.accelerators:
                    holdings.reserved[acc] = entry
                for borrower in view.borrowers:
                    for acc in borrower.accelerators:
                        holdings.borrowed.setdefault(acc, set()).add(borrower.allocation_id)
        for detector in rebalancer.detectors if rebalancer is not None else ():
            for target in detector.targets:
                if target.phase == "firing":
                    holdings.firing.setdefault(target.key, []).append(f"{detector.name} {target.value:.2f}")
        return holdings


def gpu_state(
    node_state: str, held: AcceleratorLedgerView | None, reserved: Reserved | None, borrowed: set[str]
) -> str:
    """One GPU's state: unavailable (node lost), lent or placed (a replica on it), reserved (hard, or soft:
    lendable) with nothing on it yet, or free."""
    if node_state != "up" or (held is not None and not held.available):
        return UNAVAILABLE
    if held is not None and held.allocations:
        if reserved is not None and borrowed.intersection(held.allocations):
            return LENT
        return PLACED
    if reserved is not None:
        return RESERVED_HARD if reserved.policy == "hard" else RESERVED_SOFT
    return FREE


# -- the fleet now ------------------------------------------------------------------------------------


@dataclass(slots=True)
class Tally:
    """GPUs per state, nodes, HBM held / usable and alerts: a node's, or a group's (the sum of its nodes')."""

    nodes: int = 0
    gpus: int = 0
    states: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STATES, 0))
    hbm_used_bytes: int = 0
    hbm_usable_bytes: int = 0
    alerts: int = 0
    nodes_alerting: int = 0

    def add(self, other: Tally) -> None:
        self.nodes += other.nodes
        self.gpus += other.gpus
        for state, count in other.states.items():
            self.states[state] += count
        self.hbm_used_bytes += other.hbm_used_bytes
        self.hbm_usable_bytes += other.hbm_usable_bytes
        self.alerts += other.alerts
        self.nodes_alerting += other.nodes_alerting

    def row(self) -> dict[str, Any]:
        busy = self.states[PLACED] + self.states[LENT]
        return {
            "nodes": self.nodes,
            "gpus": self.gpus,
            **{state: self.states[state] for state in STATES},
            "reserved": self.states[RESERVED_HARD] + self.states[RESERVED_SOFT],
            "hbm_used_bytes": self.hbm_used_bytes,
            "hbm_total_bytes": self.hbm_usable_bytes,
            # Fill: the share of GPUs that hold a replica (placed or lent).
            "fill": round(busy / self.gpus, 4) if self.gpus else None,
            "alerts": self.alerts,
            "nodes_alerting": self.nodes_alerting,
        }


@dataclass(frozen=True)
class NodeNow:
    entry: NodeEntry
    states: str  # one letter per GPU (LETTERS), in index order
    tally: Tally
    alerts: tuple[str, ...]


@dataclass(frozen=True)
class FleetView:
    """The fleet as of one ledger snapshot: per node, per group, and the whole fleet."""

    index: FleetIndex
    ledger: dict[str, AcceleratorLedgerView]
    holdings: Holdings
    nodes: dict[str, NodeNow]
    groups: dict[str, dict[str, Tally]]
    total: Tally

    @classmethod
    def of(cls, index: FleetIndex, ledger: SnapshotReply | None, holdings: Holdings | None = None) -> FleetView:
        holdings = holdings or Holdings()
        held = {acc.id: acc for acc in (ledger.accelerators if ledger else [])}
        allocations_on: dict[str, set[str]] = {}  # node -> allocation ids (for the allocations' alerts)
        nodes: dict[str, NodeNow] = {}
        for entry in index.nodes.values():
            tally = Tally(nodes=1, gpus=len(entry.gpus))
            letters = []
            missing = 0
            for gpu in entry.gpus:
                view = held.get(gpu.id)
                if view is None:
                    missing += 1
                else:
                    tally.hbm_used_bytes += view.hbm_reserved_bytes
                    if view.allocations:
                        allocations_on.setdefault(entry.name, set()).update(view.allocations)
                state = gpu_state(
                    entry.state, view, holdings.reserved.get(gpu.id), holdings.borrowed.get(gpu.id, set())
                )
                tally.states[state] += 1
                tally.hbm_usable_bytes += view.hbm_usable_bytes if view is not None else gpu.hbm_total_bytes
                letters.append(LETTERS[state])
            alerts = _alerts(entry, missing, ledger is not None, holdings, allocations_on.get(entry.name, set()))
            tally.alerts = len(alerts)
            tally.nodes_alerting = 1 if alerts else 0
            nodes[entry.name] = NodeNow(entry, "".join(letters), tally, tuple(alerts))
        groups: dict[str, dict[str, Tally]] = {}
        total = Tally()
        for grouping, keys in index.groups.items():
            groups[grouping] = {}
            for key, names in keys.items():
                tally = Tally()
                for name in names:
                    tally.add(nodes[name].tally)
                groups[grouping][key] = tally
        for now in nodes.values():
            total.add(now.tally)
        return cls(index=index, ledger=held, holdings=holdings, nodes=nodes, groups=groups, total=total)

    # -- what the page asks for ---------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """The fleet in a few rows: the whole fleet, then per region, cluster and SKU; the first alerts."""
        alerting = [(name, now.alerts) for name, now in self.nodes.items() if now.alerts]
        return {
            "total": self.total.row(),
            "groups": {
                grouping: [{"key": key, **tally.row()} for key, tally in keys.items()]
                for grouping, keys in self.groups.items()
            },
            "alerts": [{"node": name, "what": what} for name, alerts in alerting[:ALERTS_SHOWN] for what in alerts],
            "alerts_total": self.total.alerts,
        }

    def group_nodes(self, grouping: str, key: str, *, offset: int = 0, limit: int = 100) -> dict[str, Any]:
        """One page of a group's nodes (sorted by name), each with its GPUs' states as letters."""
        if grouping not in GROUPINGS:
            raise ViewError(400, f"by: one of {', '.join(GROUPINGS)}")
        if not 0 <= offset or not 1 <= limit <= PAGE_MAX:
            raise ViewError(400, f"offset >= 0 and 1 <= limit <= {PAGE_MAX}")
        names = self.index.groups[grouping].get(key)
        if names is None:
            raise ViewError(404, f"no {grouping} {key!r} in the fleet")
        return {
            "by": grouping,
            "key": key,
            "total": len(names),
            "offset": offset,
            "limit": limit,
            "nodes": [self._node_row(self.nodes[name]) for name in names[offset : offset + limit]],
        }

    def node(self, name: str, *, profile: NodeProfilePayload | None = None) -> dict[str, Any]:
        """One node's GPUs: each with its state, HBM, allocations and reservation; its NVLink domains with
        the edges ``profile`` (its link matrix) gives."""
        now = self.nodes.get(name)
        if now is None:
            raise ViewError(404, f"no node {name!r} in the fleet")
        entry = now.entry
        gpus = []
        seen: set[str] = set()
        for gpu, letter in zip(entry.gpus, now.states, strict=True):
            held = self.ledger.get(gpu.id)
            reserved = self.holdings.reserved.get(gpu.id)
            allocations = list(held.allocations) if held else []
            seen.update(allocations)
            gpus.append(
                {
                    "id": gpu.id,
                    "index": gpu.index,
                    "domain": gpu.domain,
                    "state": _STATE_OF[letter],
                    "hbm_total_bytes": gpu.hbm_total_bytes,
                    "hbm_usable_bytes": held.hbm_usable_bytes if held else gpu.hbm_total_bytes,
                    "hbm_used_bytes": held.hbm_reserved_bytes if held else 0,
                    "in_ledger": held is not None,
                    "shared": held.shared if held else False,
                    "allocations": allocations,
                    "borrowers": sorted(self.holdings.borrowed.get(gpu.id, set()) & set(allocations)),
                    "reservation": (
                        {"id": reserved.reservation_id, "tenant": reserved.tenant, "policy": reserved.policy}
                        if reserved
                        else None
                    ),
                }
            )
        profiles = {name: profile} if profile is not None else {}
        domains = [
            {
                "id": d.id,
                "kind": d.kind,
                "members": d.members,
                "cliques": d.cliques,
                "edges": nvlink_edges(d, profiles),
            }
            for d in self.index.domains_of.get(name, ())
            if len(d.members) >= 2
        ]
        return {**self._node_row(now), "gpus": gpus, "domains": domains, "allocations": sorted(seen)}

    def _node_row(self, now: NodeNow) -> dict[str, Any]:
        entry = now.entry
        return {
            "name": entry.name,
            "region": entry.region,
            "cluster": entry.cluster,
            "rack": entry.rack,
            "sku": entry.sku,
            "kind": entry.kind,
            "state": entry.state,
            "gpu_states": now.states,
            "hbm_used_bytes": now.tally.hbm_used_bytes,
            "hbm_total_bytes": now.tally.hbm_usable_bytes,
            "alerts": list(now.alerts),
        }


_STATE_OF = {letter: state for state, letter in LETTERS.items()}


def _alerts(entry: NodeEntry, missing: int, have_ledger: bool, holdings: Holdings, allocations: set[str]) -> list[str]:
    """What needs an operator on this node: lost, GPUs the ledger does not know (topology and the ledger
    drifted apart), the rebalancer's detectors firing on it or on a replica it holds."""
    alerts = []
    if entry.state != "up":
        alerts.append(f"node {entry.state}")
    if have_ledger and missing:
        alerts.append(f"{missing} GPU(s) not in the ledger")
    alerts.extend(holdings.firing.get(entry.name, ()))
    for allocation in sorted(allocations):
        alerts.extend(f"{what} on {allocation}" for what in holdings.firing.get(allocation, ()))
    return alerts


def summary_document(
    view: FleetView | None,
    *,
    now: datetime,
    errors: Mapping[str, str],
    reservations: dict[str, Any] | None,
    rebalancer: RebalanceStatusReply | None,
    placements: list[dict[str, Any]],
    allocations: Mapping[str, Mapping[str, Any]],
    cross_domain_used: Mapping[str, int],
) -> dict[str, Any]:
    """What `GET /api/summary` sends: the fleet's summary (no node, no GPU), the TPU pods, reservations
    (each with a count, not its accelerators), recent placements (labels for their allocations only) and
    the rebalancer. Its size grows with the number of groups, not of GPUs."""
    shown = {row["allocation_id"] for row in placements if row.get("allocation_id")}
    return {
        "generated_at": now.isoformat(),
        "errors": dict(errors),
        "fleet": view.summary() if view is not None else None,
        "fleet_version": view.index.version if view is not None else None,
        "tpu_pods": pods_of(view.index.tpu_pods, view.ledger) if view is not None else [],
        "cross_domain_used": dict(cross_domain_used),
        "reservations": reservations,
        "placements": placements,
        "allocations": {a: dict(allocations[a]) for a in sorted(shown) if a in allocations},
        "rebalancer": rebalancer.model_dump(mode="json") if rebalancer is not None else None,
    }
