"""Choosing a replica for one request, and the order to fail over in.

Candidates are the replicas that are healthy, reported within ``stale_ms``, have room in their queue, hold
the request's context and have KV for it. The first rule that applies picks the choice:

1. ``hint``: a non-auto hint prefers its engine (hybrid counts as ssm);
2. ``long_context``: input over ``long_context_tokens`` prefers engines whose memory does not grow with the
   context: ssm, then hybrid;
3. ``strict_slo``: a TTFT SLO under ``strict_ttft_ms`` prefers the fastest replica that meets it (the
   fastest of all when none does);
4. ``least_cost``: otherwise the cheapest.

A preferred candidate goes first (the cheapest of them); with none, the cheapest of the rest. Every other
candidate follows in failover order: MoE, transformer, SSM, hybrid, and within an engine the lowest
recent latency first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Final

from shared.domain.admission.engines import Engine, ReplicaStatus, request_kv_bytes
from shared.domain.models import ModelSpec

FAILOVER_ORDER: Final = (Engine.MOE, Engine.TRANSFORMER, Engine.SSM, Engine.HYBRID)
"""The product brief's graceful degradation, MoE -> Transformer -> SSM; hybrid after SSM."""
_FAILOVER_RANK: Final = MappingProxyType({engine: index for index, engine in enumerate(FAILOVER_ORDER)})


class Hint(StrEnum):
    AUTO = "auto"
    TRANSFORMER = "transformer"
    SSM = "ssm"
    MOE = "moe"


class Rule(StrEnum):
    HINT = "hint"
    LONG_CONTEXT = "long_context"
    STRICT_SLO = "strict_slo"
    LEAST_COST = "least_cost"


class Exclusion(StrEnum):
    """Why a replica is not a candidate, in the order they are checked."""

    UNKNOWN_MODEL = "unknown_model"  # its model is not in the specs handed in
    UNHEALTHY = "unhealthy"
    STALE = "stale"  # never reported, or not within stale_ms
    QUEUE_FULL = "queue_full"
    CONTEXT = "context"  # input + output exceed the model's max_context
    KV_FULL = "kv_full"


_HINTS: Final = frozenset(Hint)

# The hint's engines; the product brief's SSM engine serves hybrids too.
_HINT_ENGINES: Final[Mapping[Hint, frozenset[Engine]]] = MappingProxyType(
    {
        Hint.TRANSFORMER: frozenset({Engine.TRANSFORMER}),
        Hint.SSM: frozenset({Engine.SSM, Engine.HYBRID}),
        Hint.MOE: frozenset({Engine.MOE}),
    }
)


@dataclass(frozen=True, slots=True)
class AdmitPolicy:
    """Thresholds of the selection rules and the weights of the cost (the product brief's defaults)."""

    stale_ms: float = 15000
    max_queue_depth: int = 16
    long_context_tokens: int = 32000
    strict_ttft_ms: float = 100
    kv_pressure: float = 0.85
    queue_weight: float = 10.0  # cost per queued request
    kv_weight: float = 200.0  # cost per unit of KV use above kv_pressure
    slo_weight: float = 5.0  # cost per ms of p50 latency over the TTFT SLO

    def __post_init__(self) -> None:
        if self.stale_ms < 0 or self.max_queue_depth < 1 or self.long_context_tokens < 0 or self.strict_ttft_ms < 0:
            raise ValueError(f"admit policy: thresholds must be >= 0 (queue depth >= 1): {self}")
        if not 0 <= self.kv_pressure <= 1:
            raise ValueError(f"kv_pressure: expected a fraction in [0, 1], got {self.kv_pressure}")
        if min(self.queue_weight, self.kv_weight, self.slo_weight) < 0:
            raise ValueError(f"admit policy: cost weights must be >= 0: {self}")


@dataclass(frozen=True, slots=True)
class AdmitAsk:
    """One request, as admission sees it. ``ttft_ms``: its time-to-first-token SLO, if any."""

    input_tokens: int
    output_tokens: int
    ttft_ms: float | None
    hint: str = Hint.AUTO

    def __post_init__(self) -> None:
        if self.input_tokens < 0 or self.output_tokens < 0:
            raise ValueError(f"tokens: expected >= 0, got input {self.input_tokens}, output {self.output_tokens}")
        if self.ttft_ms is not None and self.ttft_ms <= 0:
            raise ValueError(f"ttft_ms: expected > 0, got {self.ttft_ms}")
        if self.hint not in _HINTS:
            raise ValueError(f"hint: expected one of {', '.join(Hint)}, got {self.hint!r}")


@dataclass(frozen=True, slots=True)
class Candidate:
    """A replica that can take the request: its KV need, its cost, whether the rule prefers it."""

    replica: ReplicaStatus
    need_bytes: int
    cost: float
    preferred: bool


@dataclass(frozen=True, slots=True)
class Selection:
    """``order[0]`` is the choice and the rest the failover order; empty when nothing can take it."""

    order: tuple[Candidate, ...]
    rule: str
    excluded: Mapping[str, str]
    explanation: str

    @property
    def choice(self) -> Candidate | None:
        return self.order[0] if self.order else None


def least_cost(replica: ReplicaStatus, *, need_bytes: int, ttft_ms: float | None, policy: AdmitPolicy) -> float:
    """The product brief's routing cost (lower is better)::

        10 x queue_depth + 200 x max(0, kv_use - 0.85) + latency_p50_ms + 5 x max(0, latency_p50_ms - ttft_ms)

    with kv_use = (kv_used + held) / kv_total, the replica's pressure before this request (``need_bytes``
    decides whether it fits, not what it costs); the SLO term only with a TTFT SLO.
    """
    del need_bytes  # the brief's pressure term is the replica's present use
    p50 = replica.latency_p50_ms
    cost = policy.queue_weight * replica.queue_depth
    pressure = replica.kv_use - policy.kv_pressure
    if pressure > 0:  # max(0, ...): a term that is 0 adds nothing
        cost += policy.kv_weight * pressure
    cost += p50
    if ttft_ms is not None and p50 > ttft_ms:
        cost += policy.slo_weight * (p50 - ttft_ms)
    return cost


def failover_order(candidates: Sequence[Candidate]) -> tuple[Candidate, ...]:
    """Candidates by engine (MoE, transformer, SSM, hybrid), then lowest p50 latency, then replica id."""
    return tuple(
        sorted(
            candidates, key=lambda c: (_FAILOVER_RANK[c.replica.engine], c.replica.latency_p50_ms, c.replica.replica_id)
        )
    )


def _exclusion(
    replica: ReplicaStatus, spec: ModelSpec | None, ask: AdmitAsk, need_bytes: int, now_ms: float, policy: AdmitPolicy
) -> Exclusion | None:
    if spec is None:
        return Exclusion.UNKNOWN_MODEL
    if not replica.healthy:
        return Exclusion.UNHEALTHY
    if replica.reported_at_ms is None or now_ms - replica.reported_at_ms > policy.stale_ms:
        return Exclusion.STALE
    if replica.queue_depth >= policy.max_queue_depth:
        return Exclusion.QUEUE_FULL
    if ask.input_tokens + ask.output_tokens > spec.max_context:
        return Exclusion.CONTEXT
    if replica.kv_used_bytes + replica.held_bytes + need_bytes > replica.kv_total_bytes:
        return Exclusion.KV_FULL
    return None


def _rule(ask: AdmitAsk, policy: AdmitPolicy) -> Rule:
    if ask.hint != Hint.AUTO:
        return Rule.HINT
    if ask.input_tokens > policy.long_context_tokens:
        return Rule.LONG_CONTEXT
    if ask.ttft_ms is not None and ask.ttft_ms < policy.strict_ttft_ms:
        return Rule.STRICT_SLO
    return Rule.LEAST_COST


def _tiers(rule: Rule, ask: AdmitAsk) -> Mapping[Engine, int]:
    """Preferred engines and their rank (0 first); engines not listed are not preferred."""
    if rule is Rule.HINT:
        return dict.fromkeys(_HINT_ENGINES[Hint(ask.hint)], 0)
    if rule is Rule.LONG_CONTEXT:
        return {Engine.SSM: 0, Engine.HYBRID: 1}
    return {}


def _why(rule: Rule, ask: AdmitAsk, policy: AdmitPolicy) -> str:
    if rule is Rule.HINT:
        return f"hint {ask.hint}"
    if rule is Rule.LONG_CONTEXT:
        return f"long context ({ask.input_tokens} input tokens > {policy.long_context_tokens}): ssm, then hybrid"
    if rule is Rule.STRICT_SLO:
        return f"strict SLO (ttft {ask.ttft_ms:g} ms < {policy.strict_ttft_ms:g}): fastest that meets it"
    return "least cost"


def select(
    ask: AdmitAsk,
    replicas: Sequence[ReplicaStatus],
    specs: Mapping[str, ModelSpec],
    *,
    now_ms: float,
    policy: AdmitPolicy = AdmitPolicy(),
) -> Selection:
    """The replica to send ``ask`` to and the failover order behind it, among ``replicas`` (the caller
    passes those serving the request's model or group in the region), with why each other one is out.

    Ties break by replica id, so the same inputs give the same order.
    """
    rule = _rule(ask, policy)
    candidates: list[Candidate] = []
    excluded: dict[str, str] = {}
    tiers = _tiers(rule, ask)
    strict, ttft_ms, tokens = rule is Rule.STRICT_SLO, ask.ttft_ms, ask.input_tokens + ask.output_tokens
    needs: dict[tuple[str, int], int] = {}  # the replicas of one model and TP degree need the same bytes
    for replica in replicas:
        spec = specs.get(replica.model)
        need = 0
        if spec is not None and tokens <= spec.max_context:
            key = (replica.model, replica.tp)
            need = needs.get(key, -1)
            if need < 0:
                need = needs[key] = request_kv_bytes(
                    spec, input_tokens=ask.input_tokens, output_tokens=ask.output_tokens, tp=replica.tp
                )
        why = _exclusion(replica, spec, ask, need, now_ms, policy)
        if why is not None:
            excluded[replica.replica_id] = why.value
            continue
        cost = least_cost(replica, need_bytes=need, ttft_ms=ttft_ms, policy=policy)
        if strict:
            preferred = ttft_ms is not None and replica.latency_p50_ms <= ttft_ms
        else:
            preferred = replica.engine in tiers
        candidates.append(Candidate(replica, need, cost, preferred))

    if rule is Rule.STRICT_SLO:
        # The fastest that meets the SLO is the fastest of all whenever any meets it.
        choice = min(candidates, key=lambda c: (c.replica.latency_p50_ms, c.cost, c.replica.replica_id), default=None)
    else:
        last = len(set(tiers.values()))
        choice = min(
            candidates,
            key=lambda c: (tiers.get(c.replica.engine, last), c.cost, c.replica.replica_id),
            default=None,
        )
    order = () if choice is None else (choice, *failover_order([c for c in candidates if c is not choice]))
    return Selection(
        order=order,
        rule=rule.value,
        excluded=MappingProxyType(excluded),
        explanation=_explain(rule, ask, policy, order, excluded),
    )


def _explain(
    rule: Rule, ask: AdmitAsk, policy: AdmitPolicy, order: tuple[Candidate, ...], excluded: Mapping[str, str]
) -> str:
    out = "; excluded " + ", ".join(f"{r} ({why})" for r, why in excluded.items()) if excluded else ""
    if not order:
        return f"{_why(rule, ask, policy)}: no candidate{out or ' (no replica)'}"
    first = order[0]
    choice = (
        f"{first.replica.replica_id} ({first.replica.engine}, p50 {first.replica.latency_p50_ms:g} ms, "
        f"cost {first.cost:.1f}{'' if first.preferred or rule is Rule.LEAST_COST else ', none preferred'})"
    )
    failover = "; failover " + ", ".join(c.replica.replica_id for c in order[1:]) if len(order) > 1 else ""
    return f"{_why(rule, ask, policy)}: chose {choice}{failover}{out}"
