"""The kit's read side on real NATS and Postgres (``shared.infra.follow``, ``UnitOfWork.after_commit``):

- a durable consumer's batch that rolls back (``together=True``, an event in the middle fails) leaves the
  memory its handlers fold unchanged: each event's change happens once, after the commit that holds it,
  although the handlers of the events before the failing one ran twice;
- a follower whose ordered consumer is deleted under it gets a new one from where it was (nats-py, two
  missed heartbeats) and its fold converges on the stream: nothing lost, nothing applied twice."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime

import nats
import pytest
import pytest_asyncio
from nats.js import JetStreamContext

from shared.contracts.envelope import EventEnvelope, new_event
from shared.contracts.permissions import EVENT_PUBLISHERS
from shared.contracts.streams import stream_name, stream_specs
from shared.contracts.subjects import Context, Rpc, Subjects
from shared.contracts.topology import NodeStateEvent, TopologyEventName
from shared.infra.bus import ensure_streams
from shared.infra.follow import EventMeta, Follow, Follower, Start
from shared.infra.service import Consumer, Runtime, ServiceDefinition, build_app
from shared.infra.settings import Settings
from shared.infra.uow import UnitOfWork
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")

SCHEMA = "routing"  # the probe service's schema: its outbox and inbox


@pytest_asyncio.fixture(loop_scope="session")
async def js(settings: Settings) -> AsyncIterator[JetStreamContext]:
    client = await nats.connect(settings.kit.nats_url or "")
    context = client.jetstream()
    await ensure_streams(
        context, stream_specs(subjects=Subjects(settings.kit.subject_prefix), stream_prefix=settings.kit.stream_prefix)
    )
    yield context
    await client.close()


def node_event(node: str, name: TopologyEventName = TopologyEventName.NODE_LOST) -> EventEnvelope:
    payload = NodeStateEvent(node=node, region="r1", accelerators=[f"{node[:20]}/gpu0"])
    return new_event(
        type=f"{Context.TOPOLOGY.value}.{name}",
        source=EVENT_PUBLISHERS[Context.TOPOLOGY],
        payload=payload.model_dump(mode="json"),
        occurred_at=datetime.now(UTC),
    )


async def publish(js: JetStreamContext, settings: Settings, event: EventEnvelope) -> int:
    subject = Subjects(settings.kit.subject_prefix).event(Context.TOPOLOGY, event.type.rsplit(".", 1)[-1])
    ack = await js.publish(subject, event.model_dump_json().encode(), headers={"Nats-Msg-Id": str(event.event_id)})
    return int(ack.seq)


# -- a consumer's transaction that rolls back changes no memory -------------------------------------------


@dataclass
class Lost:
    """A handler that folds the nodes it is told are lost into memory, after its transaction commits."""

    poison: set[uuid.UUID] = field(default_factory=set)
    ran: list[uuid.UUID] = field(default_factory=list)  # each time the handler ran (in some transaction)
    folded: list[str] = field(default_factory=list)  # what memory holds: changed only after a commit

    async def on_lost(self, *, uow: UnitOfWork, event: EventEnvelope, payload: NodeStateEvent) -> None:
        self.ran.append(event.event_id)
        uow.after_commit(lambda: self.folded.append(payload.node))
        if event.event_id in self.poison:
            raise ValueError("this event cannot be applied")


def lost_service(probe: Lost, *, durable: str) -> ServiceDefinition:
    def wire(_runtime: Runtime) -> Lost:
        return probe

    return ServiceDefinition(
        name="read-side-probe",
        health=Rpc.ROUTE_HEALTH,
        schema=SCHEMA,
        consumers=(
            Consumer(Context.TOPOLOGY, durable, on={TopologyEventName.NODE_LOST: lambda p: p.on_lost}, together=True),
        ),
        wire=wire,
    )


async def test_a_consumer_batch_that_rolls_back_leaves_the_fold_unchanged_and_each_event_folds_once(
    settings: Settings, js: JetStreamContext
) -> None:
    tuned = settings.updated(
        kit={"event_max_deliveries": 2, "event_redelivery_backoff_ms": 100, "event_redelivery_backoff_max_ms": 200}
    )
    tag = uuid.uuid4().hex[:6]
    events = [node_event(f"fold{n}-{tag}") for n in range(6)]
    poisoned = events[3]
    probe = Lost(poison={poisoned.event_id})
    # Streams of its own (a subject and stream prefix for this test): the consumer's first fetch holds these
    # six events and nothing another test published.
    kit = settings.kit  # under the run's prefixes, so the run's clean-up deletes these streams too
    own = tuned.updated(
        kit={"subject_prefix": f"{kit.subject_prefix}rs{tag}", "stream_prefix": f"{kit.stream_prefix}RS{tag}_"}
    )
    await ensure_streams(
        js, stream_specs(subjects=Subjects(own.kit.subject_prefix), stream_prefix=own.kit.stream_prefix)
    )
    app, _runtime = build_app(lost_service(probe, durable=f"fold-{tag}"), own)
    for event in events:  # published before the consumer starts: its first fetch takes them as one batch
        await publish(js, own, event)
    good = [f"fold{n}-{tag}" for n in (0, 1, 2, 4, 5)]
    async with app:
        await wait_for(
            lambda: sorted(probe.folded) == sorted(good) and probe.ran.count(poisoned.event_id) == 2,
            30,
            what="the batch applied around the failing event",
        )
    # The handlers of the events before the failing one ran in the batch that rolled back, then again.
    assert probe.ran.count(events[0].event_id) == 2, probe.ran
    # Memory followed only what committed: each good event once, the failing one never.
    assert sorted(probe.folded) == sorted(good)
    assert f"fold3-{tag}" not in probe.folded


# -- a follower's consumer deleted under it --------------------------------------------------------------


async def test_a_follower_whose_consumer_is_deleted_gets_a_new_one_and_its_fold_converges(
    settings: Settings, js: JetStreamContext
) -> None:
    tag = uuid.uuid4().hex[:6]
    seen: dict[str, int] = {}
    applied: list[int] = []

    def fold(payload: NodeStateEvent, meta: EventMeta) -> None:
        if payload.node.endswith(tag):
            seen[payload.node] = seen.get(payload.node, 0) + 1
            applied.append(meta.sequence)

    stream = stream_name(Context.TOPOLOGY, stream_prefix=settings.kit.stream_prefix)
    follower = Follower(
        Follow(Context.TOPOLOGY, on={TopologyEventName.NODE_LOST: lambda _ctx: fold}, start=Start.NEW),
        stream=stream,
        subject=Subjects(settings.kit.subject_prefix).events_of(Context.TOPOLOGY),
        jetstream=lambda: js,
        log=logging.getLogger("test.read_side"),
        idle_heartbeat_s=1.0,  # two missed (its consumer gone) and nats-py makes a new one
    )
    follower.bind(None)
    await follower.run()
    try:
        before = [f"before{n}-{tag}" for n in range(3)]
        for node in before:
            await publish(js, settings, node_event(node))
        await wait_for(lambda: set(before) <= set(seen), 15, what="the first events folded")
        info = await follower._feed.subscription.consumer_info()  # type: ignore[union-attr]
        await js.delete_consumer(stream, info.name)  # what an operator's key (or a lost server) can do
        after = [f"after{n}-{tag}" for n in range(3)]
        last = 0
        for node in after:
            last = await publish(js, settings, node_event(node))
        await wait_for(lambda: set(after) <= set(seen), 30, what="the events after the deletion folded")
        assert all(count == 1 for count in seen.values()), seen  # nothing applied twice
        assert applied == sorted(applied)  # in stream order
        assert follower.progress.sequence >= last
        assert await follower.caught_up(timeout_s=5) is None
        replacement = await follower._feed.subscription.consumer_info()  # type: ignore[union-attr]
        assert replacement.name != info.name  # a new name: the old one may still exist elsewhere
    finally:
        await follower.close()
