"""`placement.replicas`: its request contract refuses bad filters as typed errors, it is a tenant-scoped
public subject (a gateway reaches only its tenants' form of it), and on a tenant's subject a body naming
another tenant, or none, never reaches the handler."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from services.placement.app import SERVICE
from shared.contracts.permissions import gateway_identity, gateway_permissions
from shared.contracts.placement import MAX_REPLICAS_PAGE, ReplicasReply, ReplicasRequest
from shared.contracts.registry import RPCS
from shared.contracts.subjects import TENANT_SCOPED, Rpc, Subjects
from shared.domain.placement.listing import Position, encode_cursor
from shared.infra.bus import dispatch

SUBJECTS = Subjects("hetsched")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"limit": 0}, "limit"),
        ({"limit": MAX_REPLICAS_PAGE + 1}, "limit"),
        ({"limit": True}, "limit"),  # a boolean is not a number
        ({"limit": "10"}, "limit"),
        ({"state": "running"}, "state"),  # not a lifecycle state
        ({"cursor": "not-ours"}, "cursor"),
        ({"cursor": ""}, "cursor"),
        ({"tenant": ""}, "tenant"),
        ({"tenant": "t" * 201}, "tenant"),
        ({"model": ""}, "model"),
        ({"node": "n" * 201}, "node"),
    ],
)
def test_bad_filters_are_refused_naming_the_field(body: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as caught:
        ReplicasRequest.model_validate(body)
    assert {e["loc"][0] for e in caught.value.errors()} == {field}


def test_a_request_with_nothing_lists_a_first_page_of_every_tenant() -> None:
    request = ReplicasRequest.model_validate({})
    assert (request.tenant, request.cursor, request.limit) == (None, None, 100)
    cursor = encode_cursor(Position("acme", "req-1"))
    assert ReplicasRequest(tenant="acme", state="ready", cursor=cursor).cursor == cursor


def test_it_is_a_public_tenant_scoped_subject_a_gateway_reaches_for_its_tenants_only() -> None:
    assert Rpc.PLACEMENT_REPLICAS in TENANT_SCOPED
    assert RPCS[Rpc.PLACEMENT_REPLICAS] == (ReplicasRequest, ReplicasReply)
    perms = gateway_permissions(gateway_identity("acme-gw"), ["acme"], SUBJECTS)
    assert "hetsched.placement.replicas.acme" in perms.publish
    assert "hetsched.placement.replicas" not in perms.publish  # the unscoped form lists every tenant's
    assert "hetsched.placement.replicas.globex" not in perms.publish
    route = next(r for r in SERVICE.routes if r.rpc is Rpc.PLACEMENT_REPLICAS)
    assert route.model is ReplicasRequest and route.scope_of is not None


def _served(body: dict[str, Any], *, scope: str | None) -> tuple[dict[str, Any], list[ReplicasRequest]]:
    """``body`` through the kit's dispatch as placement's route takes it, on the tenant subject ``scope``
    (None: the unscoped, operators' subject); the reply and what reached the handler."""
    route = next(r for r in SERVICE.routes if r.rpc is Rpc.PLACEMENT_REPLICAS)
    reached: list[ReplicasRequest] = []

    async def handler(request: ReplicasRequest) -> BaseModel:
        reached.append(request)
        return ReplicasReply(total=0)

    raw = asyncio.run(
        dispatch(json.dumps(body).encode(), ReplicasRequest, handler, scope=scope, scope_of=route.scope_of)
    )
    reply: dict[str, Any] = json.loads(raw)
    return reply, reached


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"tenant": "globex"}, "forbidden"),  # another tenant than the subject's
        ({}, "forbidden"),  # no tenant: on a tenant's subject that would be every tenant's
        ({"tenant": "acme", "limit": 0}, "invalid_request"),
        ({"tenant": "acme", "cursor": "x"}, "invalid_request"),
    ],
)
def test_on_a_tenants_subject_only_its_own_tenant_is_listed(body: dict[str, Any], code: str) -> None:
    reply, reached = _served(body, scope="acme")
    assert reply["status"] == "rejected" and reply["error"]["code"] == code, reply
    assert reached == []
    reply, reached = _served({"tenant": "acme"}, scope="acme")
    assert reply["status"] == "ok" and [r.tenant for r in reached] == ["acme"]


def test_the_operators_subject_lists_every_tenant_or_one() -> None:
    _reply, reached = _served({}, scope=None)
    _reply, reached_one = _served({"tenant": "globex"}, scope=None)
    assert [r.tenant for r in reached + reached_one] == [None, "globex"]
