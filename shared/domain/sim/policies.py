"""Where a replica goes: ``hetsched`` (ours, ``placement.decide``) and the baselines it is compared with.

Every policy is ``placement.decide`` itself: the same prefilter, the same hard filters (HBM, NVLink
clique, exclusivity, TPU slice, rack power, PCIe), the same TP rule (the fewest accelerators at which
a candidate passes every filter) and the same fallback ladder. The baselines differ from ours only in
the choice among the candidates that pass: each runs a profile whose filters are ``DEFAULT_PROFILE``'s
and whose scores are its own (``BASELINE_REGISTRY`` adds the baselines' score plugins):

* ``first-fit``: no score, so every candidate ties and the lowest host id wins (host ids are node
  names, NVLink fabric domain ids, TPU pod names); inside it, the group the ``nvlink_group`` filter binds.
* ``gpu-index``: first-fit's host; inside a node, the lowest GPU indices that form an NVLink clique of
  idle GPUs with room, as serving engines number devices (a TPU slice or a shared GPU: first-fit's).
* ``random``: a seeded uniform score per host (``random`` plugin), every host judged on its own: a
  random host among those that pass. The draw depends on the seed, the request id and the host id only.
* ``cheapest-sku``: the lowest hourly price of the accelerators at the chosen count (``hourly_price``
  plugin), lowest host id among equals; when the cheapest SKU is full the next cheapest takes the
  replica (a policy that refused while pricier capacity was free would lose to the fleet, not to ours).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Final, Protocol, runtime_checkable

from shared.domain.placement import DEFAULT_PROFILE, DEFAULT_REGISTRY, Decision, FleetSnapshot, PlacementRequest, decide
from shared.domain.placement.framework import (
    Candidate,
    CycleState,
    PluginFactory,
    Profile,
    Scope,
    StateKey,
    demand_of,
    no_config,
    typed_config,
)
from shared.domain.traces import seeded_uniform


class Policy(Protocol):
    """Chooses where one replica goes; may keep state across calls (e.g. a seeded draw counter)."""

    name: str

    def decide(self, snapshot: FleetSnapshot, request: PlacementRequest) -> Decision: ...


@runtime_checkable
class ReleasingPolicy(Protocol):
    """A policy that holds something outside the simulation (a live stack's allocation) and must be told
    when the simulation retires a replica it placed."""

    def released(self, decision: Decision) -> None: ...


# -- the baselines' score plugins -------------------------------------------------------------------

RANDOM: Final = "random"
HOURLY_PRICE: Final = "hourly_price"


def _key(text: str) -> int:
    return zlib.crc32(text.encode())


@dataclass(frozen=True, slots=True)
class RandomConfig:
    seed: int = 0


class RandomScore:
    """A uniform number per (seed, request id, host id). It reads the host's id, which the class
    contract of ``placement.hosts`` forbids: run it with ``group_classes=False``."""

    name: Final = RANDOM

    def __init__(self, config: RandomConfig) -> None:
        self.seed = config.seed

    def prescore(self, state: CycleState, candidates: Sequence[Candidate]) -> None:
        return None

    def score(self, state: CycleState, candidate: Candidate) -> float:
        request = demand_of(state).request.request_id
        return seeded_uniform(self.seed, _key(request), _key(candidate.host.id))


class HourlyPriceScore:
    """The cheapest candidate's hourly price per accelerator over this one's (1 = cheapest). Every
    candidate of one count has as many accelerators, so this ranks the replica's price per hour."""

    name: Final = HOURLY_PRICE
    scope: Final = Scope.HOST
    _best: Final[StateKey[float]] = StateKey(HOURLY_PRICE)

    def prescore(self, state: CycleState, candidates: Sequence[Candidate]) -> None:
        state.write(self._best, min((c.host.sku.price_usd_per_hour for c in candidates), default=0.0))

    def score(self, state: CycleState, candidate: Candidate) -> float:
        own = candidate.host.sku.price_usd_per_hour
        return min(1.0, state.read(self._best) / own) if own > 0 else 1.0


def _random_factory(config: Mapping[str, object] | None = None) -> RandomScore:
    return RandomScore(typed_config(RandomConfig, RANDOM, config or {}))


def _price_factory(config: Mapping[str, object] | None = None) -> HourlyPriceScore:
    no_config(HOURLY_PRICE, config)
    return HourlyPriceScore()


BASELINE_REGISTRY: Final[Mapping[str, PluginFactory]] = MappingProxyType(
    {**DEFAULT_REGISTRY, RANDOM: _random_factory, HOURLY_PRICE: _price_factory}
)


def baseline_profile(name: str, scores: tuple[tuple[str, float], ...], **kwargs: object) -> Profile:
    """``DEFAULT_PROFILE`` with its own ``scores``: the same prefilter, filters and ladder config."""
    return replace(DEFAULT_PROFILE, name=name, scores=scores, **kwargs)  # type: ignore[arg-type]


# -- the policies -------------------------------------------------------------------------------------


@dataclass
class HetschedPolicy:
    """Ours: the placement framework's ``decide`` with ``DEFAULT_PROFILE``."""

    name: str = "hetsched"

    def decide(self, snapshot: FleetSnapshot, request: PlacementRequest) -> Decision:
        return decide(snapshot, request)


@dataclass
class ProfilePolicy:
    """A baseline: ``decide`` with ``profile`` (the default filters, its own scores)."""

    name: str
    profile: Profile

    def decide(self, snapshot: FleetSnapshot, request: PlacementRequest) -> Decision:
        return decide(snapshot, request, self.profile, registry=BASELINE_REGISTRY)


FIRST_FIT: Final = baseline_profile("first-fit", ())
CHEAPEST_SKU: Final = baseline_profile("cheapest-sku", ((HOURLY_PRICE, 1.0),))


def random_profile(seed: int) -> Profile:
    config = (*DEFAULT_PROFILE.config, (RANDOM, {"seed": seed}))
    return baseline_profile("random", ((RANDOM, 1.0),), config=config, group_classes=False)


def lowest_index_clique(snapshot: FleetSnapshot, decision: Decision) -> Decision:
    """``decision`` moved, on its node, to the lowest GPU indices that form an NVLink clique of idle
    GPUs each with room for its share (the same GPUs the ``hbm`` and ``nvlink_group`` filters admit);
    a TPU slice, a shared or multi-node placement or a single GPU among several stays as it is."""
    if not decision.placed or decision.tpu is not None or decision.share is None or decision.node is None:
        return decision
    if decision.sharing == "shared" or len(decision.nodes) != 1 or decision.pp > 1 or decision.fallback:
        return decision
    node = snapshot.nodes[decision.node]
    need, tp = decision.share.total, len(decision.accelerators)
    roomy = []
    for acc in node.accelerators:
        cap = snapshot.capacity[node.accelerator_id(acc.index)]
        if cap.available and cap.idle and cap.free >= need:
            roomy.append(acc.index)
    links = node.links

    def extend(group: list[int], start: int) -> list[int] | None:
        if len(group) == tp:
            return group
        for k in range(start, len(roomy)):
            index = roomy[k]
            if all(links.is_nvlinked(index, other) for other in group):
                found = extend([*group, index], k + 1)
                if found is not None:
                    return found
        return None

    group = extend([], 0) if tp > 1 else roomy[:1]
    if not group:
        return decision
    return replace(decision, accelerators=tuple(node.accelerator_id(i) for i in group))


@dataclass
class GpuIndexPolicy:
    """First-fit's host; on a node, the lowest-index NVLink clique (``lowest_index_clique``)."""

    name: str = "gpu-index"

    def decide(self, snapshot: FleetSnapshot, request: PlacementRequest) -> Decision:
        return lowest_index_clique(snapshot, decide(snapshot, request, FIRST_FIT, registry=BASELINE_REGISTRY))


@dataclass
class RandomPolicy:
    """A seeded random host among those that pass every filter (the ``random`` score)."""

    seed: int = 0
    name: str = "random"
    profile: Profile = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.profile = random_profile(self.seed)

    def decide(self, snapshot: FleetSnapshot, request: PlacementRequest) -> Decision:
        return decide(snapshot, request, self.profile, registry=BASELINE_REGISTRY)


POLICIES: tuple[str, ...] = ("hetsched", "gpu-index", "random", "first-fit", "cheapest-sku")


def make_policy(name: str, *, seed: int = 0) -> Policy:
    """A fresh policy by name (``POLICIES``); ValueError for an unknown one."""
    factories: Mapping[str, Callable[[], Policy]] = {
        "hetsched": HetschedPolicy,
        "gpu-index": GpuIndexPolicy,
        "random": lambda: RandomPolicy(seed=seed),
        "first-fit": lambda: ProfilePolicy("first-fit", FIRST_FIT),
        "cheapest-sku": lambda: ProfilePolicy("cheapest-sku", CHEAPEST_SKU),
    }
    if name not in factories:
        raise ValueError(f"unknown policy {name!r}; expected one of {', '.join(POLICIES)}")
    return factories[name]()
