"""Settings: one typed section per service and one for the kit, each field read from its published
environment variable (``HETSCHED_...``) or a line of the ``.env``-style file named by
``HETSCHED_SETTINGS_FILE``.

``settings.placement.queue_page`` is read from ``HETSCHED_PLACEMENT_QUEUE_PAGE``: a section's fields take
its prefix unless a field names its own variable (``validation_alias``); a bad value's error names the
variable. README.md's configuration table is generated from these models (``shared.infra.settings_doc``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import (
    AliasGenerator,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    StringConstraints,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from shared.contracts.streams import (
    DEFAULT_DEADLETTER_MAX_AGE_S,
    DEFAULT_MAX_AGE_S,
    DEFAULT_MAX_BYTES,
    DEFAULT_TELEMETRY_MAX_AGE_S,
)
from shared.contracts.subjects import Context
from shared.domain.admission.engines import Engine
from shared.domain.quotas import Quota, Quotas, parse_overrides
from shared.domain.routing.cost import Weights

PREFIX = "HETSCHED_"
_SETTINGS_FILE = os.environ.get("HETSCHED_SETTINGS_FILE")


def _default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME")
    return (Path(base) if base else Path.home() / ".local" / "share") / "hetsched"


def _section_config(env_prefix: str) -> SettingsConfigDict:
    return SettingsConfigDict(
        env_file=_SETTINGS_FILE,
        extra="ignore",
        frozen=True,
        alias_generator=AliasGenerator(validation_alias=lambda name: f"{env_prefix}{name.upper()}"),
    )


def doc_default(text: str) -> dict[str, Any]:
    """``json_schema_extra`` for a field whose README default is not its value (e.g. computed at start)."""
    return {"doc_default": text}


# -- maps: JSON (or a YAML flow mapping), and for one release the old `name=value,...` text ----------------


def _mapping_text(value: object) -> object:
    """A map given as text: JSON or a YAML flow mapping (``{acme: 2}``); the deprecated ``a=1,b=2`` form
    too. Anything else is left to the field's type."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if not text:
        return {}
    if text.startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            pass
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"not a JSON or YAML mapping: {text!r} ({exc.__class__.__name__})") from None
    pairs: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, number = part.partition("=")
        if not sep or not name.strip():
            raise ValueError(f'expected a JSON map like {{"name": 1}} (or the deprecated name=value,...), got {part!r}')
        pairs[name.strip()] = number.strip()
    return pairs


def _list_text(value: object) -> object:
    """A list given as text: a JSON list, or names separated by commas (blanks dropped)."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not a JSON list: {text!r} ({exc.msg})") from None
    return [part.strip() for part in text.split(",") if part.strip()]


def _legacy_route_weights(text: str) -> Weights:
    """The deprecated ``"rtt,price,power,affinity"`` text (e.g. ``"0.4,0.3,0.1,0.2"``)."""
    parts = [part.strip() for part in text.split(",")]
    if len(parts) != 4:
        raise ValueError(
            f"expected a JSON map of rtt, price, power, affinity (or 4 comma-separated weights), got {text!r}"
        )
    try:
        return Weights(*(float(part) for part in parts))
    except ValueError:
        raise ValueError(f"weights must be finite numbers >= 0, got {text!r}") from None


def _route_weights(value: object) -> object:
    if isinstance(value, str) and value.strip() and not value.strip().startswith("{"):
        return _legacy_route_weights(value)
    value = _mapping_text(value)
    if not isinstance(value, Mapping):
        return value
    unknown = sorted(set(map(str, value)) - {"rtt", "price", "power", "affinity"})
    if unknown:
        raise ValueError(f"unknown route weight {', '.join(unknown)}: rtt, price, power, affinity")
    try:  # built here: the section's variable names would otherwise be taken for the weights' keys
        return Weights(**{str(name): float(weight) for name, weight in value.items()})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"route weights must be finite numbers >= 0: {exc}") from None


PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class Section(BaseSettings):
    """One group of settings. ``title`` heads its part of the README table."""

    title: ClassVar[str] = ""
    model_config = _section_config(PREFIX)

    def __init__(self, **values: Any) -> None:
        # Fields passed by name (tests, the launcher) go in under their variable: the environment is read by
        # variable only (``populate_by_name`` would also read a bare ``NODE`` or ``TOKEN``).
        fields = type(self).model_fields
        super().__init__(**{(env_var(type(self), key) if key in fields else key): v for key, v in values.items()})


class KitSettings(Section):
    """The kit every service and the CLI share: NATS, Postgres, streams, events, retention, requests,
    metrics, logging, catalogs and per-tenant quotas. Each field is ``HETSCHED_<FIELD>``."""

    title: ClassVar[str] = "Kit (`settings.kit`): servers, streams, events, requests, retention, catalogs, quotas"
    model_config = _section_config(PREFIX)

    # -- servers and identity ---------------------------------------------------------------------------
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
        description="Where `hetsched up` keeps the embedded servers' data, logs and its state file.",
        json_schema_extra=doc_default("`~/.local/share/hetsched`"),
    )
    subject_prefix: str = Field(
        default="hetsched",
        pattern=r"^[A-Za-z0-9_-]+$",
        description="First token of every subject; a test run or an isolated deployment changes it.",
    )
    stream_prefix: str = Field(
        default="", pattern=r"^[A-Za-z0-9_-]*$", description="Prepended to every JetStream stream name."
    )
    region: str = Field(default="local", description="Region this service instance serves.")
    log_level: str = Field(default="INFO", description="Python logging level.")
    log_format: str = Field(
        default="json", pattern=r"^(json|text)$", description="`json` (one object per line) or `text`."
    )
    profile_dir: Path | None = Field(
        default=None,
        description="Diagnostics: when set, each service process profiles its whole run (`cProfile`) and "
        "writes `<dir>/<service>-<pid>.prof` (CPU time) when it stops (read it with `python -m pstats`). Costs CPU; "
        "unset in production.",
    )
    request_timeout_ms: int = Field(default=5000, gt=0, description="Timeout of CLI requests over NATS.")
    nats_nkey_seed_file: Path | None = Field(
        default=None,
        description="NKey seed file this process connects to NATS with (a service: its own; the CLI: the "
        "operator's `<data-dir>/nats/admin.nk` when unset and present). Unset: no NATS authentication "
        "(docs/SECURITY.md).",
    )
    nats_inbox_prefix: str = Field(
        default="_INBOX",
        pattern=r"^[A-Za-z0-9_$-]+$",
        description="Prefix of this process's reply subjects; an identity may receive replies only under its own "
        "(`_INBOX_<identity>`, printed by `hetsched credentials issue`).",
    )
    nats_tls_ca_file: Path | None = Field(
        default=None,
        description="CA certificate of the NATS server's certificate: connect with TLS and verify it.",
    )
    nats_tls_cert_file: Path | None = Field(
        default=None, description="Client certificate, for servers that verify clients (mutual TLS)."
    )
    nats_tls_key_file: Path | None = Field(default=None, description="Key of `HETSCHED_NATS_TLS_CERT_FILE`.")
    dependency_slow_ms: int = Field(
        default=1000,
        gt=0,
        description="Health says `degraded` when Postgres answers `SELECT 1`, or another service's median answer "
        "over the last 50 calls, slower than this, or when a recent call to it got no answer.",
    )
    rpc_timeout_ms: int = Field(
        default=10_000,
        gt=0,
        description="Timeout of a service's requests to another service (e.g. placement's `ledger.commit`).",
    )
    database_roles: bool = Field(
        default=True,
        description="Each service connects as its own Postgres role `hetsched_<schema>` with rights on its own "
        "schema only (the migrations create the roles). `false`: every service connects as the user in "
        "`HETSCHED_DATABASE_URL`.",
    )
    database_role_password: SecretStr | None = Field(
        default=None,
        description="One password for every per-service role: the migrations set it and the services connect "
        "with it. Unset: `hetsched up` with its embedded Postgres generates one per role (`<data-dir>/pg-roles/`); "
        "with `HETSCHED_DATABASE_URL`, the roles' passwords are left as they are (e.g. trust or peer auth).",
    )
    database_tls_ca_file: Path | None = Field(
        default=None,
        description="CA certificate that signed the Postgres server's certificate: services, migrations and "
        "`hetsched up` connect with TLS and verify the server's chain and host name (libpq's `verify-full`). "
        "Unset: TLS only if the server offers it, unverified.",
    )
    # -- outbox, streams and retention (docs/RETENTION.md) ---------------------------------------------
    outbox_poll_ms: int = Field(
        default=1000,
        gt=0,
        description="How often the outbox relay looks for unsent events when nothing woke it. Every transaction "
        "that writes events wakes its service's relay at once; the poll only finds what a relay that died left "
        "behind.",
    )
    outbox_batch: int = Field(default=256, gt=0, le=10_000, description="Rows the relay publishes per pass.")
    stream_duplicate_window_s: float = Field(
        default=120.0, gt=0, description="JetStream duplicate window: a re-sent event id inside it is dropped."
    )
    telemetry_max_age_s: float = Field(
        default=DEFAULT_TELEMETRY_MAX_AGE_S, gt=0, description="Max age of TELEMETRY messages."
    )
    stream_topology_max_age_s: float = Field(
        default=DEFAULT_MAX_AGE_S,
        gt=0,
        description="Max age of TOPOLOGY events (7 days; docs/RETENTION.md says why per stream).",
    )
    stream_ledger_max_age_s: float = Field(default=DEFAULT_MAX_AGE_S, gt=0, description="Max age of LEDGER events.")
    stream_placement_max_age_s: float = Field(
        default=DEFAULT_MAX_AGE_S, gt=0, description="Max age of PLACEMENT events."
    )
    stream_reservation_max_age_s: float = Field(
        default=DEFAULT_MAX_AGE_S,
        gt=0,
        description="Max age of RESERVATION events; the filler restates every active reservation each quarter of it.",
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
        description="Size cap of each stream (oldest events go first); JetStream reserves it at creation, so all "
        "streams must fit the server's store. `0`: no cap.",
    )
    deadletter_retention_s: float = Field(
        default=DEFAULT_DEADLETTER_MAX_AGE_S,
        gt=0,
        description="How long dead letters are kept: DEADLETTER's max age, and quarantined outbox rows.",
    )
    outbox_retention_s: float = Field(
        default=86_400.0, gt=0, description="Sent outbox rows are deleted this long after they were sent."
    )
    inbox_retention_s: float = Field(
        default=DEFAULT_DEADLETTER_MAX_AGE_S,
        gt=0,
        description="Inbox rows are deleted this long after the event was applied; at least the longest stream "
        "max age and the dead-letter retention (checked at start).",
    )
    retention_prune_s: float = Field(
        default=300.0, gt=0, description="How often every service prunes its outbox and inbox."
    )
    retention_prune_batch: int = Field(
        default=5_000, gt=0, le=100_000, description="Rows one pruning transaction deletes at most."
    )
    stream_replicas: int = Field(
        default=1,
        ge=1,
        le=5,
        description="Replicas of every JetStream stream: 3 on a 3-node cluster (R3), 1 on a single server.",
    )
    # -- events: size check, redelivery and dead letters -------------------------------------------------
    event_max_bytes: int = Field(
        default=900_000,
        gt=0,
        description="Largest event (UTF-8 JSON bytes) a transaction may emit, below NATS `max_payload`; a larger "
        "one fails the request with `invalid_request`.",
    )
    event_max_deliveries: int = Field(
        default=5,
        gt=0,
        description="Deliveries of an event whose handler keeps failing before the consumer moves it to the "
        "`DEADLETTER` stream.",
    )
    event_redelivery_backoff_ms: int = Field(
        default=500, gt=0, description="Delay before a failed event is redelivered; doubles on each redelivery."
    )
    event_redelivery_backoff_max_ms: int = Field(
        default=10_000, gt=0, description="Longest delay between two deliveries of a failing event."
    )
    # -- the request path: workers, limits, deadlines -----------------------------------------------------
    request_workers: int = Field(
        default=64,
        gt=0,
        le=1024,
        description="Requests a service serves at once, per subject (concurrent requests share group commits).",
    )
    request_max_bytes: int = Field(
        default=512 * 1024,
        gt=0,
        description="Largest request body a service reads; a larger one is `invalid_request` (docs/API.md "
        '"Limits"). Keep it under NATS `max_payload`.',
    )
    request_deadline_ms: int = Field(
        default=10_000,
        gt=0,
        description="Deadline of a request that carries no `Hetsched-Deadline` header, counted from its arrival "
        '(docs/API.md "Deadlines").',
    )
    request_saturated_ms: int = Field(
        default=2_000,
        gt=0,
        description="A service's health turns `degraded` (check `workers`) when every worker of one of its "
        "subjects has been busy for longer than this.",
    )
    db_pool_size: int = Field(default=10, gt=0, description="SQLAlchemy pool size per service.")
    # -- observability ---------------------------------------------------------------------------------
    otel_exporter: str = Field(
        default="none",
        pattern=r"^(none|console|otlp)$",
        description="OpenTelemetry trace exporter: `none`, `console` or `otlp`.",
    )
    metrics_host: str = Field(
        default="127.0.0.1", description="Where each service serves its Prometheus metrics (`/metrics`)."
    )
    metrics_port: int = Field(
        default=0,
        ge=-1,
        le=65535,
        description="Port of a service's metrics endpoint: 0 picks a free one (named in `hetsched status --json` "
        "as `metrics_url`), -1 serves none.",
    )
    metrics_max_connections: int = Field(
        default=16,
        gt=0,
        le=10_000,
        description="Connections a service's metrics endpoint holds at once; a new one displaces the oldest that "
        "has not sent its request yet, else gets 503 (docs/SECURITY.md).",
    )
    metrics_read_timeout_s: float = Field(
        default=5.0,
        gt=0,
        le=300,
        description="A connection to the metrics endpoint that has not sent its request within this long (or "
        "not taken the answer within as long again) is closed.",
    )
    # -- catalogs ----------------------------------------------------------------------------------------
    model_catalog: Path | None = Field(
        default=None,
        description="A model catalog file (YAML, same shape as `shared/catalog/models.yaml`) merged over the "
        "shipped one.",
    )
    sku_catalog: Path | None = Field(
        default=None,
        description="A SKU catalog file (YAML, same shape as `shared/catalog/skus.yaml`) merged over the shipped one.",
    )
    model_groups: Path | None = Field(
        default=None,
        description="A model-group file (YAML, the shape of `shared/catalog/model_groups.yaml`) replacing the "
        "shipped one: one API name for several models served by different engines.",
    )
    regions_file: Path | None = Field(
        default=None,
        description="Regions (RTT matrix, price per SKU-hour, $/kWh, PUE) replacing `shared/catalog/regions.yaml`; "
        "the router re-reads it when it changes.",
    )
    # -- per-tenant quotas (placement and reservations enforce them); 0: unlimited ------------------------
    quota_gpus_reserved_per_tenant: int = Field(
        default=10_000,
        ge=0,
        description="Accelerators one tenant's active reservations may hold in all; a `reservation.create` past "
        "it is `quota_exceeded`. 0: unlimited.",
    )
    quota_gpus_placed_per_tenant: int = Field(
        default=10_000,
        ge=0,
        description="Accelerators one tenant's live replicas may hold (each counted once; commits in flight "
        "count); a `placement.place` past it is `quota_exceeded`. 0: unlimited.",
    )
    quota_queued_requests_per_tenant: int = Field(
        default=1_000,
        ge=0,
        description="Placements one tenant may have waiting in the queue; one more is `quota_exceeded`. 0: unlimited.",
    )
    quota_tenant_overrides: dict[str, dict[str, int]] = Field(
        default_factory=dict,
        description='Per-tenant limits over the three above, JSON: `{"acme": {"gpus_placed": 64, '
        '"queued_requests": 10}}` (quotas `gpus_reserved`, `gpus_placed`, `queued_requests`; 0: unlimited). '
        "An unknown quota name fails the start.",
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
    def _inbox_outlives_its_copies(self) -> KitSettings:
        # A consumer may meet an event again as long as a stream or DEADLETTER can still hand it a copy.
        floor = max(*self.stream_max_ages().values(), self.deadletter_retention_s, self.stream_duplicate_window_s)
        if self.inbox_retention_s < floor:
            raise ValueError(
                f"HETSCHED_INBOX_RETENTION_S (inbox_retention_s, {self.inbox_retention_s:.0f}) must be at least the "
                f"longest stream max age, the dead-letter retention and the duplicate window ({floor:.0f} s): a "
                "redelivered or replayed copy of an event would otherwise be applied twice"
            )
        return self


class ConsoleSettings(Section):
    """``hetsched console``: its token and the limits of its HTTP server."""

    title: ClassVar[str] = "Console (`settings.console`)"
    model_config = _section_config(f"{PREFIX}CONSOLE_")

    token: SecretStr | None = Field(
        default=None,
        description="Token `hetsched console` requires on every route but its login page (at least 16 "
        "characters); unset or empty, it makes a new one at each start and prints it once, in the URL to open.",
        json_schema_extra=doc_default("unset (a new random one at each start)"),
    )
    allowed_hosts: str = Field(
        default="localhost,127.0.0.1,[::1]",
        description="Host header values the console answers, comma-separated; a name without a port means the "
        "console's port, and the address given to `--host` is added. Any other Host gets 421 and no data.",
    )
    max_connections: int = Field(
        default=64, gt=0, le=10_000, description="Connections the console holds at once (as the metrics endpoint)."
    )
    read_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=300,
        description="A connection to the console that has not sent its request within this long is closed.",
    )


class LedgerSettings(Section):
    """The capacity ledger: HBM ceiling, leases, group commit, cross-domain budget, drift."""

    title: ClassVar[str] = "Capacity ledger (`settings.ledger`)"
    model_config = _section_config(f"{PREFIX}LEDGER_")

    ceiling: float = Field(
        default=0.92,
        gt=0,
        le=1,
        description="Share of each accelerator's HBM the ledger may allocate (usable = total x ceiling).",
    )
    default_lease_s: int = Field(
        default=300,
        gt=0,
        description="Lease of a commit that names none; an allocation not renewed in time expires.",
    )
    max_batch: int = Field(
        default=256,
        gt=0,
        le=10_000,
        description="Most commits the ledger applies in one transaction: commits arriving together share it "
        "(group commit).",
    )
    cross_domain_budget_bytes_per_s: int = Field(
        default=256_000_000_000,
        ge=0,
        description="Cross-domain TP traffic the replicas of one cluster may send in all (default 256 GB/s, a "
        "product requirement; size it to your inter-node fabric); "
        "the ledger refuses a commit past it (`no_capacity`); placement shares it out by SLO below it. "
        "0: not enforced.",
    )
    sweep_ms: int = Field(default=500, gt=0, description="How often the ledger releases expired leases.")
    drift_threshold: float = Field(
        default=0.10,
        gt=0,
        lt=1,
        validation_alias=f"{PREFIX}DRIFT_THRESHOLD",
        description="Observed vs reserved HBM difference, as a share of usable HBM, that counts as drift.",
    )
    drift_consecutive: int = Field(
        default=2,
        gt=0,
        validation_alias=f"{PREFIX}DRIFT_CONSECUTIVE",
        description="Telemetry samples in a row over the threshold before a `drift_detected` event.",
    )
    drift_grace_s: float = Field(
        default=600.0,
        ge=0,
        description="An accelerator holding a replica allocation committed less than this long ago is not checked "
        "for drift: its engine is still starting and loading its weights (0: checked at once).",
    )


class TopologySettings(Section):
    """Topology discovery: the fleet owner, or an agent profiling its node."""

    title: ClassVar[str] = "Topology discovery (`settings.topology`)"
    model_config = _section_config(f"{PREFIX}TOPOLOGY_")

    mode: str = Field(
        default="fleet",
        pattern=r"^(fleet|agent)$",
        description="`fleet`: the topology service owns the fleet (inventory, agent reports, liveness); `agent`: "
        "profile this node.",
    )
    inventory: Path | None = Field(
        default=None,
        description="Fleet inventory file the fleet-mode topology service loads.",
        json_schema_extra=doc_default("unset (`hetsched up`: the demo fleet)"),
    )
    provider: str = Field(
        default="nvml",
        pattern=r"^(nvml|nvidia-smi|none)$",
        description="Agent mode: `nvml` or `nvidia-smi`; `none`: the node is defined by the inventory, so the "
        "agent neither profiles nor beats, and only runs its engines (`HETSCHED_AGENT_ENGINE`).",
    )
    node: str | None = Field(
        default=None, description="Agent mode: the node's name.", json_schema_extra=doc_default("host name")
    )
    cluster: str = Field(
        default="default", description="Agent mode: the node's cluster (its region is `HETSCHED_REGION`)."
    )
    rack: str = Field(default="default", description="Agent mode: the node's rack.")
    sku: str | None = Field(default=None, description="Agent mode: SKU name when the device name does not tell it.")
    smi_topo_file: Path | None = Field(
        default=None,
        description="Agent mode, nvidia-smi: read a captured `nvidia-smi topo -m` instead of running it.",
    )
    smi_query_file: Path | None = Field(
        default=None, description="Agent mode, nvidia-smi: read a captured `--query-gpu` CSV instead of running it."
    )
    heartbeat_s: float = Field(default=30.0, gt=0, description="Agents' heartbeat interval.")
    missed_heartbeats: int = Field(
        default=3, gt=0, description="Missed heartbeats after which a node is published as lost."
    )
    scan_s: float = Field(
        default=60.0,
        gt=0,
        description="Agent mode: how often the node is profiled again (a change is reported at once).",
    )
    telemetry_interval_s: float = Field(
        default=30.0,
        gt=0,
        validation_alias=f"{PREFIX}TELEMETRY_INTERVAL_S",
        description="Agent mode: GPU telemetry interval (TELEMETRY stream).",
    )


class AgentSettings(Section):
    """The node agent's engine supervisor (docs/ENGINES.md): which engine it starts for the replica parts
    placement assigns to its node, on which addresses and ports, and how it stops and restarts them."""

    title: ClassVar[str] = "Node agent engines (`settings.agent`)"
    model_config = _section_config(f"{PREFIX}AGENT_")

    engine: str = Field(
        default="none",
        pattern=r"^(none|vllm|sglang|sim|custom)$",
        description="Engine the agent starts for each replica part on its node: `vllm`, `sglang`, `sim` "
        "(hetsched's simulated engine), `custom` (`HETSCHED_AGENT_ENGINE_COMMAND`), or `none` (the agent "
        "profiles and reports only; engines are started by other means).",
    )
    engine_command: str | None = Field(
        default=None,
        description="`custom` engine: the command template, with `{model}`, `{checkpoint}`, `{host}`, `{port}`, "
        "`{tp}`, `{pp}`, `{devices}`, `{replica_id}`, `{rank}`, `{ranks}`, `{head_node}`, `{dtype}`.",
    )
    bind_host: str = Field(default="0.0.0.0", description="Address the engines listen on.")
    advertise_host: str | None = Field(
        default=None,
        description="Host in the endpoint URLs the agent reports (what gateways connect to).",
        json_schema_extra=doc_default("the node's host name"),
    )
    port_min: int = Field(default=8100, gt=0, le=65535, description="Lowest port given to an engine.")
    port_max: int = Field(default=8999, gt=0, le=65535, description="Highest port given to an engine.")
    stop_grace_s: float = Field(
        default=30.0, ge=0, description="Between SIGTERM and SIGKILL when an engine is stopped."
    )
    max_crashes: int = Field(
        default=3, ge=1, description="Crashes in a row after which an engine is reported `failed` (no restart)."
    )
    restart_backoff_s: float = Field(
        default=2.0, ge=0, description="Wait before restarting a crashed engine; doubles per crash in a row."
    )
    restart_backoff_max_s: float = Field(default=60.0, ge=0, description="Longest wait before a restart.")
    status_s: float = Field(
        default=10.0, gt=0, description="How often each engine's `/metrics` is scraped and its status published."
    )
    reconcile_s: float = Field(
        default=2.0, gt=0, description="How often the agent asks which replica parts its node runs, and probes them."
    )
    sim_speedup: float = Field(
        default=1.0, gt=0, description="`sim` engine: how much faster than modelled it loads and generates."
    )

    @model_validator(mode="after")
    def _ports(self) -> AgentSettings:
        if self.port_max < self.port_min:
            raise ValueError("HETSCHED_AGENT_PORT_MAX must be at least HETSCHED_AGENT_PORT_MIN")
        return self


class PlacementSettings(Section):
    """Placement: leases, its view of the fleet, ownership of commits, the queue, and admission
    (``placement.admit``, whose fields keep their ``HETSCHED_ADMIT_`` variables)."""

    title: ClassVar[str] = "Placement and admission (`settings.placement`)"
    model_config = _section_config(f"{PREFIX}PLACEMENT_")

    default_lease_s: int = Field(
        default=3600,
        gt=0,
        description="Lease of a placed replica when the request names none (renew with `placement.renew`); also "
        "the lease placement renews a replica to while its node agents report its engines running "
        '(docs/PLACEMENT.md "Replica lifecycle").',
    )
    first_lease_s: int = Field(
        default=60,
        gt=0,
        description="A newly placed replica's first lease: the ledger holds it this long (or its own lease, if "
        "shorter) until the caller's first `placement.renew` or its engine's first status report extends it to the "
        "lease it asked for. A placement whose caller never learnt of it (the answer was lost and no retry came) "
        'frees its accelerators after this (docs/PLACEMENT.md, "One durable step").',
    )
    refresh_ms: int = Field(
        default=0,
        ge=0,
        description="When > 0, placement re-reads its whole view of the fleet (`fleet.get` + `ledger.snapshot`) "
        "this often; TOPOLOGY and LEDGER events keep it current anyway.",
        json_schema_extra=doc_default("`0` (off)"),
    )
    stale_after_ms: int = Field(
        default=5000,
        gt=0,
        description="Placement's health check `view` reports `behind` when events older than this wait to be "
        "applied to its view (docs/API.md).",
    )
    reconcile_period_s: float = Field(
        default=30.0,
        gt=0,
        description="How often placement's reconciler releases ledger allocations that no placement decision owns "
        '(docs/API.md "Placement request ids").',
    )
    intent_grace_s: float = Field(
        default=300.0,
        gt=0,
        description="A placement intent still `committing` this long is abandoned and what it reserved released; "
        "a retry with the same id inside it recovers the allocation.",
    )
    fault_after_commit: str = Field(
        default="",
        pattern=r"^(|exit)$",
        description="Tests only: `exit` makes placement exit right after a ledger commit, before it records the "
        "decision.",
    )
    queue_timeout_s: int = Field(
        default=600,
        gt=0,
        le=24 * 3600,
        description="How long a `queued` placement waits for capacity when its request names no `queue_timeout_s`; "
        'then it is rejected `no_capacity` ("queue timeout"). docs/API.md "Queue".',
    )
    queue_retry_s: float = Field(
        default=5.0,
        gt=0,
        description="Placement retries its queue this often, besides whenever an allocation is released or "
        "expires or a node comes (back).",
    )
    pcie_window_s: float = Field(
        default=60.0,
        ge=0,
        description="A node's PCIe utilisation (GPU telemetry) is the lowest sample over this window, so it counts "
        "as over the 0.7 threshold (no cold loads) only when it stayed over it that long; `0`: the latest sample.",
    )
    queue_page: int = Field(
        default=200,
        gt=0,
        le=10_000,
        description="Queued placements read per page: every pass of the queue pages through all of them (round "
        'robin by tenant; docs/API.md "Queue").',
    )
    load_expected_s: float = Field(
        default=600.0,
        gt=0,
        description="How long a replica's engines are expected to take to load (its ranks report `loading`); one "
        "loading longer counts in `hetsched_replicas_loading_overdue` (alert `ReplicaLoadingOverdue`).",
    )
    # -- admission: the request path (placement.admit) -----------------------------------------------------
    engine_stale_s: float = Field(
        default=15.0,
        gt=0,
        validation_alias=f"{PREFIX}ENGINE_STALE_S",
        description="A replica whose engine has not reported its status (`engine_status`) for this long leaves "
        "admission's rotation until it reports again; a rank's lifecycle report (`replica_state`) older than this "
        "counts as absent.",
    )
    admit_max_queue_depth: int = Field(
        default=16,
        gt=0,
        validation_alias=f"{PREFIX}ADMIT_MAX_QUEUE_DEPTH",
        description="`placement.admit` sends nothing more to a replica whose engine queue is this deep "
        "(admissions since its last report count).",
    )
    admit_long_context_tokens: int = Field(
        default=32000,
        gt=0,
        validation_alias=f"{PREFIX}ADMIT_LONG_CONTEXT_TOKENS",
        description="Input above this prefers an engine whose memory does not grow with context (SSM, then hybrid).",
    )
    admit_strict_ttft_ms: float = Field(
        default=100.0,
        gt=0,
        validation_alias=f"{PREFIX}ADMIT_STRICT_TTFT_MS",
        description="A TTFT SLO under this prefers the fastest engine that meets it; otherwise least cost "
        "(`10·queue + 200·max(0, kv_use−0.85) + latency + 5·max(0, latency−SLO)`).",  # noqa: RUF001
    )
    admit_tenant_rate: float = Field(
        default=200.0,
        gt=0,
        validation_alias=f"{PREFIX}ADMIT_TENANT_RATE",
        description="Per-tenant token bucket of admission (requests/s): a tenant within it is served first when "
        "requests wait (weighted fair queueing).",
    )
    admit_tenant_burst: float = Field(
        default=400.0,
        gt=0,
        validation_alias=f"{PREFIX}ADMIT_TENANT_BURST",
        description="Depth of that token bucket.",
    )
    admit_tenant_weights: Annotated[dict[str, PositiveFloat], NoDecode] = Field(
        default_factory=dict,
        validation_alias=f"{PREFIX}ADMIT_TENANT_WEIGHTS",
        description='Fair-queueing weights per tenant, JSON (or YAML) `{"acme": 2, "beta": 0.5}` (others weigh '
        "1). Deprecated, accepted for one release: `acme=2,beta=0.5`.",
    )
    admit_queue_ttl_s: float = Field(
        default=30.0,
        gt=0,
        validation_alias=f"{PREFIX}ADMIT_QUEUE_TTL_S",
        description="A `queued` admission waits this long for a replica to free, then is dropped (asking again "
        "starts over).",
    )
    admit_kv_guarantees: Annotated[dict[Engine, PositiveFloat], NoDecode] = Field(
        default_factory=dict,
        validation_alias=f"{PREFIX}ADMIT_KV_GUARANTEES",
        description='Guaranteed share of a node\'s KV per engine, JSON (or YAML) `{"transformer": 0.4, "moe": '
        '0.3, "ssm": 0.3}` (default: equal among the engines on the node); an idle engine\'s share is lent, '
        "donors MoE > Transformer > SSM. Deprecated, accepted for one release: `transformer=0.4,moe=0.3,ssm=0.3`.",
    )

    admit_tenancy: Literal["own", "any"] = Field(
        default="own",
        validation_alias=f"{PREFIX}ADMIT_TENANCY",
        description="Whose replicas a tenant's requests may use: `own`, only the replicas it placed and those of "
        "`HETSCHED_ADMIT_SHARED_OWNERS` (another tenant's replicas are never named to it; none of its own: "
        "`no_capacity`); `any`, every replica, whoever placed it.",
    )
    admit_shared_owners: Annotated[tuple[Annotated[str, StringConstraints(min_length=1)], ...], NoDecode] = Field(
        default=(),
        validation_alias=f"{PREFIX}ADMIT_SHARED_OWNERS",
        description="Tenants whose replicas serve every tenant under `own` (a shared pool), comma-separated "
        '`platform,infra` or a JSON list `["platform"]`.',
        json_schema_extra=doc_default("empty"),
    )

    @field_validator("admit_tenant_weights", "admit_kv_guarantees", mode="before")
    @classmethod
    def _map(cls, value: object) -> object:
        return _mapping_text(value)

    @field_validator("admit_shared_owners", mode="before")
    @classmethod
    def _names(cls, value: object) -> object:
        return _list_text(value)


class ReservationSettings(Section):
    """The reservation filler: lending idle reserved accelerators and reclaiming them."""

    title: ClassVar[str] = "Reservations (`settings.reservations`)"
    model_config = _section_config(f"{PREFIX}RESERVATION_")

    fill_target: float = Field(
        default=0.85,
        gt=0,
        le=1,
        description="A soft or spot reservation's idle GPUs are lent while its owner fills less than this share of it.",
    )
    backoff_s: float = Field(
        default=30.0,
        ge=0,
        description="A GPU reclaimed from a borrower is not lent again for this long; each reclaim within the max "
        "doubles it.",
    )
    backoff_max_s: float = Field(
        default=1800.0, gt=0, description="The longest backoff, and how long a reclaim is remembered."
    )
    tick_s: float = Field(
        default=1.0,
        gt=0,
        description="How often the filler re-issues preemptions the ledger has not acknowledged and re-offers GPUs "
        "whose backoff ended.",
    )
    fault_after_record: str = Field(
        default="",
        description="Tests only: `exit` kills the filler between writing a reclaim's preemptions and asking the "
        "ledger.",
    )


class RoutingSettings(Section):
    """The cross-region router: route cost weights, damping, affinity."""

    title: ClassVar[str] = "Cross-region routing (`settings.routing`)"
    model_config = _section_config(f"{PREFIX}ROUTE_")

    weights: Annotated[Weights, NoDecode] = Field(
        default_factory=Weights,
        description="α,β,γ,δ of the route cost α·RTT + β·price + γ·power·PUE − δ·affinity (normalised terms): a "  # noqa: RUF001
        "JSON (or YAML) map of `rtt`, `price`, `power`, `affinity`; a weight left out keeps its default. "
        "Deprecated, accepted for one release: the four numbers, `0.4,0.3,0.1,0.2`.",
    )
    damping_s: float = Field(
        default=1800.0,
        ge=0,
        description="A tenant's region changes at most once per this long, unless its region is down, drained or full.",
    )
    affinity_days: int = Field(
        default=7,
        gt=0,
        description="Window of the traffic that makes a tenant's region affinity (>= 95% of it in one region "
        "scores 1.0).",
    )
    flush_ms: int = Field(
        default=500,
        gt=0,
        description="How often the router writes its traffic counts (affinity) to Postgres; a crash loses at most "
        "this much of them.",
    )
    write_spacing_ms: float = Field(
        default=2.0,
        ge=0,
        le=1000,
        description="The router starts a transaction writing tenants' and sessions' regions at most once per this "
        "long: under load the routes of that time share one (less CPU for the router and Postgres per request), "
        "each answered up to this much later; 0: each transaction starts at once.",
    )

    @field_validator("weights", mode="before")
    @classmethod
    def _weights(cls, value: object) -> object:
        return _route_weights(value)


class RebalancerSettings(Section):
    """The rebalancer's detectors (hot, cold, fragmentation, PCIe, drift) and its pace."""

    title: ClassVar[str] = "Rebalancer (`settings.rebalancer`)"
    model_config = _section_config(f"{PREFIX}REBALANCE_")

    hot_util: float = Field(
        default=0.85,
        gt=0,
        le=1,
        description="A replica whose engine's KV cache use (or, for an engine that never reported, its GPUs' HBM "
        "use) stays above this ...",
    )
    hot_window_s: float = Field(default=60.0, ge=0, description="... for this long gets a copy (`replicate`).")
    cold_util: float = Field(
        default=0.30,
        gt=0,
        le=1,
        description="A node whose GPUs' load (each replica's engine KV cache use, else HBM use) stays below this ...",
    )
    cold_window_s: float = Field(
        default=300.0, ge=0, description="... for this long has its replicas moved off it (`consolidate`)."
    )
    frag_threshold: float = Field(
        default=0.3, gt=0, le=1, description="A TPU pod whose fragmentation stays above this ..."
    )
    frag_window_s: float = Field(
        default=60.0, ge=0, description="... for this long has an 8x8 block freed (`defragment`)."
    )
    pcie_util: float = Field(default=0.7, gt=0, le=1, description="A node whose PCIe stays above this ...")
    pcie_window_s: float = Field(
        default=60.0, ge=0, description="... for this long takes no new replica until it clears (`throttle`)."
    )
    drift_ratio: float = Field(
        default=0.10,
        gt=0,
        description="An allocation alone on its GPUs whose observed HBM differs from its reservation by more than "
        "this share of it raises `drift_alarm`.",
    )
    drift_check_s: float = Field(
        default=10.0, gt=0, description="Least time between two drift checks of one node's allocations."
    )
    drift_window_s: float = Field(
        default=60.0, ge=0, description="Drift lasting this long re-places the replica (`replace`)."
    )
    hysteresis: float = Field(
        default=0.05,
        ge=0,
        description="A firing hot, cold, fragmentation or PCIe detector clears only this far past its threshold.",
    )
    migrations_per_min: float = Field(
        default=2.0,
        gt=0,
        description="Replica copies the rebalancer starts per minute and cluster (also the burst).",
    )
    drain_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="A draining replica whose engine has not reported itself idle (no queue, no KV in use) since "
        "its drain started is released after this long anyway, with work possibly in flight.",
    )
    wait_for_ready: str = Field(
        default="auto",
        pattern=r"^(auto|always|never)$",
        description="Whether a move drains its old replica only once its copy's engine reports `ready` "
        "(`replica_state` from the nodes' agents): `always`; `never` (as soon as every copy is placed); `auto`, "
        "only where an agent runs engines on the copy's nodes (one reported a `replica_state` within "
        "3 x `HETSCHED_AGENT_STATUS_S`) or the copy itself reported (docs/REBALANCER.md).",
    )
    ready_timeout_s: float = Field(
        default=900.0,
        gt=0,
        description="A copy whose engine has not reported `ready` this long after it was placed is released and "
        "its old replica kept (the move rolls back); a large model's cold load takes minutes.",
    )
    state_grace_s: float = Field(
        default=120.0,
        ge=0,
        description="Where the nodes' agents report the engines' lifecycle (`replica_state`), a replica is judged "
        "hot, cold or drifting only once every rank is `ready` and this long after its last state change.",
    )
    replicate_per_model_hour: int = Field(
        default=2,
        ge=0,
        description="Most copies the rebalancer makes of one tenant's model in any hour (`replicate`; 0: none).",
    )
    tick_s: float = Field(default=1.0, gt=0, description="How often the rebalancer plans and advances its plans.")


class GatewaySettings(Section):
    """The OpenAI-compatible gateway (docs/GATEWAY.md): where it listens, how it estimates a request's tokens,
    how long it waits for a replica, how it fails over, and the TTFT targets its SLO alert compares with."""

    title: ClassVar[str] = "Gateway (`settings.gateway`)"
    model_config = _section_config(f"{PREFIX}GATEWAY_")

    host: str = Field(default="127.0.0.1", description="Address the gateway listens on (`0.0.0.0`: every interface).")
    port: int = Field(default=8080, ge=0, le=65535, description="Its port (0: a free one; `hetsched status` names it).")
    region: str | None = Field(
        default=None,
        description="The region the gateway runs in: the origin of its `route.select` calls unless a request's "
        "`x-hetsched-region` header names another.",
        json_schema_extra=doc_default("the first region of the regions file"),
    )
    chars_per_token: float = Field(
        default=4.0, gt=0, description="Prompt characters per token when it estimates a request's input for admission."
    )
    default_output_tokens: int = Field(
        default=256,
        gt=0,
        description="Output tokens admission counts for a request that sets no `max_tokens` "
        "(or `max_completion_tokens`).",
    )
    max_failovers: int = Field(
        default=2, ge=0, description="Other replicas tried when one fails a request before its first token."
    )
    connect_timeout_s: float = Field(default=2.0, gt=0, description="Longest wait to connect to an engine.")
    first_token_timeout_s: float = Field(
        default=60.0, gt=0, description="Longest wait for an engine's first token (or whole reply, unstreamed)."
    )
    idle_timeout_s: float = Field(default=60.0, gt=0, description="Longest silence of an engine mid-stream.")
    queue_wait_s: float = Field(
        default=30.0, gt=0, description="Longest a request waits in admission's queue before a 503."
    )
    request_timeout_s: float = Field(
        default=2.0, gt=0, description="Timeout of one `route.select` or `placement.admit` call."
    )
    max_body_bytes: int = Field(default=32 * 1024 * 1024, gt=0, description="Largest request body accepted.")
    admission_lease_s: int = Field(
        default=300,
        gt=1,
        le=86400,
        description="How long an admission counts a request's KV without a release; renewed every half of it "
        "while the request runs.",
    )
    keys_refresh_s: float = Field(
        default=2.0, gt=0, description="How often the API keys are re-read (a revoked key stops working within it)."
    )
    usage_flush_s: float = Field(
        default=1.0, gt=0, description="How often usage is written to Postgres and published as `usage` events."
    )
    slo_ttft_ms: float = Field(
        default=200.0, gt=0, description="TTFT target of every model (`hetsched_gateway_slo_ttft_seconds`)."
    )
    slo_ttft_ms_by_model: dict[str, float] = Field(
        default_factory=dict, description="TTFT targets of some models, a JSON map (model -> ms)."
    )


class Settings(BaseModel):
    """Every knob of hetsched: one section per service and one for the kit. ``Settings()`` reads each section
    from the environment; ``Settings(kit={"nats_url": ...})`` overrides fields by name (the rest still from the
    environment); ``settings.updated(placement={"queue_page": 5})`` copies with changes."""

    model_config = ConfigDict(frozen=True)

    kit: KitSettings = Field(default_factory=KitSettings)
    console: ConsoleSettings = Field(default_factory=ConsoleSettings)
    ledger: LedgerSettings = Field(default_factory=LedgerSettings)
    topology: TopologySettings = Field(default_factory=TopologySettings)
    agent: AgentSettings = Field(default_factory=AgentSettings)
    placement: PlacementSettings = Field(default_factory=PlacementSettings)
    reservations: ReservationSettings = Field(default_factory=ReservationSettings)
    routing: RoutingSettings = Field(default_factory=RoutingSettings)
    rebalancer: RebalancerSettings = Field(default_factory=RebalancerSettings)
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)

    @model_validator(mode="before")
    @classmethod
    def _sections_from_mappings(cls, data: object) -> object:
        # A section given as a mapping is built like Settings() builds it: the rest from the environment.
        if not isinstance(data, Mapping):
            return data
        built = dict(data)
        for name, value in data.items():
            section = _section_type(name)
            if section is not None and isinstance(value, Mapping):
                built[name] = section(**value)
        return built

    def updated(self, **changes: Mapping[str, object]) -> Settings:
        """A copy with fields of sections replaced, e.g. ``updated(kit={"nats_url": url})`` (not validated,
        like ``model_copy``); a name that is no section or field raises ``ValueError``."""
        sections: dict[str, object] = {}
        for name, fields in changes.items():
            section_type = _section_type(name)
            if section_type is None:
                raise ValueError(f"no settings section {name!r}: {', '.join(SECTIONS)}")
            unknown = sorted(set(fields) - set(section_type.model_fields))
            if unknown:
                raise ValueError(f"settings.{name} has no field {', '.join(unknown)}")
            sections[name] = getattr(self, name).model_copy(update=dict(fields))
        return self.model_copy(update=sections)

    def quotas(self) -> Quotas:
        """The per-tenant quotas these settings give (``KitSettings.quotas``)."""
        return self.kit.quotas()


def _section_type(name: str) -> type[Section] | None:
    field = Settings.model_fields.get(name)
    annotation = field.annotation if field is not None else None
    return annotation if isinstance(annotation, type) and issubclass(annotation, Section) else None


SECTIONS: tuple[str, ...] = tuple(Settings.model_fields)


def env_var(section: type[Section], field: str) -> str:
    """The environment variable a section's field is read from."""
    alias = section.model_fields[field].validation_alias
    assert isinstance(alias, str), (section.__name__, field)
    return alias


def env_vars() -> dict[str, str]:
    """Every setting's environment variable -> its path in ``Settings`` (e.g. ``placement.queue_page``)."""
    return {
        env_var(section, field): f"{name}.{field}"
        for name in SECTIONS
        if (section := _section_type(name)) is not None
        for field in section.model_fields
    }


def nats_servers(url: str) -> list[str]:
    """The servers of a NATS URL that may list several, comma-separated (one per cluster node)."""
    return [part.strip() for part in url.split(",") if part.strip()]


def load_settings(**sections: Mapping[str, object] | Section) -> Settings:
    """Settings from the environment, with fields overridden per section (used by tests and the launcher),
    e.g. ``load_settings(kit={"data_dir": path})``."""
    return Settings.model_validate(sections)
