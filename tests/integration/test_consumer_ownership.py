"""Issue 23 row 1 on the real bus: a service reaches only its own JetStream consumers, and a consumer deleted
under a service comes back by itself.

The probe connected with placement's own NKey and deleted topology's LEDGER durable, and with the
rebalancer's the ledger's TELEMETRY one: both succeeded, the victims stopped consuming without a log line,
health stayed ``ok`` and topology showed 0 B reserved where the ledger held 17.36 GB. Here, on the
authenticated server ``hetsched up`` would run (the ``bus`` fixture of test_security.py: topology, ledger and
placement as processes with their own keys), every such attempt is a permission violation and changes
nothing; what a service needs of its own consumers still works; and when the operator's key (an attacker
who got that far) deletes topology's durable while an allocation is committed, topology logs it, reports
``degraded``, replays, reports ``ok``, and its reserved bytes equal the ledger's again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import uuid
from typing import Any

import nats
import pytest
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StreamConfig
from nats.js.errors import NotFoundError

from services.registry import SERVICES
from shared.contracts.permissions import agent_identity, gateway_identity, service_identity
from shared.contracts.subjects import Context, Rpc
from shared.contracts.topology import GpuSample, GpuTelemetryEvent
from shared.infra.bus import follow
from shared.infra.consumers import CONSUMER_GONE_MESSAGE
from shared.infra.service import grant_of
from shared.infra.settings import Settings
from tests.integration import test_security
from tests.integration.secure_stack import Caller, SecureBus
from tests.integration.test_security import AGENT_NODE, event
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")

# The secure stack of test_security.py, one of its own for this module (module scope).
secure_bus = test_security.bus

PLACEMENT = service_identity(SERVICES["placement"].schema)
REBALANCER = service_identity(SERVICES["rebalancer"].schema)


def durable(bus: SecureBus, package: str, context: Context) -> str:
    """The server-side name of ``package``'s durable on ``context``'s stream."""
    grant = grant_of(SERVICES[package], bus.settings)
    return next(name for consumed, name in grant.consumes if consumed is context)


async def refused(caller: Caller, subject: str) -> None:
    """The server refused a publish to exactly ``subject`` (not to a longer subject it begins)."""
    quoted = f'"{subject.lower()}"'
    await wait_for(
        lambda: any("violation for publish" in e.lower() and quoted in e.lower() for e in caller.errors),
        10,
        what=f"a permissions violation for publish to {subject} (errors: {caller.errors[-3:]})",
    )


def fingerprint(info: Any) -> dict[str, Any]:
    """What an update could change about a consumer, and whether it is still the same one."""
    config = info.config
    return {
        "created": info.created,
        "max_ack_pending": config.max_ack_pending,
        "inactive_threshold": config.inactive_threshold,
        "pause_until": config.pause_until,
        "filter_subject": config.filter_subject,
        "ack_wait": config.ack_wait,
    }


def hostile_config(name: str, filter_subject: str) -> bytes:
    """An update that would silence a consumer: one event in flight, paused for decades, gone when idle."""
    config = {
        "name": name,
        "durable_name": name,
        "deliver_policy": "all",
        "ack_policy": "explicit",
        "filter_subject": filter_subject,
        "max_ack_pending": 1,
        "inactive_threshold": 1_000_000_000,
        "pause_until": "2099-01-01T00:00:00Z",
    }
    return json.dumps({"stream_name": "", "config": config}).encode()


async def test_no_service_deletes_reads_or_updates_another_services_consumer(secure_bus: SecureBus) -> None:
    """(a) Placement's and the rebalancer's keys against topology's LEDGER durable, the ledger's TELEMETRY
    durable and placement's own ordered consumers: delete, info, next, create/update in every subject form,
    list: each a permission violation; the consumers are the same ones, unchanged, afterwards."""
    bus = secure_bus
    operator = await bus.connect("operator")
    js = operator.nc.jetstream()
    victims = [
        (bus.stream(Context.LEDGER), durable(bus, "topology_discovery", Context.LEDGER), Context.LEDGER),
        (bus.stream(Context.TELEMETRY), durable(bus, "capacity_ledger", Context.TELEMETRY), Context.TELEMETRY),
    ]
    # Placement's ordered consumers (ephemeral, named at random): a service may not touch another's either.
    telemetry = [c for c in await js.consumers_info(bus.stream(Context.TELEMETRY)) if not c.config.durable_name]
    assert telemetry, "placement follows TELEMETRY with an ordered consumer"
    ephemeral = telemetry[0].name
    before = {name: fingerprint(await js.consumer_info(stream, name)) for stream, name, _ in victims}
    for who in (PLACEMENT, REBALANCER):
        caller = await bus.connect(who)
        for stream, name, context in victims:
            events = bus.subjects.events_of(context)
            attempts = [
                (f"$JS.API.CONSUMER.DELETE.{stream}.{name}", b""),
                (f"$JS.API.CONSUMER.INFO.{stream}.{name}", b""),
                (f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{name}", b'{"batch": 1}'),
                (f"$JS.API.CONSUMER.CREATE.{stream}.{name}.{events}", hostile_config(name, events)),
                (f"$JS.API.CONSUMER.CREATE.{stream}.{name}", hostile_config(name, events)),
                (f"$JS.API.CONSUMER.CREATE.{stream}", hostile_config(name, events)),  # the name in the body
                (f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{name}", hostile_config(name, events)),
                (f"$JS.API.CONSUMER.LIST.{stream}", b"{}"),
                (f"$JS.API.CONSUMER.NAMES.{stream}", b"{}"),
            ]
            for subject, body in attempts:
                await caller.publish(subject, body)
                await refused(caller, subject)
        if who == REBALANCER:
            stream = bus.stream(Context.TELEMETRY)
            for verb in ("DELETE", "INFO", "MSG.NEXT"):
                subject = f"$JS.API.CONSUMER.{verb}.{stream}.{ephemeral}"
                await caller.publish(subject)
                await refused(caller, subject)
    await asyncio.sleep(0.5)  # had any attempt reached JetStream, its effect would show by now
    after = {name: fingerprint(await js.consumer_info(stream, name)) for stream, name, _ in victims}
    assert after == before
    assert (await js.consumer_info(bus.stream(Context.TELEMETRY), ephemeral)).name == ephemeral


async def test_a_service_still_operates_its_own_consumers(secure_bus: SecureBus) -> None:
    """(a) The same keys create and read what is theirs: an ordered consumer on a stream each follows
    (named by ``follow``, in the subject form their permissions allow), and their own durables."""
    bus = secure_bus
    placement = await bus.connect(PLACEMENT)
    rebalancer = await bus.connect(REBALANCER)
    agent = await bus.connect(agent_identity(AGENT_NODE))
    got: dict[str, list[Msg]] = {PLACEMENT: [], REBALANCER: []}

    def collect(who: str) -> Any:
        async def cb(msg: Msg) -> None:
            got[who].append(msg)

        return cb

    followers = [
        await follow(
            placement.nc.jetstream(),
            bus.subjects.events_of(Context.TOPOLOGY),
            stream=bus.stream(Context.TOPOLOGY),
            cb=collect(PLACEMENT),
            deliver_policy=DeliverPolicy.ALL,
        ),
        await follow(
            rebalancer.nc.jetstream(),
            bus.subjects.events_of(Context.TELEMETRY),
            stream=bus.stream(Context.TELEMETRY),
            cb=collect(REBALANCER),
            deliver_policy=DeliverPolicy.NEW,
        ),
    ]
    try:
        await wait_for(lambda: got[PLACEMENT], 30, what="placement's ordered consumer delivers TOPOLOGY events")
        sample = GpuTelemetryEvent(node=AGENT_NODE, gpus=[GpuSample(index=0, memory_used_bytes=0)])
        body = event(Context.TELEMETRY, "gpu", sample.model_dump(mode="json"))
        await agent.nc.jetstream().publish(bus.subjects.event(Context.TELEMETRY, "gpu", node=AGENT_NODE), body)
        await wait_for(lambda: got[REBALANCER], 30, what="the rebalancer's ordered consumer delivers telemetry")
    finally:
        for follower in followers:
            await follower.unsubscribe()
    # The rebalancer's own TOPOLOGY durable (no rebalancer process runs here): created, read, acked.
    name = durable(bus, "rebalancer", Context.TOPOLOGY)
    js = rebalancer.nc.jetstream()
    subscription = await js.pull_subscribe(
        bus.subjects.events_of(Context.TOPOLOGY),
        durable=name,
        stream=bus.stream(Context.TOPOLOGY),
        config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL),
    )
    messages = await subscription.fetch(1, timeout=10)
    await messages[0].ack()
    assert (await js.consumer_info(bus.stream(Context.TOPOLOGY), name)).name == name
    await subscription.unsubscribe()
    # Placement may read its own durable's state (without taking events from the running process).
    own = durable(bus, "placement", Context.LEDGER)
    assert (await placement.nc.jetstream().consumer_info(bus.stream(Context.LEDGER), own)).name == own
    assert not rebalancer.errors and not placement.errors, (rebalancer.errors, placement.errors)


async def place(bus: SecureBus) -> str:
    gateway = await bus.connect(gateway_identity("acme-gw"))
    reply = await gateway.request(
        bus.subjects.scoped(Rpc.PLACEMENT_PLACE, "acme"),
        {"request_id": f"own-{uuid.uuid4().hex[:8]}", "tenant": "acme", "model": "llama3-8b", "context_tokens": 4096},
    )
    assert reply["status"] == "placed", reply
    return str(reply["allocation_id"])


async def reserved_views(operator: Caller, bus: SecureBus) -> tuple[dict[str, int], dict[str, int], list[str]]:
    """(ledger, topology, held): reserved bytes per accelerator as ``ledger.snapshot`` and ``fleet.get`` answer
    (the ledger's restricted to the fleet's accelerators), and the accelerators each allocation holds."""
    ledger = await operator.request(bus.subjects.rpc(Rpc.LEDGER_SNAPSHOT), {"limit": 10_000})
    fleet = await operator.request(bus.subjects.rpc(Rpc.FLEET_GET), {"limit": 10_000})
    topology = {a["id"]: a["hbm_reserved_bytes"] for node in fleet["nodes"] for a in node["accelerators"]}
    reserved = {a["id"]: a["hbm_reserved_bytes"] for a in ledger["accelerators"] if a["id"] in topology}
    held = [f"{allocation}@{a['id']}" for a in ledger["accelerators"] for allocation in a["allocations"]]
    return reserved, {i: topology[i] for i in reserved}, held


async def views_agree(operator: Caller, bus: SecureBus, allocation: str) -> bool:
    """Topology's reserved bytes are the ledger's, and ``allocation``'s accelerators hold some."""
    ledger, topology, held = await reserved_views(operator, bus)
    mine = [h.split("@", 1)[1] for h in held if h.startswith(f"{allocation}@")]
    return ledger == topology and bool(mine) and all(topology[i] > 0 for i in mine)


async def test_a_deleted_durable_is_recreated_and_the_view_catches_up(secure_bus: SecureBus) -> None:
    """(b) The operator deletes topology's LEDGER durable while topology is paused (SIGSTOP: it cannot
    notice before the allocation below is in the stream) and an allocation is committed meanwhile. Topology
    then logs the loss naming the consumer and its stream, re-creates it, reports ``degraded`` (check
    ``consumers``) while it replays, then ``ok``; its reserved bytes equal the ledger's snapshot, the
    allocation committed while its consumer was gone included."""
    bus = secure_bus
    assert bus.procs is not None
    operator = await bus.connect("operator")
    js = operator.nc.jetstream()
    first = await place(bus)
    await wait_for(lambda: views_agree(operator, bus, first), 30, what="topology's view agrees with the ledger")
    stream, name = bus.stream(Context.LEDGER), durable(bus, "topology_discovery", Context.LEDGER)
    created = (await js.consumer_info(stream, name)).created
    topology = bus.procs.procs["topology_discovery"]
    os.kill(topology.pid, signal.SIGSTOP)
    try:
        assert await js.delete_consumer(stream, name)
        second = await place(bus)  # its allocation_committed is in LEDGER while the durable is gone
        with pytest.raises(NotFoundError):
            await js.consumer_info(stream, name)
    finally:
        os.kill(topology.pid, signal.SIGCONT)
    seen: list[dict[str, Any]] = []
    watching = True

    async def watch() -> None:
        # Stops on the flag, not on a cancellation: nats-py may turn a cancelled request into a timeout,
        # which would be swallowed here. The pause keeps a request that fails at once from never yielding
        # and a flood of health requests from starving the service it watches.
        while watching:
            with contextlib.suppress(Exception):
                reply = await operator.nc.request(bus.subjects.rpc(Rpc.TOPOLOGY_HEALTH), b"{}", timeout=2)
                seen.append(json.loads(reply.data))
            await asyncio.sleep(0.05)

    def first_degraded() -> tuple[int] | None:  # a tuple: index 0 is a find too
        return next(((i,) for i, h in enumerate(seen) if h["status"] == "degraded"), None)

    watcher = asyncio.ensure_future(watch())
    try:
        (at,) = await wait_for(first_degraded, 60, what="topology's health degraded while its consumer replays")
        check = seen[at]["checks"]["consumers"]
        assert name in check and "re-created" in check, seen[at]
        await wait_for(
            lambda: any(h["status"] == "ok" for h in seen[at + 1 :]), 60, what="topology's health ok once caught up"
        )
    finally:
        watching = False
        await asyncio.wait_for(watcher, 10)
    recovered = next(h for h in seen[at + 1 :] if h["status"] == "ok")
    assert recovered["checks"]["consumers"] == "ok", recovered
    assert (await js.consumer_info(stream, name)).created != created, "a new durable under the same name"
    assert await views_agree(operator, bus, second), await reserved_views(operator, bus)
    assert await views_agree(operator, bus, first)
    log = bus.procs.log("topology_discovery")
    lines = [json.loads(line) for line in log.splitlines() if CONSUMER_GONE_MESSAGE in line]
    assert any(line.get("durable") == name and line.get("stream") == stream for line in lines), lines


# -- ordered consumers (``shared.infra.bus.follow``) on the machine's NATS --------------------------------


async def _followed_stream(settings: Settings) -> tuple[Any, str, str]:
    nc = await nats.connect(settings.kit.nats_url or "")
    js = nc.jetstream()
    stream = f"{settings.kit.stream_prefix}FOLLOW_{uuid.uuid4().hex[:8].upper()}"
    subject = f"{settings.kit.subject_prefix}.follow{uuid.uuid4().hex[:8]}"
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{subject}.>"]))
    return nc, stream, subject


async def test_an_ordered_consumer_deleted_under_a_follower_is_recreated_and_logged(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    nc, stream, subject = await _followed_stream(settings)
    js = nc.jetstream()
    got: list[bytes] = []

    async def cb(msg: Msg) -> None:
        got.append(msg.data)

    try:
        follower = await follow(
            js, f"{subject}.>", stream=stream, cb=cb, deliver_policy=DeliverPolicy.ALL, idle_heartbeat_s=0.5
        )
        await js.publish(f"{subject}.a", b"1")
        await wait_for(lambda: got == [b"1"], 10, what="the first event")
        name = follower._consumer
        with caplog.at_level(logging.WARNING, logger="hetsched.bus"):
            assert await js.delete_consumer(stream, name)
            await js.publish(f"{subject}.a", b"2")
            await wait_for(lambda: got == [b"1", b"2"], 30, what="the event after the deletion, once")
        assert any(
            "ordered consumer re-created" in r.getMessage() and getattr(r, "stream", None) == stream
            for r in caplog.records
        )
        await follower.unsubscribe()
    finally:
        await js.delete_stream(stream)
        await nc.close()


async def test_a_gap_reset_re_creates_an_ordered_consumer_under_a_new_name(settings: Settings) -> None:
    """nats-py resets an ordered consumer on a sequence gap while the old consumer still exists: under the
    old name that would be an update the server refuses (and the follower would stay silent)."""
    nc, stream, subject = await _followed_stream(settings)
    js = nc.jetstream()
    got: list[bytes] = []

    async def cb(msg: Msg) -> None:
        got.append(msg.data)

    try:
        follower = await follow(js, f"{subject}.>", stream=stream, cb=cb, deliver_policy=DeliverPolicy.ALL)
        await js.publish(f"{subject}.a", b"1")
        await wait_for(lambda: got == [b"1"], 10, what="the first event")
        old = follower._consumer
        state: Any = follower._sub._jsi
        await state.reset_ordered_consumer(2)  # what nats-py does on a detected gap
        await js.consumer_info(stream, old)  # the old consumer is still there: a new name is needed
        await js.publish(f"{subject}.a", b"2")
        await wait_for(lambda: got == [b"1", b"2"], 30, what="the event after the reset")
        assert follower._consumer != old
        await follower.unsubscribe()
    finally:
        await js.delete_stream(stream)
        await nc.close()
