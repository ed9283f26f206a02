"""The fill-rate gauge (the brief's reservation_fill_rate per customer, cluster and overall) read through a
real OpenTelemetry meter provider: what `reservation.report` said is what the gauge exports."""

from __future__ import annotations

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from services.reservation_filler.handlers import fill_observations
from shared.contracts.reservation import ReservationReportReply


def test_the_gauge_exports_the_reports_fill_rates_by_scope() -> None:
    report = ReservationReportReply(
        fill_rate=0.9, by_tenant={"acme": 0.85, "initech": 1.0}, by_cluster={"us-west-1/c1": 0.9}
    )
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("test")
    points = fill_observations(report)
    meter.create_observable_gauge("hetsched.reservation.fill_rate", callbacks=[lambda _o: points])
    data = reader.get_metrics_data()
    assert data is not None
    (metric,) = [m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics]
    got = {tuple(sorted(p.attributes.items())): p.value for p in metric.data.data_points}  # type: ignore[union-attr]
    assert got == {
        (("scope", "overall"),): 0.9,
        (("scope", "tenant"), ("tenant", "acme")): 0.85,
        (("scope", "tenant"), ("tenant", "initech")): 1.0,
        (("cluster", "us-west-1/c1"), ("scope", "cluster")): 0.9,
    }


def test_nothing_reserved_exports_no_overall_point() -> None:
    assert fill_observations(ReservationReportReply()) == []
