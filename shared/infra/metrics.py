"""Prometheus metrics: every service serves its own over HTTP (``/metrics``, the text exposition format).

Why prometheus-client rather than the OpenTelemetry SDK with its Prometheus exporter: the names the
operators' alerts and dashboards use are fixed (``hetsched_hbm_utilization_ratio``, ...), and the OTel
exporter derives the exposed name from the instrument name plus unit and type suffixes, which a version
bump may change under every alert. prometheus-client exposes exactly the name registered, with explicit
histogram buckets, and is the reference implementation of the format. (Traces stay OpenTelemetry.)

``CATALOGUE`` names every metric the services export, with its type, labels and owner: alerts
(``infra/prometheus/alerts.yml``) and dashboards (``infra/grafana/``) are checked against it. A service
builds its ``ServiceMetrics`` once (``Runtime.metrics``) and asks it for the metrics it owns; nothing is a
module global, so tests build as many as they like.

The endpoint is ``shared.infra.httpserver`` on an event loop in one thread of its own (not the service's
loop, so a scrape still answers while that loop is busy), with a read timeout and a cap on concurrent
connections: prometheus-client's ``start_http_server`` started a thread per connection and kept an idle
one forever (issue 23 row 6: 200 idle connections, 202 threads).
"""

from __future__ import annotations

import asyncio
import gzip
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.registry import Collector

from shared.infra.httpserver import HttpServer, Limits, Request, Response

Kind = Literal["counter", "gauge", "histogram"]

TOPOLOGY = "topology-discovery"
LEDGER = "capacity-ledger"
PLACEMENT = "placement"
RESERVATION = "reservation-filler"
ROUTER = "cross-region-router"
REBALANCER = "rebalancer"
GATEWAY = "gateway"
EVERY_SERVICE = "every-service"
"""The owner of the kit's own metrics, which every service exports (``ServiceMetrics.export_kit``)."""

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10)
TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120)
GATEWAY_LABELS = ("model", "engine", "sku", "region")
ADDED_BUCKETS = (0.00025, 0.0005, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 1)


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...]
    owner: str
    buckets: tuple[float, ...] | None = None


def _spec(name: str, kind: Kind, help: str, labels: tuple[str, ...], owner: str, **kw: object) -> MetricSpec:
    return MetricSpec(name, kind, help, labels, owner, **kw)  # type: ignore[arg-type]


CATALOGUE: dict[str, MetricSpec] = {
    s.name: s
    for s in (
        # The brief's SRE metrics (S1 §10, S2 §8).
        _spec("hetsched_hbm_utilization_ratio", "gauge", "Reserved / usable HBM per SKU.", ("sku",), LEDGER),
        _spec(
            "hetsched_accelerator_hbm_utilization_ratio",
            "gauge",
            "Reserved / usable HBM per accelerator.",
            ("accelerator", "node", "sku"),
            LEDGER,
        ),
        _spec(
            "hetsched_hbm_free_bytes", "gauge", "Usable HBM not reserved, per accelerator.", ("accelerator",), LEDGER
        ),
        _spec(
            "hetsched_tp_groups",
            "gauge",
            "Live TP groups (replicas on more than one GPU) by degree and NVLink: true (one NVLink domain), "
            "cross_domain (the ladder's budgeted cross-domain step), false (its NVLink gone in the current profile).",
            ("degree", "nvlinked"),
            LEDGER,
        ),
        _spec(
            "hetsched_nvlink_cross_island_bytes_per_second",
            "gauge",
            "TP traffic of live allocations that crosses NVLink domains (islands), bytes/s.",
            (),
            LEDGER,
        ),
        _spec(
            "hetsched_cross_domain_budget_bytes_per_second",
            "gauge",
            "Cross-domain TP traffic one cluster's replicas may send in all (HETSCHED_LEDGER_CROSS_DOMAIN_BUDGET_"
            "BYTES_PER_S; 0: not enforced).",
            (),
            LEDGER,
        ),
        _spec("hetsched_ledger_commits_total", "counter", "Allocations committed by the ledger.", (), LEDGER),
        _spec(
            "hetsched_hbm_drift_bytes",
            "gauge",
            "Observed HBM use minus the ledger's reserved bytes, per accelerator (telemetry).",
            ("accelerator",),
            LEDGER,
        ),
        _spec(
            "hetsched_pcie_utilization_ratio",
            "gauge",
            "A node's PCIe utilisation (busiest GPU's link, one direction), from GPU telemetry.",
            ("node",),
            PLACEMENT,
        ),
        _spec(
            "hetsched_tpu_fragmentation_ratio",
            "gauge",
            "1 - largest free legal block / free chips, per TPU pod.",
            ("pod",),
            PLACEMENT,
        ),
        _spec(
            "hetsched_placement_decision_seconds",
            "histogram",
            "Time of one pure placement decision.",
            (),
            PLACEMENT,
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
        ),
        _spec(
            "hetsched_placement_rejections_total",
            "counter",
            "Placements refused, by error code.",
            ("reason",),
            PLACEMENT,
        ),
        _spec("hetsched_placements_total", "counter", "Replicas placed.", (), PLACEMENT),
        _spec(
            "hetsched_engine_kv_usage_ratio",
            "gauge",
            "Share of a replica's KV cache its engine reports in use (engine_status, while fresh).",
            ("replica", "model"),
            PLACEMENT,
        ),
        _spec(
            "hetsched_engine_preemptions_total",
            "counter",
            "Requests engines reported preempted for want of KV cache (SGLang: retracted), per model.",
            ("model",),
            PLACEMENT,
        ),
        _spec(
            "hetsched_replicas",
            "gauge",
            "Replicas whose agents report their engines lately, by the lifecycle state the ranks fold into.",
            ("state",),
            PLACEMENT,
        ),
        _spec(
            "hetsched_replicas_loading_overdue",
            "gauge",
            "Replicas loading for longer than their expected load time (HETSCHED_PLACEMENT_LOAD_EXPECTED_S).",
            (),
            PLACEMENT,
        ),
        _spec(
            "hetsched_admit_queue_depth",
            "gauge",
            "Requests waiting in admission's fair queue, per tenant.",
            ("tenant",),
            PLACEMENT,
        ),
        _spec(
            "hetsched_reservation_fill_rate",
            "gauge",
            "(owner use + lent use) / reserved, per tenant and cluster.",
            ("tenant", "cluster"),
            RESERVATION,
        ),
        _spec(
            "hetsched_reservation_fill_rate_overall",
            "gauge",
            "(owner use + lent use) / reserved over every reservation.",
            (),
            RESERVATION,
        ),
        _spec(
            "hetsched_reservation_idle_cost_usd_per_hour",
            "gauge",
            "What idle reserved accelerators cost per hour, per tenant.",
            ("tenant",),
            RESERVATION,
        ),
        _spec(
            "hetsched_route_rtt_seconds",
            "histogram",
            "RTT from the request's origin to the region it was routed to.",
            (),
            ROUTER,
            buckets=(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5),
        ),
        _spec("hetsched_route_switches_total", "counter", "Tenants or sessions moved to another region.", (), ROUTER),
        _spec(
            "hetsched_topology_drift_total",
            "counter",
            "Node profiles that changed (a re-profile with another fingerprint: e.g. an NVLink down).",
            (),
            TOPOLOGY,
        ),
        _spec(
            "hetsched_topology_last_profile_timestamp_seconds",
            "gauge",
            "When the topology map was last refreshed by a node's profile (unix time).",
            (),
            TOPOLOGY,
        ),
        _spec(
            "hetsched_nodes",
            "gauge",
            "Agent-reported nodes by liveness state (up, lost: silent past its missed heartbeats).",
            ("state",),
            TOPOLOGY,
        ),
        _spec(
            "hetsched_node_last_profile_timestamp_seconds",
            "gauge",
            "When each agent-reported node last sent a profile that parsed (accepted or unchanged; unix time).",
            ("node",),
            TOPOLOGY,
        ),
        _spec(
            "hetsched_node_profile_failures_total",
            "counter",
            "Re-profiles an agent could not parse (node_profile_failed; the previous profile stays), per node.",
            ("node",),
            TOPOLOGY,
        ),
        _spec(
            "hetsched_migrations_total",
            "counter",
            "Replica copies the rebalancer placed, by plan kind.",
            ("kind",),
            REBALANCER,
        ),
        _spec(
            "hetsched_rebalance_detectors_firing",
            "gauge",
            "Targets a rebalancer detector fires on, per detector.",
            ("detector",),
            REBALANCER,
        ),
        # The kit's, in every service: events it gave up on (shared/infra/deadletter.py, outbox.py).
        _spec(
            "hetsched_events_dead_lettered_total",
            "counter",
            "Events this process's consumers gave up on and parked in the DEADLETTER stream, per durable consumer.",
            ("consumer",),
            EVERY_SERVICE,
        ),
        _spec(
            "hetsched_outbox_quarantined_total",
            "counter",
            "Outbox events this process could never publish and quarantined (kept in its outbox table).",
            (),
            EVERY_SERVICE,
        ),
        # Request-level SLOs, as the gateway sees them (docs/GATEWAY.md).
        _spec(
            "hetsched_gateway_ttft_seconds",
            "histogram",
            "Time to first token of requests through the gateway (model, engine kind, SKU, region of the replica).",
            GATEWAY_LABELS,
            GATEWAY,
            buckets=TTFT_BUCKETS,
        ),
        _spec(
            "hetsched_gateway_tpot_seconds",
            "histogram",
            "Time per output token after the first, of requests through the gateway.",
            GATEWAY_LABELS,
            GATEWAY,
            buckets=TPOT_BUCKETS,
        ),
        _spec(
            "hetsched_gateway_e2e_seconds",
            "histogram",
            "End-to-end latency of requests through the gateway, arrival to last byte.",
            GATEWAY_LABELS,
            GATEWAY,
            buckets=E2E_BUCKETS,
        ),
        _spec(
            "hetsched_gateway_requests_total",
            "counter",
            "Requests by outcome (admitted, queued, rejected, failed_over, failed) and reason.",
            ("model", "outcome", "reason"),
            GATEWAY,
        ),
        _spec(
            "hetsched_gateway_slo_ttft_seconds",
            "gauge",
            "The TTFT target of each model (the SLO alert compares the p99 with it).",
            ("model",),
            GATEWAY,
        ),
        _spec(
            "hetsched_gateway_in_flight_requests",
            "gauge",
            "Requests the gateway is serving now.",
            (),
            GATEWAY,
        ),
        _spec(
            "hetsched_gateway_added_seconds",
            "histogram",
            "The gateway's own time in a request before its first upstream byte: auth, routing, admission.",
            (),
            GATEWAY,
            buckets=ADDED_BUCKETS,
        ),
    )
}


Labels = tuple[str, ...]


class GaugeSeries:
    """A labelled gauge set to a whole new set of values at once: label sets no longer present go (a
    released accelerator's or an emptied queue's series does not linger)."""

    def __init__(self, gauge: Gauge) -> None:
        self.gauge = gauge
        self._shown: set[Labels] = set()

    def show(self, values: Mapping[Labels, float]) -> None:
        for labels, value in values.items():
            self.gauge.labels(*labels).set(value)
        for gone in self._shown - values.keys():
            self.gauge.remove(*gone)
        self._shown = set(values)


class ServiceMetrics:
    """One service's registry (its catalogue metrics plus the process basics) and its HTTP endpoint."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self._made: dict[str, Counter | Gauge | Histogram] = {}
        self._endpoint: _Endpoint | None = None
        self.url: str | None = None
        self._kit: _KitCollector | None = None

    def _make(self, name: str) -> Counter | Gauge | Histogram:
        made = self._made.get(name)
        if made is not None:
            return made
        spec = CATALOGUE[name]
        metric: Counter | Gauge | Histogram
        if spec.kind == "counter":
            metric = Counter(name.removesuffix("_total"), spec.help, spec.labels, registry=self.registry)
        elif spec.kind == "gauge":
            metric = Gauge(name, spec.help, spec.labels, registry=self.registry)
        else:
            metric = Histogram(
                name,
                spec.help,
                spec.labels,
                registry=self.registry,
                buckets=spec.buckets or Histogram.DEFAULT_BUCKETS,
            )
        self._made[name] = metric
        return metric

    def counter(self, name: str) -> Counter:
        metric = self._make(name)
        assert isinstance(metric, Counter), name
        return metric

    def gauge(self, name: str) -> Gauge:
        metric = self._make(name)
        assert isinstance(metric, Gauge), name
        return metric

    def histogram(self, name: str) -> Histogram:
        metric = self._make(name)
        assert isinstance(metric, Histogram), name
        return metric

    def export_kit(self, dead_lettered: Callable[[], Mapping[str, int]], quarantined: Callable[[], int]) -> None:
        """Export the kit's counters (owner ``EVERY_SERVICE``), read at each scrape: events dead-lettered per
        durable consumer, outbox events quarantined. Once per registry."""
        if self._kit is not None:
            return
        self._kit = _KitCollector(dead_lettered, quarantined)
        self.registry.register(self._kit)

    def serve(self, host: str, port: int, *, max_connections: int = 16, read_timeout_s: float = 5.0) -> str:
        """Serve ``/metrics`` on ``host:port`` (0: a free port) from a daemon thread; the URL. At most
        ``max_connections`` at once; one that has not sent its request within ``read_timeout_s`` is closed.
        ``OSError`` when the address cannot be bound."""
        if self.url is not None:
            return self.url
        limits = Limits(max_connections=max_connections, read_timeout_s=read_timeout_s)
        self._endpoint = _Endpoint(HttpServer(self._answer, limits), host, port)
        self.url = f"http://{host}:{self._endpoint.port}/metrics"
        return self.url

    async def _answer(self, request: Request) -> Response:
        # As prometheus-client's own server: any path, the format the scraper asks for, gzip if accepted.
        if request.method not in ("GET", "HEAD"):
            return Response(405, b"GET only\n", headers=(("Allow", "GET, HEAD"),))
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        names = request.query.get("name[]")
        output = encoder(self.registry.restricted_registry(names) if names else self.registry)
        if gzip_accepted(request.headers.get("accept-encoding", "")):
            return Response(200, gzip.compress(output), content_type, headers=(("Content-Encoding", "gzip"),))
        return Response(200, output, content_type)

    def close(self) -> None:
        if self._endpoint is not None:
            self._endpoint.stop()
            self._endpoint = None
            self.url = None


class _KitCollector(Collector):
    """The kit's counters, read from the process's consumers and outbox relay when scraped (plain ints the
    event loop bumps; a scrape reads them from the metrics thread)."""

    def __init__(self, dead_lettered: Callable[[], Mapping[str, int]], quarantined: Callable[[], int]) -> None:
        self._dead_lettered = dead_lettered
        self._quarantined = quarantined

    def collect(self) -> Iterable[Metric]:
        dead = CATALOGUE["hetsched_events_dead_lettered_total"]
        family = CounterMetricFamily(dead.name.removesuffix("_total"), dead.help, labels=dead.labels)
        for consumer, count in sorted(dict(self._dead_lettered()).items()):
            family.add_metric((consumer,), count)
        yield family
        quarantined = CATALOGUE["hetsched_outbox_quarantined_total"]
        yield CounterMetricFamily(quarantined.name.removesuffix("_total"), quarantined.help, value=self._quarantined())

    def describe(self) -> Iterable[Metric]:
        return self.collect()


class _Endpoint:
    """An ``HttpServer`` on an event loop of its own, in a daemon thread."""

    def __init__(self, server: HttpServer, host: str, port: int) -> None:
        self._server = server
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._failure: BaseException | None = None
        self.port = 0
        self._thread = threading.Thread(target=self._run, args=(host, port), name="metrics-http", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._failure is not None:
            self._thread.join()
            raise self._failure

    def _run(self, host: str, port: int) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            _bound, self.port = self._loop.run_until_complete(self._server.start(host, port))
        except BaseException as exc:  # handed to the caller of serve()
            self._failure = exc
            self._started.set()
            self._loop.close()
            return
        self._started.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.run_until_complete(self._server.close())
            self._loop.close()

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
