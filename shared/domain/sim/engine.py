"""A discrete-event simulation of serving a workload on a fleet under one placement policy.

Clock: simulated milliseconds from the trace's first request; nothing reads a real clock (decision
wall times come from an injected ``timer``, which defaults to one that always returns 0).

Rules (``SimConfig`` holds every number):

* A replica of a model is placed by the policy with ``context_tokens`` of context and ``slots`` KV
  slots (its concurrency). Each request holds one slot for its lifetime (its e2e time).
* Routing and scale up: a request goes to the model's replica with a free slot and the shortest
  prefill backlog. When every replica has all slots taken, or the chosen one has ``scale_backlog_ms``
  of prefill queued (long prompts bind before slots do), the policy is asked for a new replica; if it
  refuses, a replica with a free slot still takes the request; with none, the request queues (FIFO
  per model) and the model is not asked again until some replica is released (capacity changed).
  The replica request carries the model's mean prompt and output so far (``tell_shape``) and the
  SLO (``tell_slo``), what an operator would tell the placement service.
* Scale down: a replica with no request for ``idle_release_s`` is released (its HBM/TPU slice freed).
  The run ends when the last request completes or fails: replicas still up are released then (the
  idle time they would run on after the workload is not charged to it).
* A queued request is admitted when a slot frees; one that waited more than ``queue_timeout_s`` fails.
* Latency (``request_latency``, continuous batching to first order, as vLLM and SGLang serve): a
  request is prefilled on its own when it joins its replica, and a replica prefills one prompt at a
  time (prefill is compute-bound), so a prompt waits for the prefills admitted before it on the same
  replica: TTFT as seen by the user = queue wait + that prefill wait + ``latency.prefill_ms`` of its
  own prompt. Then it decodes in the replica's running batch: TPOT = ``latency.decode_step_ms`` at
  batch = the replica's occupied slots at admission (held for the request's life) and the request's
  mean context (prompt + output / 2); e2e = TTFT + (output - 1) x TPOT. ASSUMPTION: decode steps
  are not slowed by the prefills that run beside them (optimistic by the replica's prefill duty cycle).
* Sharing (``sim.sharing``): a replica whose GPU ``k`` replicas are busy on at admission gets 1/k of
  it: the estimate's times x k (any co-located replicas, whatever the policy called them; exclusive
  placements by ``hetsched`` never are). Replicas sharing a GPU split its cost and energy. With
  ``share_small`` the models whose weights fit a quarter of the largest GPU ask ``sharing: shared``.
* SLO: TTFT <= ``slo_ttft_ms`` (2 s) and TPOT <= ``slo_tpot_ms`` (100 ms); a failed request misses it.
* Reservations (``sim.reservations``, only with ``SimConfig.reservations``): each replica's tenant comes
  from its model (the owners' models are not preemptible, the rest are one preemptible tenant's); a
  decision sees the fleet without the GPUs its tenant may not use; every replica placed or released
  refreshes the reservations (borrowers, offers, backoff). An owner's replica that fits nowhere evicts
  the borrowers ``plan_reclaim`` picks: soft at once (then it is decided again), spot after
  ``spot_eviction_s`` (meanwhile they drain: no new request is routed to them; the owner's model is
  asked again when they leave); an evicted replica's in-flight requests fail (``preempted``). GPUs
  that back off are lent again at the backoff's end. Without reservations none of this runs.

Deterministic: the same requests, fleet, policy and seed give the same result (ties break on ids).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from shared.domain.hardware import Sku
from shared.domain.latency import LatencyEstimate, ModelShape, decode_step_ms, prefill_ms
from shared.domain.placement import (
    Decision,
    FleetSnapshot,
    PlacementRequest,
    Slo,
    TpuPodState,
    apply,
)
from shared.domain.placement.perf import model_shape
from shared.domain.sim.kpis import Kpis, ReplicaLife, RequestOutcome, Sample, compute_kpis, nvlinked_group
from shared.domain.sim.policies import Policy, ReleasingPolicy
from shared.domain.sim.reservations import ReservationRun, ReservationSetup
from shared.domain.sim.sharing import (
    SMALL_WEIGHT_FRACTION,
    Residency,
    co_tenancy,
    contended,
    decode_tokens_per_s,
    small_models,
)
from shared.domain.topology.tpu import fragmentation, free
from shared.domain.traces import AssignedRequest

Timer = Callable[[], float]


def zero_timer() -> float:
    return 0.0


@dataclass(frozen=True, slots=True)
class SimConfig:
    context_tokens: int = 8192
    slots: int = 16
    idle_release_s: float = 60.0
    queue_timeout_s: float = 30.0
    slo_ttft_ms: float = 2000.0
    slo_tpot_ms: float = 100.0
    sample_period_ms: float = 60_000.0
    tenant: str = "sim"
    share_small: bool = False  # small models (``small_fraction``) ask ``sharing: shared``
    small_fraction: float = SMALL_WEIGHT_FRACTION
    scale_backlog_ms: float = 1000.0  # a replica with this much prefill queued counts as full
    tell_shape: bool = True  # the replica request carries the model's mean prompt and output so far
    tell_slo: bool = True  # the replica request carries the SLO (``slo_ttft_ms``, ``slo_tpot_ms``)
    reservations: ReservationSetup | None = None  # reservations and lending (``sim.reservations``)


@dataclass(frozen=True, slots=True)
class SimResult:
    policy: str
    kpis: Kpis
    outcomes: tuple[RequestOutcome, ...]
    replicas: tuple[ReplicaLife, ...]
    samples: tuple[Sample, ...]
    decision_ms: tuple[float, ...]


@dataclass(slots=True)
class _Replica:
    id: int
    model: str
    decision: Decision
    shape: ModelShape
    sku: Sku
    tp: int
    start_ms: float
    gpus: tuple[str, ...] = ()  # the GPUs it holds (empty on a TPU slice)
    active: int = 0
    empty_since: float | None = None
    prefill_free_ms: float = 0.0  # when the prompts admitted so far are all prefilled
    leaving: bool = False  # a spot borrower told to leave: it drains (takes no new request) until evicted


def replica_request(
    model: str, n: int, config: SimConfig, *, shared: bool, shape: tuple[float, float] | None = None
) -> PlacementRequest:
    """What the simulator asks the policy for its ``n``-th replica, of ``model``: ``slots`` KV slots of
    ``context_tokens``; with ``tell_shape`` the typical request ``shape`` (mean prompt and output
    tokens) fitted into the context (``fitted_shape``); with ``tell_slo`` the simulator's SLO."""
    typical = fitted_shape(shape, config.context_tokens) if config.tell_shape and shape is not None else None
    return PlacementRequest(
        request_id=f"{model}-replica-{n}",
        tenant=config.tenant,
        model=model,
        context_tokens=config.context_tokens,
        concurrency=config.slots,
        input_tokens=typical[0] if typical else None,
        output_tokens=typical[1] if typical else None,
        slo=Slo(ttft_ms=config.slo_ttft_ms, tpot_ms=config.slo_tpot_ms) if config.tell_slo else None,
        sharing="shared" if shared else "exclusive",
    )


def fitted_shape(shape: tuple[float, float], context_tokens: int) -> tuple[int, int]:
    """(prompt, output) tokens rounded, at least 1 each, scaled down together when they exceed the
    context (a request states a shape its KV slot can hold)."""
    prompt, output = max(1.0, shape[0]), max(1.0, shape[1])
    scale = min(1.0, context_tokens / (prompt + output))
    fitted_prompt = max(1, min(context_tokens - 1, round(prompt * scale)))
    return fitted_prompt, max(1, min(context_tokens - fitted_prompt, round(output * scale)))


def request_latency(shape: ModelShape, sku: Sku, tp: int, request: AssignedRequest, batch: int) -> LatencyEstimate:
    """``request`` on a replica of ``shape`` on ``tp`` accelerators of ``sku`` that holds ``batch``
    requests (itself included), alone on its GPUs, with no prefill ahead of it: TTFT is the prefill of
    its own prompt, TPOT one decode step of the batch at its mean context (module docstring)."""
    output = max(1, request.output_tokens)
    ttft = prefill_ms(shape, sku, tp, request.input_tokens)
    tpot = decode_step_ms(shape, sku, tp, batch, request.input_tokens + output / 2)
    return LatencyEstimate(ttft_ms=ttft, tpot_ms=tpot, e2e_ms=ttft + (output - 1) * tpot)


def release(snapshot: FleetSnapshot, decision: Decision) -> FleetSnapshot:
    """The inverse of ``placement.apply`` for a placed decision: its share and TPU slice freed, and the
    TDP of every GPU that turns idle taken off its rack."""
    if not decision.placed or decision.share is None:
        return snapshot
    if decision.tpu is not None:
        pods = dict(snapshot.tpu_pods)
        state = pods[decision.tpu.pod]
        pods[decision.tpu.pod] = TpuPodState(state.pod, free(state.grid, decision.tpu.slice), state.hbm_per_chip)
        return snapshot.evolve(tpu_pods=pods)
    capacity = dict(snapshot.capacity)
    power = dict(snapshot.rack_power_used_w)
    for acc_id in decision.accelerators:
        cap = capacity[acc_id]
        reserved = max(0, cap.reserved - decision.share.total)
        capacity[acc_id] = replace(cap, reserved=reserved, shared=cap.shared and reserved > 0)
        if reserved == 0 and cap.reserved > 0:
            key = snapshot.rack_key(cap.node)
            power[key] = max(0.0, power.get(key, 0.0) - snapshot.skus[cap.sku].tdp_w)
    return snapshot.evolve(capacity=capacity, rack_power_used_w=power)


# Event kinds, in the order they run at the same instant.
_DONE, _IDLE, _TIMEOUT, _ARRIVE, _EVICT, _LEND = 0, 1, 2, 3, 4, 5


@dataclass
class _Sim:
    snapshot: FleetSnapshot
    policy: Policy
    config: SimConfig
    timer: Timer
    requests: Sequence[AssignedRequest]
    events: list[tuple[float, int, int, int]] = field(default_factory=list)
    seq: int = 0
    replicas: dict[int, _Replica] = field(default_factory=dict)
    lives: list[ReplicaLife] = field(default_factory=list)
    queues: dict[str, deque[int]] = field(default_factory=dict)
    waiting: set[int] = field(default_factory=set)
    blocked: set[str] = field(default_factory=set)
    outcomes: dict[int, RequestOutcome] = field(default_factory=dict)
    running: dict[int, tuple[int, RequestOutcome]] = field(default_factory=dict)  # request -> (replica, outcome)
    decision_ms: list[float] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    window_done: int = 0
    window_met: int = 0
    next_replica: int = 0
    tpu_used: bool = False
    frag_cache: dict[str, tuple[object, float]] = field(default_factory=dict)
    seen: dict[str, tuple[int, float, float]] = field(default_factory=dict)  # model -> (n, prompt, output sums)
    residency: Residency = field(init=False)
    small: frozenset[str] = field(init=False)
    lending: ReservationRun | None = field(init=False)

    def __post_init__(self) -> None:
        self.residency = Residency(usable={acc: cap.usable for acc, cap in self.snapshot.capacity.items()})
        self.small = small_models(self.snapshot, self.config.small_fraction) if self.config.share_small else frozenset()
        setup = self.config.reservations
        self.lending = None if setup is None else ReservationRun(setup, self.snapshot, borrower=self.config.tenant)

    def push(self, time: float, kind: int, ref: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (time, kind, self.seq, ref))

    # -- replicas ----------------------------------------------------------------------------

    def scale_up(self, model: str, now: float) -> _Replica | None:
        if model in self.blocked:
            return None
        self.next_replica += 1
        n, prompts, outputs = self.seen[model]
        shape = (prompts / n, outputs / n)
        request = replica_request(model, self.next_replica, self.config, shared=model in self.small, shape=shape)
        start = self.timer()
        if self.lending is None:
            decision = self.policy.decide(self.snapshot, request)
        else:
            decision = self.decide_reserved(self.lending, request, now)
        self.decision_ms.append((self.timer() - start) * 1000.0)
        if not decision.placed or decision.sku is None or decision.tp is None:
            self.blocked.add(model)
            return None
        self.snapshot = apply(self.snapshot, decision)
        spec = self.snapshot.models[model]
        replica = _Replica(
            id=self.next_replica,
            model=model,
            decision=decision,
            shape=model_shape(spec, spec.dtype, spec.kv_dtype),
            sku=self.snapshot.skus[decision.sku],
            tp=decision.tp,
            start_ms=now,
            gpus=() if decision.tpu is not None else decision.accelerators,
        )
        if replica.gpus and decision.share is not None:
            self.residency.join(replica.id, replica.gpus, decision.share.total, now)
        self.tpu_used = self.tpu_used or decision.tpu is not None
        self.replicas[replica.id] = replica
        if self.lending is not None:
            self.lending.placed(replica.id, model, decision, now)
        return replica

    def decide_reserved(self, lending: ReservationRun, request: PlacementRequest, now: float) -> Decision:
        """The decision for ``request`` as its model's tenant may place it; an owner refused for want of
        the GPUs it lent reclaims them: soft borrowers leave now and it is decided again, spot borrowers
        leave at their deadline (the refusal stands until then)."""
        request = lending.request_for(request)
        decision = lending.decide(self.snapshot, request, self.policy.decide, now)
        if decision.placed:
            return decision
        plan = lending.plan(self.snapshot, request, self.policy.decide)
        if plan is None:
            return decision
        evicted = False
        for eviction in lending.reclaim(plan, now):
            if eviction.at_ms <= now:
                evicted = self.evict(eviction.replica_id, now) or evicted
            elif eviction.issued and eviction.replica_id in self.replicas:
                self.replicas[eviction.replica_id].leaving = True
                self.push(eviction.at_ms, _EVICT, eviction.replica_id)
            if eviction.issued:
                self.push(eviction.lend_ms, _LEND, 0)
        return lending.decide(self.snapshot, request, self.policy.decide, now) if evicted else decision

    def evict(self, replica_id: int, now: float) -> bool:
        """A borrower replica preempted at ``now``: its in-flight requests fail, then it is retired."""
        replica = self.replicas.get(replica_id)
        if replica is None:
            return False  # it was released before its deadline
        for index in sorted(i for i, (r, _) in self.running.items() if r == replica_id):
            _, outcome = self.running.pop(index)
            self.outcomes[index] = replace(
                outcome,
                admitted=False,
                ttft_ms=None,
                tpot_ms=None,
                done_ms=None,
                slo_met=False,
                tokens=0,
                replica_tokens_per_s=None,
                preempted=True,
            )
        self.retire(replica, now)
        return True

    def retire(self, replica: _Replica, now: float) -> None:
        del self.replicas[replica.id]
        self.snapshot = release(self.snapshot, replica.decision)
        if self.lending is not None:
            self.lending.released(replica.id, now)
        if isinstance(self.policy, ReleasingPolicy):
            self.policy.released(replica.decision)
        self.blocked.clear()
        d = replica.decision
        tp_group = d.tpu is None and len(d.accelerators) > 1
        charged = self.residency.leave(replica.id, replica.gpus, now) if replica.gpus else None
        self.lives.append(
            ReplicaLife(
                model=replica.model,
                sku=replica.sku.name,
                accelerators=len(d.accelerators),
                price_usd_per_hour=replica.sku.price_usd_per_hour,
                tdp_w=replica.sku.tdp_w,
                tpu=d.tpu is not None,
                nvlinked=nvlinked_group(self.snapshot.nodes, d.accelerators) if tp_group else None,
                start_ms=replica.start_ms,
                end_ms=now,
                sharing=d.sharing,
                accelerator_hours=charged,
            )
        )

    def free_replica(self, model: str, now: float) -> _Replica | None:
        """The replica of ``model`` with a free slot whose prefill backlog is shortest (then the fewest
        requests, then the oldest)."""
        best: _Replica | None = None
        best_key = (0.0, 0, 0)
        for replica in self.replicas.values():
            if replica.model == model and replica.active < self.config.slots and not replica.leaving:
                key = (max(0.0, replica.prefill_free_ms - now), replica.active, replica.id)
                if best is None or key < best_key:
                    best, best_key = replica, key
        return best

    def route(self, model: str, now: float) -> _Replica | None:
        """Where a request of ``model`` goes now: the ``free_replica``, unless it has none or its prefill
        backlog reaches ``scale_backlog_ms``, in which case a new replica if the policy places one."""
        replica = self.free_replica(model, now)
        if replica is None or replica.prefill_free_ms - now >= self.config.scale_backlog_ms:
            return self.scale_up(model, now) or replica
        return replica

    # -- requests ----------------------------------------------------------------------------

    def admit(self, index: int, replica: _Replica, now: float) -> None:
        req = self.requests[index]
        replica.active += 1
        replica.empty_since = None
        k = self.co_tenants(replica)
        est = contended(request_latency(replica.shape, replica.sku, replica.tp, req, replica.active), k)
        behind = max(0.0, replica.prefill_free_ms - now)  # prefills admitted before it on this replica
        replica.prefill_free_ms = now + behind + est.ttft_ms
        wait = now - req.arrival_ms
        ttft = wait + behind + est.ttft_ms
        met = ttft <= self.config.slo_ttft_ms and est.tpot_ms <= self.config.slo_tpot_ms
        outcome = RequestOutcome(
            row=req.row,
            model=req.model,
            admitted=True,
            queued=wait > 0,
            wait_ms=wait,
            ttft_ms=ttft,
            tpot_ms=est.tpot_ms,
            done_ms=now + behind + est.e2e_ms,
            slo_met=met,
            tokens=req.input_tokens + req.output_tokens,
            co_tenants=k,
            replica_tokens_per_s=decode_tokens_per_s(replica.active, est.tpot_ms),
        )
        self.running[index] = (replica.id, outcome)
        self.push(now + behind + est.e2e_ms, _DONE, index)

    def co_tenants(self, replica: _Replica) -> int:
        """Busy replicas on ``replica``'s busiest GPU, itself included (it is busy: it is admitting)."""
        busy = {
            acc: sum(1 for r in self.residency.holders(acc) if r == replica.id or self.replicas[r].active > 0)
            for acc in replica.gpus
        }
        return co_tenancy(replica.gpus, busy)

    def serve(self, model: str, now: float) -> None:
        """Admit queued requests of ``model`` while slots exist or replicas can be added."""
        queue = self.queues.get(model)
        while queue:
            index = queue[0]
            if index not in self.waiting:
                queue.popleft()
                continue
            replica = self.route(model, now)
            if replica is None:
                return
            queue.popleft()
            self.waiting.discard(index)
            self.admit(index, replica, now)

    def serve_queued(self, now: float) -> None:
        """Capacity changed: admit what every model has queued, in model order."""
        for model in sorted(m for m, q in self.queues.items() if q):
            self.serve(model, now)

    def fail(self, index: int, now: float) -> None:
        req = self.requests[index]
        self.outcomes[index] = RequestOutcome(
            row=req.row,
            model=req.model,
            admitted=False,
            queued=True,
            wait_ms=now - req.arrival_ms,
            ttft_ms=None,
            tpot_ms=None,
            done_ms=None,
            slo_met=False,
            tokens=0,
        )

    # -- time series ---------------------------------------------------------------------------

    def tpu_fragmentation(self) -> float:
        if not self.tpu_used or not self.snapshot.tpu_pods:
            return 0.0
        values = []
        for name, state in self.snapshot.tpu_pods.items():
            cached = self.frag_cache.get(name)
            if cached is None or cached[0] is not state.grid:
                cached = self.frag_cache[name] = (state.grid, fragmentation(state.grid))
            values.append(cached[1])
        return sum(values) / len(values)

    def sample(self, at: float) -> None:
        self.samples.append(
            Sample(
                minute=at / 60_000.0,
                active_replicas=len(self.replicas),
                queue_length=len(self.waiting),
                slo_attainment=self.window_met / self.window_done if self.window_done else None,
                tpu_fragmentation=self.tpu_fragmentation(),
                fill_rate=self.lending.fill_now() if self.lending is not None else None,
            )
        )
        self.window_done = self.window_met = 0

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> float:
        for index, req in enumerate(self.requests):
            self.push(req.arrival_ms, _ARRIVE, index)
        next_sample = self.config.sample_period_ms
        now = 0.0
        while self.events:
            time, kind, _, ref = heapq.heappop(self.events)
            while next_sample <= time:
                self.sample(next_sample)
                next_sample += self.config.sample_period_ms
            now = time
            if kind == _ARRIVE:
                arrived = self.requests[ref]
                model = arrived.model
                n, prompts, outputs = self.seen.get(model, (0, 0.0, 0.0))
                self.seen[model] = (n + 1, prompts + arrived.input_tokens, outputs + arrived.output_tokens)
                queue = self.queues.setdefault(model, deque())
                queue.append(ref)
                self.waiting.add(ref)
                self.serve(model, now)
                if ref in self.waiting:
                    self.push(now + self.config.queue_timeout_s * 1000.0, _TIMEOUT, ref)
            elif kind == _TIMEOUT:
                if ref in self.waiting:
                    self.waiting.discard(ref)
                    self.fail(ref, now)
            elif kind == _DONE and ref in self.running:  # not there: it failed when its replica was evicted
                replica_id, outcome = self.running.pop(ref)
                self.outcomes[ref] = outcome
                self.window_done += 1
                self.window_met += outcome.slo_met
                replica = self.replicas[replica_id]
                replica.active -= 1
                self.serve(replica.model, now)
                if replica.active == 0:
                    replica.empty_since = now
                    self.push(now + self.config.idle_release_s * 1000.0, _IDLE, replica.id)
            elif kind == _IDLE:
                idle = self.replicas.get(ref)
                if idle is not None and idle.active == 0 and idle.empty_since is not None:
                    if now - idle.empty_since >= self.config.idle_release_s * 1000.0:
                        self.retire(idle, now)
                        self.serve_queued(now)
            elif kind == _EVICT:
                if self.evict(ref, now):
                    self.serve_queued(now)
            elif kind == _LEND and self.lending is not None:
                self.lending.refresh(now)  # backoff over: the GPUs may be offered again
                self.blocked.clear()
                self.serve_queued(now)
            if len(self.outcomes) == len(self.requests):
                break  # the workload is over: what replicas would idle through after it is not its cost
        self.sample(now)
        for replica in sorted(self.replicas.values(), key=lambda r: r.id):
            self.retire(replica, now)
        return now


def simulate(
    snapshot: FleetSnapshot,
    requests: Sequence[AssignedRequest],
    policy: Policy,
    *,
    config: SimConfig | None = None,
    timer: Timer = zero_timer,
) -> SimResult:
    """Replay ``requests`` (arrival order) on ``snapshot`` with ``policy``; ``timer`` (seconds) times decisions."""
    config = config or SimConfig()
    ordered = sorted(requests, key=lambda r: (r.arrival_ms, r.row))
    sim = _Sim(snapshot=snapshot, policy=policy, config=config, timer=timer, requests=ordered)
    sim.run()
    outcomes = tuple(sim.outcomes[i] for i in sorted(sim.outcomes))
    kpis = compute_kpis(
        outcomes,
        sim.lives,
        sim.samples,
        sim.decision_ms,
        gpu_hbm_fill=sim.residency.hbm_fill,
        preemptions=sim.lending.preemptions if sim.lending is not None else 0,
    )
    return SimResult(
        policy=policy.name,
        kpis=kpis,
        outcomes=outcomes,
        replicas=tuple(sim.lives),
        samples=tuple(sim.samples),
        decision_ms=tuple(sim.decision_ms),
    )
