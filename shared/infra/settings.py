"""Settings from the environment (prefix ``HETSCHED_``) or a ``.env``-style settings file."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.contracts.streams import (
    DEFAULT_DEADLETTER_MAX_AGE_S,
    DEFAULT_MAX_AGE_S,
    DEFAULT_MAX_BYTES,
    DEFAULT_TELEMETRY_MAX_AGE_S,
)
from shared.contracts.subjects import Context
from shared.domain.quotas import Quota, Quotas, parse_overrides


def _default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME")
    return (Path(base) if base else Path.home() / ".local" / "share") / "hetsched"


class Settings(BaseSettings):
    """Every knob of hetsched. Each field is read from ``HETSCHED_<FIELD>`` (upper case)."""

    model_config = SettingsConfigDict(
        env_prefix="HETSCHED_",
        env_file=os.environ.get("HETSCHED_SETTINGS_FILE"),
        extra="ignore",
        frozen=True,
    )

    nats_url: str | None = Field(
        default=None,
        description="NATS server URL. Unset: `hetsched up` starts an embedded NATS with JetStream.",
        examples=["nats://127.0.0.1:4222"],
    )
    database_url: str | None = Field(
        default=None,
        description="Postgres URL. Unset: `hetsched up` starts an embedded Postgres.",
        examples=["postgresql://postgres@127.0.0.1:5432/hetsched"],
    )
    data_dir: Path = Field(
        default_factory=_default_data_dir,
        description="Where `hetsched up` keeps the embedded servers' data and its state file.",
    )
    subject_prefix: str = Field(
        default="hetsched",
        pattern=r"^[A-Za-z0-9_-]+$",
        description="First token of every subject; a test run or a tenant-isolated deployment changes it.",
    )
    stream_prefix: str = Field(
        default="",
        pattern=r"^[A-Za-z0-9_-]*$",
        description="Prepended to every JetStream stream name (stream names are otherwise the context name).",
    )
    region: str = Field(default="local", description="Region this service instance serves.")
    log_level: str = Field(default="INFO", description="Python logging level.")
    log_format: str = Field(default="json", pattern=r"^(json|text)$", description="`json` or `text`.")
    nats_nkey_seed_file: Path | None = Field(
        default=None,
        description="NKey seed file this process connects to NATS with (a service: its own; the CLI: the "
        "operator's, `<data-dir>/nats/admin.nk` when unset and that file exists). Unset: no NATS authentication.",
    )
    nats_inbox_prefix: str = Field(
        default="_INBOX",
        pattern=r"^[A-Za-z0-9_$-]+$",
        description="Prefix of this process's reply subjects; an identity's permissions let it receive replies "
        "only under its own (`_INBOX_<identity>`, written into each credential's README line by `hetsched "
        "credentials issue`).",
    )
    nats_tls_ca_file: Path | None = Field(
        default=None, description="CA certificate that signed the NATS server's certificate: connect with TLS."
    )
    nats_tls_cert_file: Path | None = Field(
        default=None, description="Client certificate for NATS servers that verify clients (mutual TLS)."
    )
    nats_tls_key_file: Path | None = Field(default=None, description="Key of `HETSCHED_NATS_TLS_CERT_FILE`.")
    request_timeout_ms: int = Field(default=5000, gt=0, description="Timeout of CLI requests over NATS.")
    dependency_slow_ms: int = Field(
        default=1000,
        gt=0,
        description="Health says `degraded` when Postgres answers `SELECT 1`, or another service's median answer "
        "over the last 50 calls, slower than this (or when a recent call got no answer).",
    )
    rpc_timeout_ms: int = Field(
        default=10_000, gt=0, description="Timeout of a service's requests to another service (e.g. ledger.commit)."
    )
    database_roles: bool = Field(
        default=True,
        description="Each service connects as its own Postgres role `hetsched_<schema>` (rights on its schema only; "
        "created by the migrations). Off: every service connects as the user of `HETSCHED_DATABASE_URL`.",
    )
    database_role_password: SecretStr | None = Field(
        default=None,
        description="Password of the per-service roles (set by the migrations when given; none with trust auth).",
    )
    outbox_poll_ms: int = Field(default=100, gt=0, description="Outbox relay poll interval.")
    outbox_batch: int = Field(default=256, gt=0, le=10_000, description="Rows the relay publishes per pass.")
    stream_duplicate_window_s: float = Field(
        default=120.0, gt=0, description="JetStream duplicate window: a re-sent event id inside it is dropped."
    )
    telemetry_max_age_s: float = Field(
        default=DEFAULT_TELEMETRY_MAX_AGE_S, gt=0, description="Max age of TELEMETRY messages."
    )
    metrics_host: str = Field(default="127.0.0.1", description="Where a service serves its Prometheus metrics.")
    metrics_port: int = Field(
        default=0,
        ge=-1,
        le=65535,
        description="Port of a service's Prometheus metrics endpoint (0: a free one, named in its health reply "
        "and `hetsched status --json` as `metrics_url`; -1: none).",
    )
    # -- operator HTTP endpoints: limits of both servers, the console's access (issue 23 rows 5, 6) -------
    metrics_max_connections: int = Field(
        default=16,
        gt=0,
        le=10_000,
        description="Connections a service's metrics endpoint holds at once; a new one displaces the oldest that "
        "has not sent its request yet, else it gets 503.",
    )
    metrics_read_timeout_s: float = Field(
        default=5.0,
        gt=0,
        le=300,
        description="A connection to the metrics endpoint that has not sent its request within this long (or "
        "not taken the answer within as long again) is closed.",
    )
    console_token: SecretStr | None = Field(
        default=None,
        description="Token `hetsched console` requires (at least 16 characters). Unset or empty: a new random one "
        "at each start, printed with the URL to open.",
    )
    console_allowed_hosts: str = Field(
        default="localhost,127.0.0.1,[::1]",
        description="Host header values the console answers, comma-separated (a name without a port means the "
        "console's port; the address given to `--host` is added). Any other Host gets 421 and no data.",
    )
    console_max_connections: int = Field(
        default=64, gt=0, le=10_000, description="Connections the console holds at once (as the metrics endpoint)."
    )
    console_read_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=300,
        description="A connection to the console that has not sent its request within this long is closed.",
    )
    otel_exporter: str = Field(
        default="none", pattern=r"^(none|console|otlp)$", description="OpenTelemetry exporter for traces."
    )
    db_pool_size: int = Field(default=10, gt=0, description="SQLAlchemy pool size per service.")
    request_workers: int = Field(
        default=64,
        gt=0,
        le=1024,
        description="Requests a service serves at once, per subject (concurrent requests share group commits).",
    )
    model_catalog: Path | None = Field(
        default=None, description="A model catalog file (YAML) merged over the shipped one: add or override models."
    )
    placement_default_lease_s: int = Field(
        default=3600, gt=0, description="Lease of a placed replica when the request names none."
    )
    placement_refresh_ms: int = Field(
        default=0,
        ge=0,
        description="When > 0, placement re-syncs its whole view (`fleet.get` + `ledger.snapshot`) this often; "
        "0: never (TOPOLOGY and LEDGER events keep it current).",
    )
    placement_stale_after_ms: int = Field(
        default=5000,
        gt=0,
        description="Placement's health check `view` turns from `ok` to `behind` when events older than this "
        "wait to be applied to its view of the fleet.",
    )
    sku_catalog: Path | None = Field(
        default=None, description="A SKU catalog file (YAML) merged over the shipped one: add SKUs or override prices."
    )
    topology_mode: str = Field(
        default="fleet",
        pattern=r"^(fleet|agent)$",
        description="`fleet`: own the fleet (inventory, agent reports, liveness); `agent`: profile this node.",
    )
    topology_inventory: Path | None = Field(
        default=None, description="Fleet inventory file (YAML) the fleet-mode topology service loads."
    )
    topology_provider: str = Field(
        default="nvml", pattern=r"^(nvml|nvidia-smi)$", description="Agent mode: how to profile the node."
    )
    topology_node: str | None = Field(default=None, description="Agent mode: node name (default: the host name).")
    topology_cluster: str = Field(default="default", description="Agent mode: the node's cluster.")
    topology_rack: str = Field(default="default", description="Agent mode: the node's rack.")
    topology_sku: str | None = Field(
        default=None, description="Agent mode: SKU name when the device name is not enough."
    )
    topology_smi_topo_file: Path | None = Field(
        default=None, description="Agent mode, nvidia-smi: read a captured `topo -m` output instead of running it."
    )
    topology_smi_query_file: Path | None = Field(
        default=None, description="Agent mode, nvidia-smi: read a captured `--query-gpu` CSV instead of running it."
    )
    topology_heartbeat_s: float = Field(default=30.0, gt=0, description="Heartbeat interval of agents.")
    topology_missed_heartbeats: int = Field(
        default=3, gt=0, description="Missed heartbeats after which a node is published as lost."
    )
    topology_scan_s: float = Field(default=60.0, gt=0, description="Agent mode: how often the node is profiled again.")
    telemetry_interval_s: float = Field(default=30.0, gt=0, description="Agent mode: GPU telemetry interval.")
    ledger_ceiling: float = Field(
        default=0.92, gt=0, le=1, description="Share of each accelerator's HBM the ledger may allocate."
    )
    ledger_default_lease_s: int = Field(default=300, gt=0, description="Lease of a commit that names none.")
    ledger_max_batch: int = Field(
        default=256, gt=0, le=10_000, description="Most commits the ledger applies in one transaction (group commit)."
    )
    ledger_cross_domain_budget_bytes_per_s: int = Field(
        default=256_000_000_000,
        ge=0,
        description="Cross-domain TP traffic (bytes/s) the ledger lets the replicas of one cluster send in all "
        "(the brief's 256 GB/s); a commit past it is `no_capacity`. 0: not enforced by the ledger.",
    )
    ledger_sweep_ms: int = Field(default=500, gt=0, description="How often expired leases are released.")
    drift_threshold: float = Field(
        default=0.10,
        gt=0,
        lt=1,
        description="Observed vs reserved HBM difference, as a share of usable HBM, that counts as drift.",
    )
    drift_consecutive: int = Field(
        default=2, gt=0, description="Samples in a row over the threshold before a drift event."
    )
    # -- supervision / cluster (issue 10) ------------------------------------------------------------
    stream_replicas: int = Field(
        default=1,
        ge=1,
        le=5,
        description="Replicas of every JetStream stream: 3 on a 3-node cluster (R3), 1 on a single server.",
    )
    # -- events: outbox size check, quarantine, redelivery and dead letters (issue 10) ---------------
    event_max_bytes: int = Field(
        default=900_000,
        gt=0,
        description="Largest event (UTF-8 JSON bytes) a transaction may emit; below NATS `max_payload` (1 MiB by "
        "default). A larger one fails the transaction with `invalid_request`.",
    )
    event_max_deliveries: int = Field(
        default=5,
        gt=0,
        description="Deliveries of an event whose handler keeps failing before the consumer dead-letters it.",
    )
    event_redelivery_backoff_ms: int = Field(
        default=500, gt=0, description="Delay before a failed event is redelivered; doubles on each redelivery."
    )
    event_redelivery_backoff_max_ms: int = Field(
        default=10_000, gt=0, description="Longest delay between two deliveries of a failing event."
    )

    # -- request path: limits and deadlines (issue 10) ---------------------------------------------
    request_max_bytes: int = Field(
        default=512 * 1024,
        gt=0,
        description="Largest request body a service reads (bytes); a larger one is `invalid_request`. Keep it "
        "under NATS `max_payload` (1 MiB by default).",
    )
    request_deadline_ms: int = Field(
        default=10_000,
        gt=0,
        description="Deadline of a request that carries no `Hetsched-Deadline` header, from its arrival.",
    )
    request_saturated_ms: int = Field(
        default=2_000,
        gt=0,
        description="Health turns `degraded` when every worker of a subject has been busy for longer than this.",
    )

    # -- placement ownership: intents, the reconciler, fault injection (issue 10) -------------------
    placement_reconcile_period_s: float = Field(
        default=30.0,
        gt=0,
        description="How often placement's reconciler releases ledger allocations no placement decision owns.",
    )
    placement_intent_grace_s: float = Field(
        default=300.0,
        gt=0,
        description="A placement intent still `committing` this long is abandoned (its allocation, if any, is "
        "released by the reconciler); a retry with the same id inside it recovers the allocation.",
    )
    placement_fault_after_commit: str = Field(
        default="",
        pattern=r"^(|exit)$",
        description="Tests only: `exit` makes placement exit right after a ledger commit, before its decision row.",
    )

    # -- placement's queue and PCIe budget (issue 12) ------------------------------------------------
    placement_queue_timeout_s: int = Field(
        default=600,
        gt=0,
        le=24 * 3600,
        description="How long a `queued` placement waits for capacity when its request names no `queue_timeout_s`; "
        "then it is rejected `no_capacity` (queue timeout).",
    )
    placement_queue_retry_s: float = Field(
        default=5.0,
        gt=0,
        description="Placement retries its queue this often, besides whenever an allocation is released or expires.",
    )
    placement_pcie_window_s: float = Field(
        default=60.0,
        ge=0,
        description="A node's PCIe utilisation is the lowest sample of this window (telemetry): it counts as over "
        "the threshold only when it stayed over it that long; 0: the latest sample.",
    )
    placement_queue_page: int = Field(
        default=200,
        gt=0,
        le=10_000,
        description="Queued placements read per page: each pass of the queue pages through all of them.",
    )

    # -- per-tenant quotas (issue 23 row 7); 0: unlimited -----------------------------------------------
    quota_gpus_reserved_per_tenant: int = Field(
        default=10_000,
        ge=0,
        description="Accelerators one tenant's active reservations may hold in all; `reservation.create` past it "
        "is `quota_exceeded`. 0: unlimited.",
    )
    quota_gpus_placed_per_tenant: int = Field(
        default=10_000,
        ge=0,
        description="Accelerators one tenant's live replicas may hold (each counted once, commits in flight "
        "included); `placement.place` past it is `quota_exceeded`. 0: unlimited.",
    )
    quota_queued_requests_per_tenant: int = Field(
        default=1_000,
        ge=0,
        description="Placements one tenant may have waiting in placement's queue; one more is `quota_exceeded`. "
        "0: unlimited.",
    )
    quota_tenant_overrides: dict[str, dict[str, int]] = Field(
        default_factory=dict,
        description='Per-tenant limits over the three above, JSON: `{"acme": {"gpus_placed": 64, '
        '"queued_requests": 10}}` (quotas `gpus_reserved`, `gpus_placed`, `queued_requests`; 0: unlimited).',
    )

    @field_validator("quota_tenant_overrides")
    @classmethod
    def _known_quotas(cls, value: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
        parse_overrides(value)  # an unknown quota name or a negative limit fails at start, not silently
        return value

    def quotas(self) -> Quotas:
        """The per-tenant quotas these settings give (``shared.domain.quotas``)."""
        return Quotas(
            limits={
                Quota.GPUS_RESERVED: self.quota_gpus_reserved_per_tenant,
                Quota.GPUS_PLACED: self.quota_gpus_placed_per_tenant,
                Quota.QUEUED_REQUESTS: self.quota_queued_requests_per_tenant,
            },
            overrides=parse_overrides(self.quota_tenant_overrides),
        )

    # -- the request path (issue 14): admission and cross-region routing ------------------------------
    model_groups: Path | None = Field(
        default=None,
        description="YAML map of model group -> model names (several engines answering one API), replacing the "
        "shipped shared/catalog/model_groups.yaml.",
    )
    engine_stale_s: float = Field(
        default=15.0, gt=0, description="A replica with no engine status report for this long leaves rotation."
    )
    admit_max_queue_depth: int = Field(
        default=16, gt=0, description="A replica whose engine queue is this deep takes no new request."
    )
    admit_long_context_tokens: int = Field(
        default=32000, gt=0, description="Input above this prefers an engine whose memory does not grow (SSM)."
    )
    admit_strict_ttft_ms: float = Field(
        default=100.0, gt=0, description="A TTFT SLO under this prefers the fastest engine that meets it."
    )
    admit_tenant_rate: float = Field(
        default=200.0, gt=0, description="Per-tenant token bucket: admissions per second within a tenant's profile."
    )
    admit_tenant_burst: float = Field(default=400.0, gt=0, description="Per-tenant token bucket depth.")
    admit_tenant_weights: str = Field(
        default="",
        description="Fair-queueing weights, `tenant=weight,...` (others weigh 1).",
    )
    admit_queue_ttl_s: float = Field(
        default=30.0, gt=0, description="A queued request waits this long for capacity before it is dropped."
    )
    admit_kv_guarantees: str = Field(
        default="",
        description="Guaranteed KV share per engine on a node, `transformer=0.4,moe=0.3,ssm=0.3` (default: equal "
        "among the engines present); an idle engine's share is lent (donors MoE > Transformer > SSM).",
    )
    regions_file: Path | None = Field(
        default=None, description="Regions (RTT, prices, power, PUE), replacing shared/catalog/regions.yaml."
    )
    route_weights: str = Field(
        default="0.4,0.3,0.1,0.2",
        description="Weights of cost = a*RTT + b*price + c*power*PUE - d*affinity (alpha, beta, gamma, delta).",
    )
    route_damping_s: float = Field(
        default=1800.0, ge=0, description="A tenant's region changes at most once per this many seconds."
    )
    route_affinity_days: int = Field(default=7, gt=0, description="Traffic window of a tenant's region affinity.")
    route_flush_ms: int = Field(
        default=500, gt=0, description="How often the router writes its traffic counts (affinity) to Postgres."
    )

    # -- reservations (issue 15) -------------------------------------------------------------------
    reservation_fill_target: float = Field(
        default=0.85,
        gt=0,
        le=1,
        description="A soft or spot reservation's idle accelerators are lent while its owner fills less than this "
        "share of it (the brief's 0.85).",
    )
    reservation_backoff_s: float = Field(
        default=30.0,
        ge=0,
        description="An accelerator reclaimed from a borrower is not lent again for this long; each reclaim within "
        "`reservation_backoff_max_s` of the last doubles it.",
    )
    reservation_backoff_max_s: float = Field(
        default=1800.0, gt=0, description="The longest backoff, and how long a reclaim is remembered."
    )
    # -- rebalancer (issue 16) ---------------------------------------------------------------------
    rebalance_hot_util: float = Field(default=0.85, gt=0, le=1, description="A replica's GPUs above this HBM use ...")
    rebalance_hot_window_s: float = Field(default=60.0, ge=0, description="... for this long: replicate it.")
    rebalance_cold_util: float = Field(default=0.30, gt=0, le=1, description="A node below this HBM use ...")
    rebalance_cold_window_s: float = Field(default=300.0, ge=0, description="... for this long: consolidate.")
    rebalance_frag_threshold: float = Field(
        default=0.3, gt=0, le=1, description="A TPU pod fragmented above this: defragment it."
    )
    rebalance_frag_window_s: float = Field(default=60.0, ge=0, description="How long the fragmentation must last.")
    rebalance_pcie_util: float = Field(default=0.7, gt=0, le=1, description="A node's PCIe above this ...")
    rebalance_pcie_window_s: float = Field(default=60.0, ge=0, description="... for this long: throttle cold starts.")
    rebalance_drift_ratio: float = Field(
        default=0.10, gt=0, description="|observed - reserved| HBM over this share of an allocation is drift."
    )
    rebalance_drift_check_s: float = Field(default=10.0, gt=0, description="How often drift is checked per node.")
    rebalance_drift_window_s: float = Field(
        default=60.0, ge=0, description="Drift lasting this long re-places the allocation (an alarm comes at once)."
    )
    rebalance_hysteresis: float = Field(
        default=0.05, ge=0, description="A firing detector clears only this far past its threshold."
    )
    rebalance_migrations_per_min: float = Field(
        default=2.0, gt=0, description="Replica copies the rebalancer starts per minute and cluster."
    )
    rebalance_tick_s: float = Field(default=1.0, gt=0, description="How often the rebalancer plans and runs plans.")
    reservation_fault_after_record: str = Field(
        default="",
        description="Tests only: `exit` makes the filler exit the way a SIGKILL would, right after it has written "
        "a reclaim's preemptions and before it asks the ledger.",
    )
    reservation_tick_s: float = Field(
        default=1.0,
        gt=0,
        description="How often the filler re-issues preemptions the ledger has not acknowledged and re-offers "
        "accelerators whose backoff ended.",
    )

    # -- Postgres security (issue 11) --------------------------------------------------------------
    database_tls_ca_file: Path | None = Field(
        default=None,
        description="CA certificate that signed the Postgres server's certificate: services, migrations and "
        "`hetsched up` connect with TLS, verify the chain and the URL's host name (libpq's `verify-full`). "
        "Unset: TLS only if the server offers it, unverified.",
    )

    # -- retention: stream limits, pruned tables (issue 23 row 7; docs/RETENTION.md) ------------------
    stream_topology_max_age_s: float = Field(
        default=DEFAULT_MAX_AGE_S, gt=0, description="Max age of TOPOLOGY events (7 days)."
    )
    stream_ledger_max_age_s: float = Field(default=DEFAULT_MAX_AGE_S, gt=0, description="Max age of LEDGER events.")
    stream_placement_max_age_s: float = Field(
        default=DEFAULT_MAX_AGE_S, gt=0, description="Max age of PLACEMENT events."
    )
    stream_reservation_max_age_s: float = Field(
        default=DEFAULT_MAX_AGE_S,
        gt=0,
        description="Max age of RESERVATION events; the filler restates every live reservation each quarter of it.",
    )
    stream_routing_max_age_s: float = Field(default=DEFAULT_MAX_AGE_S, gt=0, description="Max age of ROUTING events.")
    stream_rebalance_max_age_s: float = Field(
        default=DEFAULT_MAX_AGE_S,
        gt=0,
        description="Max age of REBALANCE events; the rebalancer restates its throttles and draining replicas each "
        "quarter of it.",
    )
    stream_max_bytes: int = Field(
        default=DEFAULT_MAX_BYTES,
        ge=0,
        description="Size cap of each stream (bytes; the oldest events go first). JetStream reserves it on the "
        "server at creation, so all streams together must fit its store. 0: no cap.",
    )
    deadletter_retention_s: float = Field(
        default=DEFAULT_DEADLETTER_MAX_AGE_S,
        gt=0,
        description="How long dead letters are kept: the DEADLETTER stream's max age, and quarantined outbox rows.",
    )
    outbox_retention_s: float = Field(
        default=86_400.0, gt=0, description="Sent outbox rows are deleted this long after they were sent."
    )
    inbox_retention_s: float = Field(
        default=DEFAULT_DEADLETTER_MAX_AGE_S,
        gt=0,
        description="Inbox rows (events a consumer applied) are deleted this long after. At least the longest "
        "stream max age and `HETSCHED_DEADLETTER_RETENTION_S`: a copy of an event read or replayed later must "
        "still find its row.",
    )
    retention_prune_s: float = Field(
        default=300.0, gt=0, description="How often every service prunes its outbox and inbox."
    )
    retention_prune_batch: int = Field(
        default=5_000, gt=0, le=100_000, description="Rows one pruning transaction deletes at most."
    )

    def stream_max_ages(self) -> dict[Context, float]:
        """Each context stream's max age under these settings (``shared.contracts.streams.stream_specs``)."""
        return {
            Context.TOPOLOGY: self.stream_topology_max_age_s,
            Context.LEDGER: self.stream_ledger_max_age_s,
            Context.PLACEMENT: self.stream_placement_max_age_s,
            Context.RESERVATION: self.stream_reservation_max_age_s,
            Context.ROUTING: self.stream_routing_max_age_s,
            Context.REBALANCE: self.stream_rebalance_max_age_s,
            Context.TELEMETRY: self.telemetry_max_age_s,
        }

    @model_validator(mode="after")
    def _inbox_outlives_its_copies(self) -> Settings:
        # A consumer may meet an event again as long as a stream or DEADLETTER can still hand it a copy.
        floor = max(*self.stream_max_ages().values(), self.deadletter_retention_s, self.stream_duplicate_window_s)
        if self.inbox_retention_s < floor:
            raise ValueError(
                f"inbox_retention_s ({self.inbox_retention_s:.0f}) must be at least the longest stream max age, the "
                f"dead-letter retention and the duplicate window ({floor:.0f} s): a redelivered or replayed copy of an "
                "event would otherwise be applied twice"
            )
        return self


def nats_servers(url: str) -> list[str]:
    """The servers of a NATS URL that may list several, comma-separated (one per cluster node)."""
    return [part.strip() for part in url.split(",") if part.strip()]


def load_settings(**overrides: object) -> Settings:
    """Settings from the environment, with explicit overrides (used by tests and the launcher)."""
    return Settings(**overrides)  # type: ignore[arg-type]
