"""The placement framework, after the Kubernetes scheduler framework (STYLE §2).

Extension points, in the order a decision runs them:

* **PreFilter** (one per profile): turns the request into a ``Demand`` (memory per TP degree,
  backends, SKUs) written to the ``CycleState``, or refuses the request with a typed error.
* **Filter**: judges one candidate and returns a ``Status`` with structured reasons, never a bool.
  ``Scope.HOST`` filters read only the request and the host's fixed facts and run once per class of
  hosts; ``Scope.PLACEMENT`` filters read the TP degree, the memory share and the host's load and run
  per load class and TP degree. A filter that chooses the accelerators (NVLink group, TPU slice)
  returns them as the status's ``binding``; the runner hands the bound candidate to later filters.
* **Score**: ``prescore`` sees every feasible candidate of the TP degree (for normalisation), then
  ``score`` returns a value in [0, 1]; the runner, not the plugin, checks the range and applies the
  profile's weights.

Plugins are stateless apart from their validated config; per-decision scratch data lives in the
``CycleState`` under the plugin's name. The registry (``registry.py``) maps names to factories; a
``Profile`` lists the enabled plugins and score weights.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Final, Generic, Protocol, TypeVar, cast

from shared.domain.memory import MemoryShare
from shared.domain.models import ModelSpec
from shared.domain.placement.hosts import (
    SCREENS_KEPT,
    GpuHost,
    Host,
    HostKind,
    Load,
    LoadClass,
    SnapshotIndex,
    StaticClass,
)
from shared.domain.placement.types import FleetSnapshot, PlacementRequest, RejectionClass
from shared.domain.topology.tpu import TpuSlice, TpuType

T = TypeVar("T")
C = TypeVar("C")

GB: Final = 1e9


def tenths_of_gb(nbytes: int) -> int:
    """Bytes in tenths of a GB, rounded half up: the precision reasons are told and grouped at."""
    return (nbytes + 50_000_000) // 100_000_000


class Code(StrEnum):
    """Why a plugin said no (or ``success``). Prefilter codes double as the decision's error code."""

    SUCCESS = "success"
    # request errors (prefilter)
    UNKNOWN_MODEL = "unknown_model"
    UNKNOWN_SKU = "unknown_sku"
    INVALID_REQUEST = "invalid_request"
    # candidate rejections (filters)
    BACKEND_UNSUPPORTED = "backend_unsupported"
    SKU_NOT_ALLOWED = "sku_not_allowed"
    REGION_MISMATCH = "region_mismatch"
    FORBIDDEN = "forbidden"
    NO_TPU_SHAPE = "no_tpu_shape"
    TOO_FEW_ACCELERATORS = "too_few_accelerators"
    HBM_SHORT = "hbm_short"
    NO_NVLINK_GROUP = "no_nvlink_group"
    NO_TPU_SLICE = "no_tpu_slice"
    RACK_POWER_SHORT = "rack_power_short"
    SLO_MISS = "slo_miss"
    PCIE_BUSY = "pcie_busy"


class Scope(StrEnum):
    HOST = "host"
    PLACEMENT = "placement"


@dataclass(frozen=True, slots=True)
class GpuGroup:
    """A TP group: positions into the host's ``members``, in TP rank order."""

    positions: tuple[int, ...]


Binding = GpuGroup | TpuSlice


@dataclass(frozen=True, slots=True)
class Status:
    """A plugin's verdict. Figures are structured (``hbm_short_bytes=3.2e9, tp=4``); ``describe``
    puts them in words, rounded, and candidates whose words agree form one rejection class."""

    code: Code = Code.SUCCESS
    plugin: str = ""
    tp: int | None = None
    hbm_short_bytes: int | None = None
    available: int | None = None
    largest_group: int | None = None
    busy_gpus_allowed: int | None = None
    busy_gpus_needed: int | None = None
    message: str = ""
    note: str = ""
    binding: Binding | None = None

    @property
    def ok(self) -> bool:
        return self.code is Code.SUCCESS

    def describe(self) -> str:
        """The reason in words, with rounded figures (0.1 GB): "HBM short by 3.2 GB per GPU at TP=4"."""
        at = f" at TP={self.tp}" if self.tp is not None else ""
        if self.code is Code.HBM_SHORT and self.hbm_short_bytes is not None:
            tenths = tenths_of_gb(self.hbm_short_bytes)
            return f"HBM short by {tenths // 10}.{tenths % 10} GB per GPU{at}"
        if self.code is Code.TOO_FEW_ACCELERATORS:
            return f"only {self.available} GPU{'' if self.available == 1 else 's'} available{at}"
        if self.code is Code.NO_NVLINK_GROUP:
            return (
                f"no free NVLink group of {self.tp} GPUs with room (largest all-pairs-NVLinked group "
                f"of GPUs with room: {self.largest_group}){at}"
            )
        if self.code is Code.RACK_POWER_SHORT:
            return (
                f"rack power budget lets {self.busy_gpus_allowed} more GPUs turn busy, "
                f"the group turns {self.busy_gpus_needed}{at}"
            )
        return f"{self.message}{at}" if self.message else f"{self.code.value}{at}"


SUCCESS: Final = Status()


class StateKey(Generic[T]):
    """A typed slot of the cycle state; ``name`` is the owning plugin's name.

    A plain slotted class, not a frozen dataclass: ``StateKey[int]("x")`` must work, and a frozen
    slotted dataclass refuses the ``__orig_class__`` that subscripted construction sets."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"StateKey({self.name!r})"


class CycleState:
    """Scratch data of one decision, keyed by plugin name (never globals)."""

    __slots__ = ("_data",)

    def __init__(self) -> None:
        self._data: dict[str, object] = {}

    def write(self, key: StateKey[T], value: T) -> None:
        self._data[key.name] = value

    def read(self, key: StateKey[T]) -> T:
        """The value under ``key``; ``KeyError`` naming it when no plugin wrote it."""
        try:
            return cast(T, self._data[key.name])
        except KeyError:
            raise KeyError(f"cycle state has no {key.name!r}: is its plugin enabled?") from None

    def get(self, key: StateKey[T]) -> T | None:
        return cast("T | None", self._data.get(key.name))  # a string: `T | None` would build a Union per call


# -- what the prefilter derives -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TpuDemand:
    """A replica on one TPU type: the smallest legal slice holding it, or why there is none."""

    chips: int | None
    shape: tuple[int, ...] | None
    share: MemoryShare | None
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Demand:
    """What the request needs, per TP degree. ``levels`` are the accelerator counts to try, in order;
    ``gpu_shares`` the per-GPU share at each GPU TP degree; ``tpu`` the slice per (TPU type, usable
    bytes per chip). ``input_tokens``/``output_tokens`` are the request's or, absent, half the context."""

    request: PlacementRequest
    model: ModelSpec
    dtype: str
    kv_dtype: str
    backends: frozenset[str]
    skus: frozenset[str] | None
    input_tokens: int
    output_tokens: int
    shape_given: bool
    gpu_shares: Mapping[int, MemoryShare]
    tpu: Mapping[tuple[TpuType, int], TpuDemand]
    levels: tuple[int, ...]
    notes: tuple[str, ...] = ()

    def share_for(self, host: Host, level: int) -> MemoryShare | None:
        """The per-accelerator share ``host`` must hold at ``level`` accelerators, or None when the
        host is not a candidate at that level (a TPU slice has one size per type)."""
        if isinstance(host, GpuHost):
            return self.gpu_shares.get(level)
        tpu = self.tpu.get((host.tpu_type, host.usable_per_chip))
        return tpu.share if tpu is not None and tpu.chips == level else None


DEMAND: Final[StateKey[Demand]] = StateKey("demand")
SNAPSHOT: Final[StateKey[FleetSnapshot]] = StateKey("snapshot")


def demand_of(state: CycleState) -> Demand:
    return state.read(DEMAND)


def sharing_of(state: CycleState) -> str:
    """The request's sharing mode (``exclusive`` unless it asked for ``shared``)."""
    demand = state.get(DEMAND)
    return demand.request.sharing if demand is not None else "exclusive"


@dataclass(frozen=True, slots=True)
class Candidate:
    """One way to place the replica: a host (speaking for its class), its load, the TP degree
    (accelerator count) and per-accelerator share, and the accelerators once a filter bound them.
    ``tp`` is 0 and ``share`` None in host-scope filters."""

    host: Host
    load: Load
    tp: int
    share: MemoryShare | None
    binding: Binding | None = None


# -- plugin protocols ---------------------------------------------------------------------------


class PreFilter(Protocol):
    @property
    def name(self) -> str: ...

    def prefilter(self, state: CycleState, snapshot: FleetSnapshot, request: PlacementRequest) -> Status:
        """Write the ``Demand`` to ``state`` and return success, or an error status (request codes)."""
        ...


class Filter(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def scope(self) -> Scope: ...

    def filter(self, state: CycleState, candidate: Candidate) -> Status: ...


class BulkFilter(Protocol):
    """Optional on a placement-scope filter: judge a static class's load classes at one TP degree in
    one call. Must agree with ``filter`` class by class: the survivors are exactly the classes
    ``filter`` passes, and each rejected class's status reads as ``filter``'s would. The runner uses
    it for the leading filters of the profile that have it, then runs the whole chain on survivors."""

    def filter_bulk(
        self, state: CycleState, host: Host, tp: int, share: MemoryShare, classes: Sequence[LoadClass]
    ) -> tuple[list[LoadClass], list[tuple[Status, int]]]:
        """The surviving classes, and (status, hosts) per group of rejected classes. A filter whose
        outcome depends on nothing but ``tp``, ``share.total``, the request's sharing mode and the
        classes says so with ``capacity = True``: the runner may then reuse it for the next request."""
        ...


class Score(Protocol):
    @property
    def name(self) -> str: ...

    def prescore(self, state: CycleState, candidates: Sequence[Candidate]) -> None:
        """See the TP degree's candidates that passed the bulk screen (HBM, NVLink, SLO), before
        binding and before any is scored: the set to normalise against."""
        ...

    def score(self, state: CycleState, candidate: Candidate) -> float:
        """A value in [0, 1], higher is better. A plugin whose value depends only on the request, the
        TP degree and the host's static facts says so with ``scope = Scope.HOST``: the runner then
        asks once per class of hosts and TP degree, before the candidate is bound. Others may offer
        ``bound(state, candidate) -> float``: an upper limit of ``score`` computable before binding
        (it must never be below the score, or the runner may skip the best candidate)."""
        ...


Plugin = PreFilter | Filter | Score
PluginFactory = Callable[[Mapping[str, object]], object]


class ScoreRangeError(ValueError):
    """A score plugin returned a value outside [0, 1]: a bug in the plugin, not an outcome."""


def typed_config(cls: type[C], plugin: str, raw: Mapping[str, object]) -> C:
    """Build the frozen config dataclass ``cls`` from ``raw``: unknown keys and values of the wrong
    type (judged by each field's default) raise ``ValueError`` naming the plugin and the key."""
    fields = {f.name: f for f in dataclasses.fields(cast(Any, cls))}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ValueError(f"plugin {plugin}: unknown config {', '.join(unknown)}; known: {', '.join(sorted(fields))}")
    for key, value in raw.items():
        default = fields[key].default
        expected: tuple[type, ...] = (int, float) if isinstance(default, float) else (type(default),)
        if isinstance(value, bool) != isinstance(default, bool) or not isinstance(value, expected):
            raise ValueError(f"plugin {plugin}: config {key} expects {type(default).__name__}, got {value!r}")
    return cls(**raw)


def no_config(plugin: str, config: Mapping[str, object] | None) -> None:
    """For plugins without settings: any config is a mistake worth hearing about."""
    if config:
        raise ValueError(f"plugin {plugin} takes no config, got {', '.join(sorted(config))}")


# -- profiles -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Profile:
    """Which plugins run and how scores weigh. ``config`` holds per-plugin settings (validated by the
    plugin's factory); ``group_classes`` judges hosts per class (see ``hosts.py``), False per host."""

    name: str
    prefilter: str
    filters: tuple[str, ...]
    scores: tuple[tuple[str, float], ...]
    config: tuple[tuple[str, Mapping[str, object]], ...] = ()
    group_classes: bool = True
    _built: dict[int, object] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, weight in self.scores:
            if not math.isfinite(weight) or weight < 0:
                raise ValueError(f"profile {self.name}: score {name} weight must be finite and >= 0, got {weight}")
        names = [name for name, _ in self.scores]
        if len(set(names)) != len(names) or len(set(self.filters)) != len(self.filters):
            raise ValueError(f"profile {self.name}: a plugin is listed twice")

    def config_for(self, plugin: str) -> Mapping[str, object]:
        return next((cfg for name, cfg in self.config if name == plugin), {})


DEFAULT_PROFILE: Final = Profile(
    name="default",
    prefilter="demand",
    filters=(
        "backend_artifact",
        "sku_allow",
        "region",
        "tenant_rights",
        "tpu_shape",
        "pcie_budget",
        # hbm, nvlink_group and slo judge whole load classes in bulk: they lead the placement filters.
        "hbm",
        "nvlink_group",
        "slo",
        "tpu_slice",
        "rack_power",
        "pcie_load",
    ),
    # Reserve weighs most (a model that also runs on TPU leaves the GPUs to GPU-only models), then cost
    # per served token and SKU fit (with a TTFT target: headroom for long prompts); packing keeps twice
    # link's weight. Measured under load with `hetsched sim --sweep` (docs/PERFORMANCE.md).
    scores=(
        ("sku_fit", 1.0),
        ("link", 0.25),
        ("packing", 0.5),
        ("cost", 1.0),
        ("energy", 0.25),
        ("pcie_budget", 0.25),
        ("reserve", 3.0),
    ),
)


# -- the runner -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Framework:
    """A profile's plugins, instantiated; the runner of its extension points."""

    profile: Profile
    prefilter: PreFilter
    host_filters: tuple[Filter, ...]
    placement_filters: tuple[Filter, ...]
    scores: tuple[tuple[Score, float], ...]
    bulk_filters: tuple[BulkFilter, ...] = ()  # the leading placement filters that judge classes in bulk
    capacity_filters: int = 0  # how many of ``bulk_filters`` lead with ``capacity = True`` (memoisable)

    def run_prefilter(self, state: CycleState, snapshot: FleetSnapshot, request: PlacementRequest) -> Status:
        state.write(SNAPSHOT, snapshot)
        return self.prefilter.prefilter(state, snapshot, request)

    def filter_host(self, state: CycleState, candidate: Candidate) -> tuple[Status, tuple[str, ...]]:
        """The first failing host-scope status (or success) and the notes of those that passed."""
        notes: list[str] = []
        for plugin in self.host_filters:
            status = plugin.filter(state, candidate)
            if status.code is not Code.SUCCESS:
                return status, tuple(notes)
            if status.note:
                notes.append(status.note)
        return SUCCESS, tuple(notes)

    def host_verdicts(
        self, state: CycleState, index: SnapshotIndex
    ) -> list[tuple[StaticClass, Status, tuple[str, ...]]]:
        """``filter_host`` of each static class's representative on ``index``, in index order: judged
        once per decision (the search and the ladder's steps all ask) and kept in the cycle state."""
        known = state.get(_HOST_VERDICTS)
        if known is not None and known[0] is index:
            return known[1]
        verdicts = [
            (static, *self.filter_host(state, Candidate(static.rep, index.loads[static.rep.id], 0, None)))
            for static in index.statics
        ]
        state.write(_HOST_VERDICTS, (index, verdicts))
        return verdicts

    def filter_placement(self, state: CycleState, candidate: Candidate) -> tuple[Status, Candidate, tuple[str, ...]]:
        """Run placement-scope filters in profile order, threading bindings: the first failing
        status, or success with the bound candidate and the notes of the filters."""
        notes: list[str] = []
        for plugin in self.placement_filters:
            status = plugin.filter(state, candidate)
            if status.code is not Code.SUCCESS:
                return status, candidate, tuple(notes)
            if status.binding is not None:
                candidate = Candidate(candidate.host, candidate.load, candidate.tp, candidate.share, status.binding)
            if status.note:
                notes.append(status.note)
        return SUCCESS, candidate, tuple(notes)

    def filter_bulk(
        self,
        state: CycleState,
        host: Host,
        tp: int,
        share: MemoryShare,
        classes: Sequence[LoadClass],
        screens: dict[tuple[object, ...], dict[tuple[object, ...], object]] | None = None,
        static_key: tuple[object, ...] = (),
    ) -> tuple[Sequence[LoadClass], list[tuple[Status, int]]]:
        """Narrow ``classes`` through the bulk filters; the rejected groups, in filter order.

        The leading filters that declare ``capacity = True`` judge only the TP degree, the share's
        total, the sharing mode and the classes: their outcome is kept in ``screens`` (the index's,
        under ``static_key``) and reused by the next request of the same shape."""
        rejected: list[tuple[Status, int]] = []
        plugins = self.bulk_filters
        if screens is not None and self.capacity_filters:
            kept = screens.get(static_key)
            if kept is None or len(kept) >= SCREENS_KEPT:
                kept = screens[static_key] = {}
            key = (tp, share.total, sharing_of(state))
            screened = cast("tuple[Sequence[LoadClass], list[tuple[Status, int]]] | None", kept.get(key))
            if screened is None:
                for plugin in plugins[: self.capacity_filters]:
                    if not classes:
                        break  # nothing left to judge: a later screen would pass nothing and reject nothing
                    classes, out = plugin.filter_bulk(state, host, tp, share, classes)
                    rejected.extend(out)
                kept[key] = (classes, rejected[:])
            else:
                classes = screened[0]
                rejected.extend(screened[1])
            plugins = plugins[self.capacity_filters :]
        for plugin in plugins:
            if not classes:
                break
            classes, out = plugin.filter_bulk(state, host, tp, share, classes)
            rejected.extend(out)
        return classes, rejected

    def score(self, state: CycleState, candidates: Sequence[Candidate]) -> list[dict[str, float]]:
        """Per candidate: each plugin's score and ``total``, the weighted mean (0 with no weights).
        Raises ``ScoreRangeError`` for a score outside [0, 1]."""
        scoring = Scoring(self, state, candidates)
        return [scoring.score(candidate) for candidate in candidates]


_HOST_VERDICTS: Final[StateKey[tuple[SnapshotIndex, list[tuple[StaticClass, Status, tuple[str, ...]]]]]] = StateKey(
    "framework/host_verdicts"
)


class Scoring:
    """Scores of one TP degree's candidates: ``prescore`` once, host-scope scores once per class of
    hosts, weights and range checks applied here. ``upper_bounds`` is what candidates could reach
    before it is bound (placement-scope plugins may offer ``bound``; 1 otherwise), so the runner can
    skip candidates that cannot beat the best one found."""

    __slots__ = ("_host_memo", "_per_host", "_plugins", "_state", "_weight_sum")

    def __init__(self, framework: Framework, state: CycleState, candidates: Sequence[Candidate]) -> None:
        self._plugins = framework.scores
        self._state = state
        for plugin, _ in self._plugins:
            plugin.prescore(state, candidates)
        self._weight_sum = sum(weight for _, weight in self._plugins)
        self._per_host = tuple(getattr(plugin, "scope", Scope.PLACEMENT) is Scope.HOST for plugin, _ in self._plugins)
        self._host_memo: dict[tuple[tuple[object, ...], int], tuple[float, ...]] = {}

    def _host_values(self, candidate: Candidate) -> tuple[float, ...]:
        key = (candidate.host.static_key, candidate.tp)
        values = self._host_memo.get(key)
        if values is None:
            values = tuple(
                self._checked(plugin, plugin.score(self._state, candidate))
                for (plugin, _), per_host in zip(self._plugins, self._per_host, strict=True)
                if per_host
            )
            self._host_memo[key] = values
        return values

    def _checked(self, plugin: Score, value: float) -> float:
        if not 0.0 <= value <= 1.0:  # also catches NaN
            raise ScoreRangeError(f"score plugin {plugin.name} returned {value}")
        return value

    def upper_bounds(self, candidates: Sequence[Candidate]) -> list[float]:
        """The highest ``total`` each candidate can reach once bound (exact for host-scope plugins).
        The candidates share one host class and TP degree (the host-scope part is computed once)."""
        if self._weight_sum <= 0 or not candidates:
            return [0.0] * len(candidates)
        host_values = iter(self._host_values(candidates[0]))
        fixed = 0.0
        bounded: list[tuple[Callable[[CycleState, Candidate], float], float]] = []
        for (plugin, weight), per_host in zip(self._plugins, self._per_host, strict=True):
            if per_host:
                fixed += weight * next(host_values)
            else:
                bound = getattr(plugin, "bound", None)
                if callable(bound):
                    bounded.append((bound, weight))
                else:
                    fixed += weight
        state, scale = self._state, 1 / self._weight_sum
        return [
            (fixed + sum(weight * min(1.0, bound(state, c)) for bound, weight in bounded)) * scale for c in candidates
        ]

    def score(self, candidate: Candidate) -> dict[str, float]:
        """Each plugin's score of a bound candidate and ``total``; ``ScoreRangeError`` out of [0, 1]."""
        host_values = iter(self._host_values(candidate))
        row: dict[str, float] = {}
        total = 0.0
        for (plugin, weight), per_host in zip(self._plugins, self._per_host, strict=True):
            value = next(host_values) if per_host else self._checked(plugin, plugin.score(self._state, candidate))
            row[plugin.name] = value
            total += weight * value
        row["total"] = total / self._weight_sum if self._weight_sum > 0 else 0.0
        return row


def build_framework(profile: Profile, registry: Mapping[str, PluginFactory]) -> Framework:
    """Instantiate ``profile``'s plugins from ``registry`` (cached on the profile per registry).
    Raises ``ValueError`` for an unknown plugin name or a plugin at the wrong extension point."""
    cached = profile._built.get(id(registry))
    if isinstance(cached, Framework):
        return cached

    def make(name: str) -> object:
        factory = registry.get(name)
        if factory is None:
            raise ValueError(f"profile {profile.name}: no plugin {name!r}; registered: {', '.join(sorted(registry))}")
        return factory(profile.config_for(name))

    prefilter = make(profile.prefilter)
    if not callable(getattr(prefilter, "prefilter", None)):
        raise ValueError(f"profile {profile.name}: {profile.prefilter} is not a prefilter plugin")
    filters: list[Filter] = []
    for name in profile.filters:
        plugin = make(name)
        if not callable(getattr(plugin, "filter", None)):
            raise ValueError(f"profile {profile.name}: {name} is not a filter plugin")
        filters.append(cast(Filter, plugin))
    scores: list[tuple[Score, float]] = []
    for name, weight in profile.scores:
        plugin = make(name)
        if not callable(getattr(plugin, "score", None)):
            raise ValueError(f"profile {profile.name}: {name} is not a score plugin")
        scores.append((cast(Score, plugin), weight))
    placement = tuple(f for f in filters if f.scope is Scope.PLACEMENT)
    bulk: list[BulkFilter] = []
    for plugin in placement:
        if not callable(getattr(plugin, "filter_bulk", None)):
            break
        bulk.append(cast(BulkFilter, plugin))
    capacity = 0
    while capacity < len(bulk) and getattr(bulk[capacity], "capacity", False) is True:
        capacity += 1
    framework = Framework(
        profile=profile,
        prefilter=cast(PreFilter, prefilter),
        host_filters=tuple(f for f in filters if f.scope is Scope.HOST),
        placement_filters=placement,
        scores=tuple(scores),
        bulk_filters=tuple(bulk),
        capacity_filters=capacity,
    )
    profile._built[id(registry)] = framework
    return framework


class RejectionTally:
    """Counts rejected candidates per class: (unit, reason code, TP, the reason in rounded words)."""

    __slots__ = ("_counts", "_first")

    def __init__(self) -> None:
        self._counts: dict[tuple[object, ...], int] = {}
        self._first: dict[tuple[object, ...], tuple[Status, HostKind]] = {}

    def add(self, status: Status, count: int, kind: HostKind) -> None:
        # The key holds the figures as `describe` rounds them, so equal keys read the same; the words
        # are only written once per class, in `classes`.
        short = None if status.hbm_short_bytes is None else tenths_of_gb(status.hbm_short_bytes)
        key = (kind, status.code, status.tp, short, status.available, status.largest_group,
               status.busy_gpus_allowed, status.busy_gpus_needed, status.message)  # fmt: skip
        if key in self._counts:
            self._counts[key] += count
        else:
            self._counts[key] = count
            self._first[key] = (status, kind)

    def classes(self) -> tuple[RejectionClass, ...]:
        """Largest classes first, then by TP, unit and words, so the order is stable."""
        rows = []
        for key, count in self._counts.items():
            status, kind = self._first[key]
            rows.append(
                RejectionClass(
                    count=count, reason=status.code.value, detail=status.describe(), tp=status.tp, unit=kind.value
                )
            )
        return tuple(sorted(rows, key=lambda r: (-r.count, r.tp or 0, r.unit, r.detail)))
