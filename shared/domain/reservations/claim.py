"""What a new reservation may take, as pure functions: the accelerators a create names or asks for by
``count`` + ``sku`` + ``region``, checked against what is reserved already and what other tenants use.

Each answers a ``Claim`` (the accelerators, and the SKU and region they share) or a ``Refused`` (an error
code of the one vocabulary, a message and its details); nothing here knows of storage or the wire.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from shared.domain.errors import ErrorCode
from shared.domain.fleet import AcceleratorId
from shared.domain.names import ECHO, unknown_name
from shared.domain.reservations.rules import Slot, choose, free_slots


@dataclass(frozen=True, slots=True)
class Claim:
    """The accelerators a new reservation takes; ``sku`` / ``region``: the one they all share, else None."""

    accelerators: tuple[str, ...]
    sku: str | None
    region: str | None


@dataclass(frozen=True, slots=True)
class Refused:
    """Why a create is refused (nothing is recorded)."""

    code: ErrorCode
    message: str
    details: Mapping[str, object] = field(default_factory=dict)


def unclaimable(accelerators: Sequence[str] | None, *, sku: str | None, skus: Collection[str]) -> Refused | None:
    """What makes a create's request wrong before anything is read: a named id that is not a GPU's (TPU
    chips cannot be reserved yet), or, by count, a SKU the catalog does not list."""
    if accelerators:
        for acc in accelerators:
            try:
                parsed = AcceleratorId.parse(acc)
            except ValueError:
                return Refused(ErrorCode.INVALID_REQUEST, f"not an accelerator id: {acc[:64]!r}")
            if parsed.gpu_index is None:
                return Refused(ErrorCode.INVALID_REQUEST, "TPU chips cannot be reserved (GPUs only for now)")
        return None
    if sku not in skus:
        given = sku or ""
        return Refused(
            ErrorCode.UNKNOWN_SKU, unknown_name("SKU", given, skus, prefix=f"no SKU {given[:ECHO]!r} in the catalog")
        )
    return None


def in_use(count: int, asked: int) -> Refused:
    """Some of the GPUs asked for are reserved or used already: how many, never which (which GPUs other
    tenants use is theirs to know)."""
    return Refused(
        ErrorCode.CONFLICT,
        f"{count} of the {asked} GPU(s) asked for are reserved already or used by another tenant",
        {"in_use": count},
    )


def claim_named(
    accelerators: Sequence[str],
    *,
    known: Mapping[str, Slot],
    taken: Collection[str],
    used_by_others: Collection[str],
) -> Claim | Refused:
    """The accelerators named, when every one is in the fleet (``known``), in no reservation (``taken``)
    and unused by other tenants; their SKU and region when they all share one."""
    unknown = [acc for acc in accelerators if acc not in known]
    if unknown:
        return Refused(ErrorCode.NOT_FOUND, f"no such GPU in the fleet: {', '.join(unknown[:8])}")
    clash = [acc for acc in accelerators if acc in taken or acc in used_by_others]
    if clash:
        return in_use(len(clash), len(accelerators))
    skus = {known[acc].sku for acc in accelerators}
    regions = {known[acc].region for acc in accelerators}
    return Claim(
        accelerators=tuple(accelerators),
        sku=skus.pop() if len(skus) == 1 else None,
        region=regions.pop() if len(regions) == 1 else None,
    )


def free(
    inventory: Iterable[Slot], *, sku: str, region: str, taken: Collection[str], used_by_others: Collection[str]
) -> int:
    """How many GPUs of ``sku`` in ``region`` are neither reserved nor used by another tenant."""
    return len(free_slots(inventory, sku=sku, region=region, taken=taken, used_by_others=used_by_others))


def claim_count(
    inventory: Iterable[Slot],
    *,
    count: int,
    sku: str,
    region: str,
    taken: Collection[str],
    used_by_others: Collection[str],
) -> Claim | Refused:
    """``count`` GPUs of ``sku`` in ``region`` (``choose``: whole nodes first), or ``no_capacity`` with how
    many are free."""
    slots = list(inventory)
    picked = choose(slots, count=count, sku=sku, region=region, taken=taken, used_by_others=used_by_others)
    if picked is None:
        left = free(slots, sku=sku, region=region, taken=taken, used_by_others=used_by_others)
        return Refused(
            ErrorCode.NO_CAPACITY,
            f"{left} {sku} GPU(s) in {region} are neither reserved nor used by another tenant; {count} asked",
            {"free": left},
        )
    return Claim(accelerators=picked, sku=sku, region=region)
