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
from tests.contract_examples import example_body


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
        "DEADLETTER",
    }
    assert all(s.duplicate_window_s > 0 and s.file_storage for s in specs.values())
    assert specs["TELEMETRY"].max_age_s == 600 and specs["LEDGER"].max_age_s is None
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
