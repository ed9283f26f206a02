"""Issue 23 row 1 as data: each service reaches only its own JetStream consumers (shared/contracts/permissions.py
``consumer_grants``), judged the way nats-server judges a publish (deny wins over allow; ``*`` is one whole
token, ``>`` the rest); and the health check of consumers being replayed after a re-creation.
tests/integration/test_consumer_ownership.py tries the same on the real server."""

from __future__ import annotations

import pytest

from hetsched.stack import service_permission_map
from services.registry import SERVICES
from shared.contracts.permissions import Permissions, ServiceGrant, service_identity, service_permissions
from shared.contracts.streams import stream_name
from shared.contracts.subjects import Context, Subjects
from shared.infra.consumers import EventLoop as _EventLoop
from shared.infra.consumers import consumers_check
from shared.infra.service import durable_name, grant_of
from shared.infra.settings import Settings

SETTINGS = Settings(kit={"subject_prefix": "hetsched", "stream_prefix": ""})
SUBJECTS = Subjects("hetsched")
PERMS = service_permission_map(SETTINGS)
GRANTS = {definition.name: grant_of(definition, SETTINGS) for definition in SERVICES.values()}
# Every durable of every service: (service, stream, durable name).
DURABLES = [(name, stream_name(context), durable) for name, g in GRANTS.items() for context, durable in g.consumes]
OPS = ("INFO", "DELETE", "MSG.NEXT", "DURABLE.CREATE")


def matches(pattern: str, subject: str) -> bool:
    """A NATS subject pattern against a subject, token by token."""
    want, got = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(got) > i
        if i >= len(got) or (token != "*" and token != got[i]):
            return False
    return len(want) == len(got)


def may_publish(perms: Permissions, subject: str) -> bool:
    if any(matches(p, subject) for p in perms.deny_publish):
        return False
    return any(matches(p, subject) for p in perms.publish)


def test_the_matcher_follows_nats_tokens() -> None:
    assert matches(
        "$JS.API.CONSUMER.CREATE.LEDGER.*.hetsched.events.ledger.>",
        "$JS.API.CONSUMER.CREATE.LEDGER.x.hetsched.events.ledger.>",
    )
    assert not matches("$JS.API.CONSUMER.CREATE.LEDGER.*.hetsched.events.ledger.>", "$JS.API.CONSUMER.CREATE.LEDGER")
    assert not matches("a.b*", "a.bc") and matches("a.>", "a.b.c") and not matches("a.>", "a")


def create_forms(stream: str, name: str, context: Context) -> list[str]:
    """Every subject that creates or updates consumer ``name`` (nats-py's and the legacy ones)."""
    return [
        f"$JS.API.CONSUMER.CREATE.{stream}.{name}",
        f"$JS.API.CONSUMER.CREATE.{stream}.{name}.{SUBJECTS.events_of(context)}",
        f"$JS.API.CONSUMER.CREATE.{stream}.{name}.{SUBJECTS.events_of(context).removesuffix('.>')}.x",
        f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{name}",
    ]


@pytest.mark.parametrize("attacker", sorted(PERMS))
def test_no_service_reaches_another_services_durable(attacker: str) -> None:
    """The probe's row 1: placement deleting topology's LEDGER durable, the rebalancer the ledger's TELEMETRY
    one. Now every service, for every other service's durable: no info, delete, next, ack, create or update."""
    perms = PERMS[attacker]
    victims = [(owner, stream, durable) for owner, stream, durable in DURABLES if owner != attacker]
    assert victims
    for _owner, stream, durable in victims:
        context = next(c for c in Context if stream_name(c) == stream)
        subjects = [f"$JS.API.CONSUMER.{op}.{stream}.{durable}" for op in OPS]
        subjects += [f"$JS.ACK.{stream}.{durable}.1.1.1.1.1", *create_forms(stream, durable, context)]
        allowed = [s for s in subjects if may_publish(perms, s)]
        assert allowed == [], (attacker, durable)


@pytest.mark.parametrize("service", sorted(PERMS))
def test_a_service_operates_its_own_durables_and_deletes_none(service: str) -> None:
    perms, grant = PERMS[service], GRANTS[service]
    for context, durable in grant.consumes:
        stream = stream_name(context)
        for subject in (
            f"$JS.API.CONSUMER.INFO.{stream}.{durable}",
            f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}",
            f"$JS.API.CONSUMER.CREATE.{stream}.{durable}.{SUBJECTS.events_of(context)}",
            # one filter subject per event name it handles (no filter in the subject) or one name's
            f"$JS.API.CONSUMER.CREATE.{stream}.{durable}",
            f"$JS.API.CONSUMER.CREATE.{stream}.{durable}.{SUBJECTS.event(context, 'some_event')}",
            f"$JS.ACK.{stream}.{durable}.1.5.5.1700000000.0",
        ):
            assert may_publish(perms, subject), (service, subject)
        assert not may_publish(perms, f"$JS.API.CONSUMER.DELETE.{stream}.{durable}")
    for context in Context:
        stream = stream_name(context)
        # Not the legacy ephemeral form (the consumer's name is in the body), no listing, no deleting.
        for verb in ("CREATE", "LIST", "NAMES"):
            assert not may_publish(perms, f"$JS.API.CONSUMER.{verb}.{stream}"), (service, verb, stream)
        assert not any(matches(p, f"$JS.API.CONSUMER.DELETE.{stream}.x") for p in perms.publish), service


@pytest.mark.parametrize("service", ["placement", "rebalancer"])
def test_ordered_consumers_are_created_only_by_name_with_the_filter_the_service_follows(service: str) -> None:
    perms, grant = PERMS[service], GRANTS[service]
    assert grant.reads
    for context in Context:
        stream = stream_name(context)
        ordered = f"$JS.API.CONSUMER.CREATE.{stream}.Xk3vQ9aZ.{SUBJECTS.events_of(context)}"
        assert may_publish(perms, ordered) == (context in grant.reads), (service, context)
        # Another service's ephemeral consumer cannot be read or deleted, whatever its name.
        for op in ("INFO", "DELETE", "MSG.NEXT"):
            assert not may_publish(perms, f"$JS.API.CONSUMER.{op}.{stream}.Xk3vQ9aZ"), (service, op)


def test_the_deny_list_comes_from_the_other_services_grants() -> None:
    """Without ``others`` nothing is denied: the wildcard name would reach them, so the caller must say."""
    placement = GRANTS["placement"]
    topology_durable = durable_name(SETTINGS, "topology", "ledger")
    alone = service_permissions(placement, SUBJECTS, others=())
    victim = f"$JS.API.CONSUMER.CREATE.LEDGER.{topology_durable}.{SUBJECTS.events_of(Context.LEDGER)}"
    assert may_publish(alone, victim)
    assert not may_publish(service_permissions(placement, SUBJECTS, others=GRANTS.values()), victim)
    # Its own durable on a stream it also follows stays its own.
    own = next(d for c, d in placement.consumes if c is Context.LEDGER)
    mine = service_permissions(placement, SUBJECTS, others=[*GRANTS.values(), placement])
    assert may_publish(mine, f"$JS.API.CONSUMER.CREATE.LEDGER.{own}.{SUBJECTS.events_of(Context.LEDGER)}")
    other = ServiceGrant(name="x", identity=service_identity("x"), serves=(), consumes=((Context.LEDGER, own),))
    assert may_publish(service_permissions(placement, SUBJECTS, others=[other]), f"$JS.API.CONSUMER.INFO.LEDGER.{own}")


def loop(durable: str, *, recovering: bool = False, pending: int | None = None) -> _EventLoop:
    async def apply(*_args: object, **_kwargs: object) -> None:
        return None

    event_loop = _EventLoop(subject="s", stream="LEDGER", durable=durable, apply=apply)
    event_loop.recovering, event_loop.pending = recovering, pending
    return event_loop


def test_consumers_health_names_each_durable_still_replaying() -> None:
    assert consumers_check([]) == "ok"
    assert consumers_check([loop("p-topology-ledger")]) == "ok"
    check = consumers_check(
        [loop("p-a"), loop("p-topology-ledger", recovering=True), loop("p-b", recovering=True, pending=12)]
    )
    assert (
        check
        == "recovering: p-topology-ledger on LEDGER re-created, replaying; p-b on LEDGER re-created, 12 events pending"
    )
