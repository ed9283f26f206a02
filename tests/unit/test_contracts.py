"""Contracts are code: frozen, documented, versioned; dispatch turns any input into a typed reply."""

from __future__ import annotations

import asyncio
import json
import pkgutil
from importlib import import_module
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

import shared.contracts as contracts_pkg
from shared.contracts.base import Contract, Request
from shared.contracts.health import HealthReply, HealthRequest
from shared.contracts.placement import PlaceRequest
from shared.contracts.streams import stream_specs
from shared.contracts.subjects import Context, Rpc, Subjects
from shared.infra.bus import dispatch
from tests.contract_examples import boolean_bodies, example_body


def _all_models() -> list[type[BaseModel]]:
    found: list[type[BaseModel]] = []
    for info in pkgutil.iter_modules(contracts_pkg.__path__):
        module = import_module(f"shared.contracts.{info.name}")
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, Contract) and value.__module__ == module.__name__:
                found.append(value)
    return found


MODELS = _all_models()


def test_there_are_contracts_to_check() -> None:
    assert len(MODELS) > 20


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_every_model_is_frozen_and_every_field_documented(model: type[BaseModel]) -> None:
    assert model.model_config.get("frozen") is True
    for name, field in model.model_fields.items():
        assert field.description, f"{model.__name__}.{name} has no description"


BOOLEAN_PROBES = [(model, path, body) for model in MODELS for path, body in boolean_bodies(model)]


def test_every_contract_has_its_numbers_probed() -> None:
    probed = {(model.__name__, path) for model, path, _body in BOOLEAN_PROBES}
    assert {("AdmitRequest", "lease_s"), ("PlaceRequest", "context_tokens"), ("PlaceRequest", "slo.ttft_ms")} <= probed
    assert ("CommitRequest", "shares.0.kv_bytes") in probed and ("EngineStatusEvent", "queue_depth") in probed


@pytest.mark.parametrize(
    ("model", "path", "body"), BOOLEAN_PROBES, ids=[f"{m.__name__}.{path}" for m, path, _b in BOOLEAN_PROBES]
)
def test_a_boolean_is_never_a_number(model: type[BaseModel], path: str, body: dict[str, Any]) -> None:
    """Issue 23 row 9: `true` where a contract wants an integer or a number is refused, not read as 1 —
    in every contract (requests, replies, events), nested models and list items included."""
    with pytest.raises(ValidationError) as caught:
        model.model_validate(body)
    refused = [
        e
        for e in caught.value.errors()
        if ".".join(str(p) for p in e["loc"]).startswith(path) and e["type"] in ("int_type", "float_type")
    ]
    assert refused, caught.value.errors()


@pytest.mark.parametrize(
    ("model", "body"),
    [
        (PlaceRequest, {"request_id": "r", "tenant": "t", "model": "m", "context_tokens": 8, "slo": {"ttft_ms": 500}}),
        (PlaceRequest, {"request_id": "r", "tenant": "t", "model": "m", "context_tokens": 8, "version": "1.2"}),
    ],
)
def test_whole_numbers_still_read_as_numbers(model: type[BaseModel], body: dict[str, Any]) -> None:
    """A JSON integer is a number (`ttft_ms: 500`); strings still validate where a field takes them."""
    model.model_validate(body)


@pytest.mark.parametrize("value", ["8", 8.0, True])
def test_an_integer_field_takes_only_a_json_integer(value: object) -> None:
    body = {"request_id": "r", "tenant": "t", "model": "m", "context_tokens": value}
    with pytest.raises(ValidationError, match="valid integer"):
        PlaceRequest.model_validate(body)


def test_subjects_follow_api_md() -> None:
    subjects = Subjects()
    assert subjects.rpc(Rpc.PLACEMENT_PLACE) == "hetsched.placement.place"
    assert subjects.rpc(Rpc.ROUTE_HEALTH) == "hetsched.route.health"
    assert subjects.event(Context.LEDGER, "allocation_committed") == "hetsched.events.ledger.allocation_committed"
    assert Subjects("t1").rpc(Rpc.FLEET_GET) == "t1.fleet.get"


def test_one_stream_per_context_with_dedup_and_short_telemetry() -> None:
    specs = {s.name: s for s in stream_specs(subjects=Subjects(), telemetry_max_age_s=600)}
    assert set(specs) == {
        "TOPOLOGY",
        "LEDGER",
        "PLACEMENT",
        "RESERVATION",
        "ROUTING",
        "REBALANCE",
        "TELEMETRY",
        "GATEWAY",
        "DEADLETTER",
    }
    assert all(s.duplicate_window_s > 0 and s.file_storage for s in specs.values())
    # Every stream has a max age (issue 23: none used to, but TELEMETRY's and DEADLETTER's) and a size cap.
    assert specs["TELEMETRY"].max_age_s == 600 and specs["LEDGER"].max_age_s == 7 * 86_400
    assert all(s.max_age_s and s.max_bytes for s in specs.values())
    assert specs["LEDGER"].subjects == ("hetsched.events.ledger.>",)
    assert specs["DEADLETTER"].subjects == ("hetsched.deadletter.>",) and specs["DEADLETTER"].max_age_s


def test_frozen_models_reject_mutation() -> None:
    request = PlaceRequest.model_validate(example_body(PlaceRequest))
    with pytest.raises(ValidationError):
        request.tenant = "someone-else"  # type: ignore[misc]


@pytest.mark.parametrize("tp", [3, 6, 12])
def test_tp_must_be_a_power_of_two(tp: int) -> None:
    with pytest.raises(ValidationError):
        PlaceRequest.model_validate({**example_body(PlaceRequest), "tp": tp})


async def _echo(_request: HealthRequest) -> BaseModel:
    return HealthReply(status="ok", service="t", version="0")


async def _boom(_request: HealthRequest) -> BaseModel:
    raise RuntimeError("bug")


def _run(raw: bytes, handler: Any = _echo, model: type[Request] = HealthRequest) -> dict[str, Any]:
    reply: dict[str, Any] = json.loads(asyncio.run(dispatch(raw, model, handler)))
    return reply


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b"{", "invalid_request"),
        (b"", "invalid_request"),
        (b"null", "invalid_request"),
        (b"[]", "invalid_request"),
        (b'{"version": 2}', "unsupported_version"),
        (b'{"version": "2.0"}', "unsupported_version"),
        (b'{"version": true}', "invalid_request"),
    ],
)
def test_dispatch_types_every_bad_input(raw: bytes, code: str) -> None:
    reply = _run(raw)
    assert reply["status"] == "rejected" and reply["error"]["code"] == code


def test_dispatch_accepts_minor_versions_and_reports_missing_fields() -> None:
    assert _run(b'{"version": "1.7"}')["status"] == "ok"
    body = {k: v for k, v in example_body(PlaceRequest).items() if k != "model"}
    reply = _run(json.dumps(body).encode(), model=PlaceRequest)
    assert reply["error"]["code"] == "invalid_request" and "model" in reply["error"]["message"]
    assert reply["request_id"] == body["request_id"]


def test_dispatch_turns_a_handler_bug_into_internal_without_the_stack() -> None:
    reply = _run(b"{}", handler=_boom)
    assert reply["error"]["code"] == "internal" and "bug" not in reply["error"]["message"]
