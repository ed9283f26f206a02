"""The request path without servers: ``dispatch`` answers hostile bodies with a typed error, the
request server honours deadlines and reports saturation, ``RpcClient`` sends deadlines that never
outlive the request it serves (issue 10, rows 1-3 and 9; API.md "Limits" and "Deadlines")."""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from shared.contracts.base import ECHO_MAX, MAX_LEASE_S, NAME_MAX, Request, echo
from shared.contracts.health import HealthRequest
from shared.contracts.ledger import CommitRequest, LedgerRenewRequest
from shared.contracts.placement import PlaceRequest
from shared.contracts.registry import RPCS
from shared.contracts.subjects import Context, Rpc, Subjects, names_scope, token, untoken
from shared.domain.ledger import MAX_LEASE_S as DOMAIN_MAX_LEASE_S
from shared.infra import deadline
from shared.infra.bus import MAX_DEPTH, _plainly_sound, _problem, dispatch
from shared.infra.requests import Endpoint, RequestServer
from shared.infra.rpc import RpcClient, RpcError


class Thing(Request):
    name: str = Field(max_length=NAME_MAX)
    count: int = 0
    tags: list[Any] = Field(default_factory=list)


class Ok(BaseModel):
    status: str = "ok"
    name: str = ""


async def answer(request: Thing) -> BaseModel:
    return Ok(name=request.name)


async def refused(raw: bytes, **limits: Any) -> dict[str, Any]:
    reply: dict[str, Any] = json.loads(await dispatch(raw, Thing, answer, **limits))
    assert reply["status"] == "rejected", reply
    return reply


# -- row 1: deep nesting and huge numbers --------------------------------------------------------


async def test_json_nested_100k_deep_is_an_invalid_request() -> None:
    body = b'{"name": "a", "tags": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    reply = await refused(body)
    assert reply["error"]["code"] == "invalid_request"
    assert "nested" in reply["error"]["message"]


async def test_nesting_is_capped_below_what_the_parser_allows() -> None:
    deep = "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1)
    reply = await refused(f'{{"name": "a", "tags": {deep}}}'.encode())
    assert reply["error"]["code"] == "invalid_request"
    shallow = "[" * 10 + "]" * 10
    ok = json.loads(await dispatch(f'{{"name": "a", "tags": {shallow}}}'.encode(), Thing, answer))
    assert ok["status"] == "ok"


async def test_a_5000_digit_integer_is_an_invalid_request() -> None:
    reply = await refused(b'{"name": "a", "count": ' + b"7" * 5000 + b"}")
    assert reply["error"]["code"] == "invalid_request"
    assert len(reply["error"]["message"]) < 400


async def test_a_5000_digit_version_string_is_an_invalid_request() -> None:
    reply = await refused(json.dumps({"name": "a", "version": "9" * 5000}).encode())
    assert reply["error"]["code"] == "invalid_request"
    assert len(reply["error"]["message"]) < 200
    assert json.loads(await dispatch(b'{"name": "a", "version": "1.2"}', Thing, answer))["status"] == "ok"


# -- row 2: errors echo input cut short; oversized bodies and replies ------------------------------


async def test_error_messages_echo_at_most_a_few_dozen_characters_of_the_input() -> None:
    # DEL characters are one byte in JSON but four in a repr: the old echo made a reply NATS could not carry
    body = json.dumps({"name": "a", "version": "\x7f" * 400_000}, ensure_ascii=False).encode()
    raw = await dispatch(body, Thing, answer)
    assert len(raw) < 1000
    assert json.loads(raw)["error"]["code"] == "invalid_request"
    assert echo("x" * 10_000).startswith("'" + "x" * ECHO_MAX + "'...")
    assert echo(10**4000).endswith("...")


async def test_a_body_over_the_size_limit_is_an_invalid_request() -> None:
    body = json.dumps({"name": "a", "tags": ["x" * 1000] * 700}).encode()
    reply = await refused(body, max_bytes=512 * 1024)
    assert reply["error"]["code"] == "invalid_request"
    assert "limit" in reply["error"]["message"]


async def test_a_huge_request_id_is_not_echoed() -> None:
    reply = await refused(json.dumps({"name": "a" * 5000, "request_id": "r" * 5000}).encode())
    assert reply["error"]["code"] == "invalid_request"
    assert reply["request_id"] is None
    assert len(json.dumps(reply)) < 2000


async def test_a_reply_too_large_to_send_becomes_a_short_typed_error() -> None:
    async def big(request: Thing) -> BaseModel:
        return Ok(name=request.name * 100_000)

    raw = await dispatch(b'{"name": "abc", "request_id": "r-1"}', Thing, big, max_reply_bytes=64 * 1024)
    reply = json.loads(raw)
    assert len(raw) < 1000
    assert reply["error"]["code"] == "internal"
    assert "too large" in reply["error"]["message"]
    assert reply["request_id"] == "r-1"


# -- row 3: NUL never reaches Postgres ------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        b'{"name": "a\\u0000b"}',
        b'{"name": "a", "tags": [{"deep": ["x\\u0000"]}]}',
        b'{"name": "a", "tags": [{"k\\u0000": 1}]}',
    ],
)
async def test_a_nul_in_any_string_is_an_invalid_request(body: bytes) -> None:
    reply = await refused(body)
    assert reply["error"]["code"] == "invalid_request"
    assert "NUL" in reply["error"]["message"]


async def test_a_raw_nul_byte_is_an_invalid_request() -> None:
    reply = await refused(b'{"name": "a\x00b"}')
    assert reply["error"]["code"] == "invalid_request"


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32", "utf-8-sig"])
async def test_a_nul_or_deep_nesting_is_found_in_every_encoding_json_reads(encoding: str) -> None:
    for text, why in (
        ('{"name": "a\\u0000b"}', "NUL"),
        ('{"name": "a", "tags": [{"k\\u0000": 1}]}', "NUL"),
        ('{"name": "a", "tags": [' + "[" * MAX_DEPTH + "1" + "]" * MAX_DEPTH + "]}", "nested"),
    ):
        reply = await refused(text.encode(encoding))
        assert reply["error"]["code"] == "invalid_request" and why in reply["error"]["message"], (encoding, text)
    ok = json.loads(await dispatch('{"name": "a\\\\u0000", "tags": ["[{"]}'.encode(encoding), Thing, answer))
    assert ok == {"status": "ok", "name": "a\\u0000"}  # an escaped backslash, then text: no NUL


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='ab\x00\\[]{}"u0'),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(alphabet="k\x00[", max_size=3), inner, max_size=3)
    ),
    max_leaves=80,
)


@settings(max_examples=500, deadline=None)
@given(
    body=st.dictionaries(st.text(alphabet="k\x00", max_size=3), json_values, max_size=4),
    ensure_ascii=st.booleans(),
    encoding=st.sampled_from(["utf-8", "utf-8-sig", "utf-16", "utf-32"]),
)
def test_a_body_passed_on_its_bytes_alone_holds_nothing_the_walk_refuses(
    body: dict[str, Any], ensure_ascii: bool, encoding: str
) -> None:
    """``dispatch`` walks a body for NULs and deep nesting only when its bytes do not already rule them
    out: whatever the body and its encoding, one passed on its bytes is one the walk finds nothing in."""
    raw = json.dumps(body, ensure_ascii=ensure_ascii).encode(encoding)
    parsed = json.loads(raw)
    if _plainly_sound(raw):
        assert _problem(parsed) is None
    if _has_nul(parsed):
        assert not _plainly_sound(raw) and _problem(parsed) is not None


def _has_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    return isinstance(value, list) and any(_has_nul(v) for v in value)


# -- length limits and leases in the contracts ----------------------------------------------------


def _string_fields(model: type[BaseModel], seen: set[type[BaseModel]]) -> list[tuple[str, Any]]:
    """Every (model.field, field info) whose type is or holds a plain ``str``, through nested models."""
    found: list[tuple[str, Any]] = []
    if model in seen:
        return found
    seen.add(model)
    for name, info in model.model_fields.items():
        text = repr(info.annotation)
        if re.search(r"\bstr\b", text) and "Literal" not in text and name != "version":  # not `Strict`
            found.append((f"{model.__name__}.{name}", info))
        for arg in _models_in(info.annotation):
            found.extend(_string_fields(arg, seen))
    return found


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in getattr(annotation, "__args__", ()) for m in _models_in(arg)]


def test_every_string_of_every_request_has_a_length_limit() -> None:
    """A request's strings reach events and tables: each is bounded (a list's items too)."""
    seen: set[type[BaseModel]] = set()
    unbounded = []
    for request, _reply in RPCS.values():
        for where, info in _string_fields(request, seen):
            limits = repr(info.metadata) + repr(info.annotation)
            if "max_length" not in limits and where != "ProfileError.message":  # cut, not refused
                unbounded.append(where)
    assert not unbounded


def test_a_name_over_the_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="at most 200"):
        PlaceRequest(request_id="r", tenant="t" * 201, model="m", context_tokens=1)


def test_the_contract_and_the_ledger_agree_on_the_longest_lease() -> None:
    assert MAX_LEASE_S == DOMAIN_MAX_LEASE_S == 30 * 86400
    with pytest.raises(ValueError):
        LedgerRenewRequest(allocation_id="a", tenant="t", lease_s=MAX_LEASE_S + 1)
    naive = CommitRequest.model_validate(
        {
            "request_id": "r",
            "tenant": "t",
            "lease_expires_at": "9999-12-31T00:00:00",
            "shares": [{"accelerator_id": "n/gpu0", "weights_bytes": 1}],
        }
    )
    assert naive.lease_expires_at is not None and naive.lease_expires_at.tzinfo is not None  # read as UTC


# -- the request server: deadlines and saturation --------------------------------------------------


@dataclass
class FakeMsg:
    data: bytes
    headers: dict[str, str] | None = None
    reply: str = "inbox"
    subject: str = "s.thing"
    answers: list[bytes] = field(default_factory=list)

    async def respond(self, data: bytes) -> None:
        self.answers.append(data)


@dataclass
class FakeNats:
    max_payload: int = 1 << 20
    sent: list[tuple[str, bytes, float, dict[str, str] | None]] = field(default_factory=list)
    reply: bytes = b'{"status": "ok", "service": "s", "version": "1", "checks": {}}'

    async def request(self, subject: str, body: bytes, timeout: float = 0.5, headers: Any = None) -> Any:
        self.sent.append((subject, body, timeout, headers))
        return FakeMsg(self.reply)


def serving(handler: Any, *, workers: int = 2, default_deadline_ms: float = 10_000) -> tuple[RequestServer, Any]:
    server = RequestServer(default_deadline_ms=default_deadline_ms)
    endpoint = Endpoint("s.thing", "q", Thing, handler, workers)
    server.add(endpoint)
    return server, server._callback(endpoint, FakeNats())


async def settle(server: RequestServer) -> None:
    while server._inflight:
        await asyncio.wait(set(server._inflight))


async def test_a_request_whose_deadline_passed_is_dropped_unanswered_and_counted() -> None:
    ran: list[str] = []

    async def handler(request: Thing) -> BaseModel:
        ran.append(request.name)
        return Ok()

    server, on_message = serving(handler)
    past = FakeMsg(b'{"name": "late"}', headers={deadline.HEADER: str(int(deadline.now_ms() - 1000))})
    await on_message(past)
    await settle(server)
    assert ran == [] and past.answers == []
    assert server.abandoned == 1


async def test_the_handler_sees_the_callers_deadline_or_the_default() -> None:
    seen: list[float | None] = []

    async def handler(request: Thing) -> BaseModel:
        seen.append(deadline.current())
        return Ok()

    server, on_message = serving(handler, default_deadline_ms=5000)
    until = deadline.now_ms() + 60_000
    await on_message(FakeMsg(b'{"name": "a"}', headers={deadline.HEADER: str(int(until))}))
    before = deadline.now_ms()
    await on_message(FakeMsg(b'{"name": "b"}'))
    await settle(server)
    assert seen[0] == int(until)
    assert seen[1] is not None and before + 4000 < seen[1] <= deadline.now_ms() + 5000
    assert deadline.current() is None  # the server's own context is untouched


async def test_saturation_is_reported_when_every_worker_stays_busy() -> None:
    release = asyncio.Event()

    async def handler(request: Thing) -> BaseModel:
        await release.wait()
        return Ok()

    clock = [100.0]
    server, on_message = serving(handler, workers=2)
    server.monotonic = lambda: clock[0]
    await on_message(FakeMsg(b'{"name": "a"}'))
    assert server.saturated(after_s=1) == {}
    await on_message(FakeMsg(b'{"name": "b"}'))
    clock[0] += 0.5
    assert server.saturated(after_s=1) == {}
    clock[0] += 1.0
    assert server.saturated(after_s=1) == {"s.thing": 1.5}
    release.set()
    await settle(server)
    assert server.saturated(after_s=1) == {}


async def test_health_says_degraded_when_a_subjects_workers_are_saturated() -> None:
    from shared.infra.health import health_handler as _health
    from shared.infra.rpc import CallStats
    from shared.infra.settings import Settings

    release = asyncio.Event()

    async def handler(request: Thing) -> BaseModel:
        await release.wait()
        return Ok()

    clock = [0.0]
    server, on_message = serving(handler, workers=1)
    server.monotonic = lambda: clock[0]

    @dataclass
    class Up:
        is_connected: bool = True

    runtime: Any = type(
        "R",
        (),
        {
            "uses_database": False,
            "nc": Up(),
            "settings": Settings(kit={"request_saturated_ms": 1000}),
            "name": "s",
            "rpc": type("Rpc", (), {"stats": CallStats()})(),
        },
    )()
    health = _health(runtime, None, server)
    assert (await health(HealthRequest())).model_dump()["checks"]["workers"] == "ok"
    await on_message(FakeMsg(b'{"name": "a"}'))
    clock[0] += 5
    reply = (await health(HealthRequest())).model_dump()
    assert reply["status"] == "degraded"
    assert reply["checks"]["workers"].startswith("saturated") and "s.thing" in reply["checks"]["workers"]
    release.set()
    await settle(server)


# -- RpcClient: the deadline travels, and an inner call never outlives the outer one --------------


async def test_rpc_client_sends_its_deadline_header() -> None:
    nc = FakeNats()
    client = RpcClient(lambda: nc, Subjects("t"), timeout_s=3)  # type: ignore[arg-type, return-value]
    before = deadline.now_ms()
    await client.call(Rpc.LEDGER_HEALTH, HealthRequest())
    (_subject, _body, timeout, headers) = nc.sent[0]
    assert timeout == 3
    assert headers is not None and before + 2999 <= float(headers[deadline.HEADER]) <= deadline.now_ms() + 3000


async def test_an_inner_call_gets_less_time_than_what_is_left_of_the_outer_request() -> None:
    nc = FakeNats()
    client = RpcClient(lambda: nc, Subjects("t"), timeout_s=10)  # type: ignore[arg-type, return-value]

    async def inner() -> None:
        deadline.set_deadline(deadline.now_ms() + 2000)  # the outer request has 2 s left
        await client.call(Rpc.LEDGER_HEALTH, HealthRequest())

    await asyncio.create_task(inner())
    (_subject, _body, timeout, headers) = nc.sent[0]
    assert 1.5 < timeout < 2.0  # shorter than the outer deadline, not the client's 10 s
    assert float(headers[deadline.HEADER]) < deadline.now_ms() + 2000


async def test_no_call_is_sent_for_a_request_whose_deadline_passed() -> None:
    nc = FakeNats()
    client = RpcClient(lambda: nc, Subjects("t"), timeout_s=10)  # type: ignore[arg-type, return-value]

    async def inner() -> None:
        deadline.set_deadline(deadline.now_ms() - 1)
        with pytest.raises(RpcError, match="deadline"):
            await client.call(Rpc.LEDGER_HEALTH, HealthRequest())

    await asyncio.create_task(inner())
    assert nc.sent == []


async def test_a_scoped_subject_serves_only_bodies_naming_its_tenant_or_node() -> None:
    """``<subject>.<token>`` is what a gateway's (or agent's) credential may publish on: a body naming
    another tenant is ``forbidden`` and reaches no handler; the base subject is not checked."""
    ran: list[str] = []

    async def handler(request: Thing) -> BaseModel:
        ran.append(request.name)
        return Ok()

    server = RequestServer()
    endpoint = Endpoint("s.thing", "q", Thing, handler, 2, scope_of=lambda request: request.name)
    server.add(endpoint)
    on_message = server._callback(endpoint, FakeNats())
    own = FakeMsg(b'{"name": "acme"}', subject="s.thing.acme")
    other = FakeMsg(b'{"name": "globex"}', subject="s.thing.acme")
    odd = FakeMsg(b'{"name": "a.b c"}', subject=f"s.thing.{token('a.b c')}")
    base = FakeMsg(b'{"name": "globex"}', subject="s.thing")
    garbled = FakeMsg(b'{"name": "acme"}', subject="s.thing.=!!")
    for msg in (own, other, odd, base, garbled):
        await on_message(msg)
    await settle(server)
    assert sorted(ran) == ["a.b c", "acme", "globex"]
    assert json.loads(other.answers[0])["error"]["code"] == "forbidden"
    assert json.loads(garbled.answers[0])["error"]["code"] == "invalid_request"
    assert "error" not in json.loads(own.answers[0]) or json.loads(own.answers[0])["error"] is None


def test_subject_tokens_round_trip_and_never_collide_with_plain_names() -> None:
    for name in ("acme", "team-1_a", "a.b", "*", ">", "with space", "ünïcode", "=x", "x" * 200):
        assert untoken(token(name)) == name
        assert all(ch not in token(name) for ch in ".*> ")
    assert token("a.b") != token("a_b") and token("=x").startswith("=")


def test_a_node_scoped_subject_names_exactly_one_node() -> None:
    """Issue 23 row 3: whole tokens compare, so `dgx-h100-0`'s subject never speaks for `dgx-h100-02`
    (nor the other way round), and an encoded name is matched in its encoded form only."""
    subjects = Subjects("p")
    subject = subjects.event(Context.TELEMETRY, "engine_status", node="dgx-h100-02")
    assert names_scope(subject, "dgx-h100-02")
    for other in ("dgx-h100-0", "dgx-h100-021", "h100-02", "02", "", "DGX-H100-02"):
        assert not names_scope(subject, other), other
    assert not names_scope(subjects.heartbeat("dgx-h100-0"), "dgx-h100-02")
    assert names_scope(subjects.heartbeat("a.b"), "a.b") and not names_scope(subjects.heartbeat("a.b"), "b")
