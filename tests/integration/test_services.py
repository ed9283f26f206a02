"""The six services as processes on real NATS and Postgres: health, typed errors, keep serving."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client

from hetsched.stack import wait_healthy
from services.registry import SERVICES
from shared.contracts.subjects import Subjects
from shared.infra import deadline
from shared.infra.service import Route
from shared.infra.settings import Settings
from tests.conftest import ServiceProcesses
from tests.contract_examples import example_body

pytestmark = pytest.mark.asyncio(loop_scope="session")

ROUTES: list[tuple[str, Route]] = [(pkg, route) for pkg, d in SERVICES.items() for route in d.routes]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def running(service_processes: ServiceProcesses, settings: Settings) -> AsyncIterator[dict[str, Any]]:
    for package in SERVICES:
        service_processes.start(package)
    health = await wait_healthy(
        nats_url=settings.kit.nats_url or "", subjects=Subjects(settings.kit.subject_prefix), deadline_s=60
    )
    yield health
    service_processes.stop_all()


@pytest_asyncio.fixture(loop_scope="session")
async def nc(settings: Settings) -> AsyncIterator[Client]:
    client = await nats.connect(settings.kit.nats_url or "")
    yield client
    await client.close()


ASK_TIMEOUT_S = 15.0
"""As a caller through ``RpcClient`` would: the deadline travels with the request, so a service that cannot
finish in time answers (a typed refusal) instead of leaving the caller to time out."""


async def ask(nc: Client, subject: str, body: bytes) -> dict[str, Any]:
    until = {deadline.HEADER: str(int(deadline.now_ms() + ASK_TIMEOUT_S * 1000))}
    msg = await nc.request(subject, body, timeout=ASK_TIMEOUT_S + 1, headers=until)
    reply: dict[str, Any] = json.loads(msg.data)
    return reply


async def test_six_services_answer_health(running: dict[str, Any]) -> None:
    assert set(running) == set(SERVICES)
    for package, reply in running.items():
        assert reply["status"] == "ok", (package, reply)
        assert reply["service"] == SERVICES[package].name
        # every service checks its database and NATS; some add their own (placement: its view's staleness)
        assert {"postgres", "nats"} <= set(reply["checks"]), (package, reply)
        assert all(value == "ok" for value in reply["checks"].values()), (package, reply)


BAD_BODIES = [
    (b"{not json", "invalid_request"),
    (b"\xff\xfe", "invalid_request"),
    (b"[1, 2]", "invalid_request"),
    (b'"a string"', "invalid_request"),
    (b'{"version": 2}', "unsupported_version"),
    (b'{"version": "3.1"}', "unsupported_version"),
    (b'{"version": "banana"}', "invalid_request"),
]


@pytest.mark.parametrize(("package", "route"), ROUTES, ids=[r.rpc.value for _, r in ROUTES])
async def test_bad_input_gets_typed_reply_and_service_keeps_serving(
    running: dict[str, Any],
    nc: Client,
    settings: Settings,
    service_processes: ServiceProcesses,
    package: str,
    route: Route,
) -> None:
    subjects = Subjects(settings.kit.subject_prefix)
    subject = subjects.rpc(route.rpc)
    for body, code in BAD_BODIES:
        reply = await ask(nc, subject, body)
        assert reply["status"] == "rejected", (body, reply)
        assert reply["error"]["code"] == code, (body, reply)

    required = [n for n, f in route.model.model_fields.items() if f.is_required()]
    if required:
        full = example_body(route.model)
        missing = {k: v for k, v in full.items() if k != required[0]}
        reply = await ask(nc, subject, json.dumps(missing).encode())
        assert reply["error"]["code"] == "invalid_request", reply
        assert required[0] in reply["error"]["message"]

    # A request built from the contract's examples: always a typed reply, never a timeout; a subject
    # whose capability is not built yet says so.
    reply = await ask(nc, subject, json.dumps(example_body(route.model)).encode())
    assert "status" in reply
    if route.factory is None:
        assert reply["status"] == "rejected" and reply["error"]["code"] == "not_implemented"
    else:
        assert (reply.get("error") or {}).get("code") not in ("not_implemented", "internal"), reply

    assert service_processes.procs[package].poll() is None, "service died on bad input"
    health = await ask(nc, subjects.rpc(SERVICES[package].health), b"{}")
    assert health["status"] == "ok"
