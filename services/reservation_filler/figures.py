"""What reserved capacity comes to: each reservation's status view (use, fill rate, idle cost at its
price), every live reservation's use per cluster (``Filled``), and the metrics' figures from them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncSession

from services.reservation_filler.metrics import FillFigures
from services.reservation_filler.store import ReservationStore
from shared.contracts.reservation import ReservationStatusView
from shared.domain.hardware import Sku
from shared.domain.reservations import Reservation, Slot, Usage, fill_rate, idle_cost_usd_per_hour, usage
from shared.domain.routing import Region
from shared.infra.reservations import state_of


@dataclass(frozen=True, slots=True)
class Filled:
    """One live reservation's use now: whole, per cluster of its accelerators, and its idle cost."""

    tenant: str
    usage: Usage
    by_cluster: Mapping[str, Usage]
    idle_cost_usd_per_hour: float


def fill_figures(filled: Sequence[Filled]) -> FillFigures:
    """The metrics' figures: fill rate per (tenant, cluster) and overall, idle cost per tenant."""
    by_scope: dict[tuple[str, str], list[Usage]] = {}
    idle: dict[str, float] = {}
    for f in filled:
        idle[f.tenant] = idle.get(f.tenant, 0.0) + f.idle_cost_usd_per_hour
        for cluster, part in f.by_cluster.items():
            by_scope.setdefault((f.tenant, cluster), []).append(part)
    return FillFigures(
        by_tenant_cluster={scope: rate for scope, u in by_scope.items() if (rate := fill_rate(u)) is not None},
        overall=fill_rate([f.usage for f in filled]),
        idle_cost_by_tenant=idle,
    )


class Pricing:
    """A reservation's hourly price per GPU: its region's price for its SKU, else the catalog's."""

    def __init__(self, *, skus: Mapping[str, Sku], regions: Mapping[str, Region]) -> None:
        self.skus = skus
        self._regions = regions

    def price(self, reservation: Reservation) -> float | None:
        if reservation.sku is None:
            return None
        region = self._regions.get(reservation.region or "")
        if region is not None and reservation.sku in region.price_usd_per_hour:
            return float(region.price_usd_per_hour[reservation.sku])
        sku = self.skus.get(reservation.sku)
        return sku.price_usd_per_hour if sku is not None else None

    def view(self, reservation: Reservation, current: Usage) -> ReservationStatusView:
        """A reservation as ``reservation.status`` shows it, used as ``current`` says."""
        state = state_of(reservation)
        return ReservationStatusView(
            reservation_id=reservation.id,
            tenant=reservation.tenant,
            policy=reservation.policy,
            sku=reservation.sku,
            region=reservation.region,
            accelerators=list(reservation.accelerators),
            owner_used=len(current.owner_used),
            lent=len(current.lent),
            idle=len(current.idle),
            offered=len(reservation.offered),
            fill_rate=round(current.fill_rate, 4),
            idle_cost_usd_per_hour=round(idle_cost_usd_per_hour(current, self.price(reservation)), 4),
            borrowers=state.borrowers,
            preemptions=state.preemptions,
        )


async def filled(*, store: ReservationStore, session: AsyncSession, pricing: Pricing) -> list[Filled]:
    """Every live reservation's use now (what the report and the metrics are worked out from)."""
    reservations = await store.load_many(session=session)
    everything = {acc for r in reservations for acc in r.accelerators}
    uses = await store.uses_on(session=session, accelerators=everything)
    inventory = await store.inventory(session=session, ids=everything)
    out: list[Filled] = []
    for reservation in reservations:
        current = usage(reservation, uses)
        out.append(
            Filled(
                tenant=reservation.tenant,
                usage=current,
                by_cluster={
                    cluster: _restricted(current, accs)
                    for cluster, accs in _by_cluster(reservation.accelerators, inventory).items()
                },
                idle_cost_usd_per_hour=pricing.view(reservation, current).idle_cost_usd_per_hour,
            )
        )
    return out


def rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _by_cluster(accelerators: Iterable[str], inventory: Mapping[str, Slot]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for acc in accelerators:
        slot = inventory.get(acc)
        out.setdefault(slot.cluster if slot is not None else "unknown", set()).add(acc)
    return out


def _restricted(current: Usage, accelerators: set[str]) -> Usage:
    return Usage(
        owner_used=current.owner_used & accelerators, lent=current.lent & accelerators, idle=current.idle & accelerators
    )
