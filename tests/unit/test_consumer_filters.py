"""A durable consumer's filter: the event names its ``Consumer`` handles, each a filter subject of its own where
the server takes several (NATS >= 2.10), else what it was before (one name's subject, or the context's)."""

from __future__ import annotations

from typing import Any

import pytest
from nats.aio.client import ServerVersion
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from services.registry import SERVICES
from shared.contracts.ledger import LedgerEventName
from shared.contracts.subjects import Context, Subjects
from shared.contracts.topology import TelemetryEventName
from shared.infra.consumers import EventLoop, filter_subjects, filters_of

SUBJECTS = Subjects("hetsched")


class Nats:
    """What ``EventLoop.config`` reads of a connection: the version of the server it is connected to."""

    def __init__(self, version: str) -> None:
        self.connected_server_version = ServerVersion(version)


def loop(subject: str, filters: tuple[str, ...] = ()) -> EventLoop:
    async def apply(*_args: Any, **_kwargs: Any) -> None:
        return None

    return EventLoop(subject=subject, stream="LEDGER", durable="hetsched-probe-ledger", apply=apply, filters=filters)


def test_each_name_is_its_subject_and_a_node_scoped_one_takes_any_node() -> None:
    names = [LedgerEventName.ALLOCATION_RELEASED, LedgerEventName.ALLOCATION_COMMITTED]
    assert filter_subjects(SUBJECTS, Context.LEDGER, names) == (
        "hetsched.events.ledger.allocation_committed",
        "hetsched.events.ledger.allocation_released",
    )
    gpu = filter_subjects(SUBJECTS, Context.TELEMETRY, [TelemetryEventName.GPU])
    assert gpu == ("hetsched.events.telemetry.gpu.*",)


def test_several_names_filter_per_name_on_a_server_that_takes_several() -> None:
    filters = filter_subjects(SUBJECTS, Context.LEDGER, ["allocation_committed", "allocation_expired"])
    config = loop(SUBJECTS.events_of(Context.LEDGER), filters).config(Nats("2.10.0"))  # type: ignore[arg-type]
    assert config.filter_subjects == list(filters) and config.filter_subject is None
    assert (config.name, config.durable_name) == ("hetsched-probe-ledger", "hetsched-probe-ledger")
    assert (config.ack_policy, config.deliver_policy) == (AckPolicy.EXPLICIT, DeliverPolicy.ALL)
    assert filters_of(config) == filters


def test_an_older_server_gets_the_one_subject_it_had_before() -> None:
    filters = filter_subjects(SUBJECTS, Context.LEDGER, ["allocation_committed", "allocation_expired"])
    config = loop(SUBJECTS.events_of(Context.LEDGER), filters).config(Nats("2.9.10"))  # type: ignore[arg-type]
    assert config.filter_subject == "hetsched.events.ledger.>" and not config.filter_subjects
    one = loop("hetsched.events.telemetry.gpu.*").config(Nats("2.15.1"))  # type: ignore[arg-type]
    assert one.filter_subject == "hetsched.events.telemetry.gpu.*" and not one.filter_subjects


def test_filters_compare_whatever_their_order_or_form() -> None:
    assert filters_of(ConsumerConfig(filter_subjects=["b", "a"])) == ("a", "b")
    assert filters_of(ConsumerConfig(filter_subject="a")) == ("a",)
    assert filters_of(ConsumerConfig()) == ()


@pytest.mark.parametrize("package", sorted(SERVICES))
def test_every_declared_consumer_filters_exactly_the_names_it_handles(package: str) -> None:
    for consumer in SERVICES[package].consumers:
        filters = filter_subjects(SUBJECTS, consumer.context, consumer.on)
        assert len(filters) == len(consumer.on), (package, consumer.durable)
        prefix = f"hetsched.events.{consumer.context.value}."
        assert {f.removeprefix(prefix).removesuffix(".*") for f in filters} == {str(n) for n in consumer.on}
