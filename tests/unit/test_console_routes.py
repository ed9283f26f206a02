"""The console's fleet routes (``/api/summary``, ``/api/nodes``, ``/api/node``) behind its access checks: without
an allowed Host or the token they answer 421 / 401 and ask nothing; with both, bad questions get a typed
400 / 404 and good ones the view's answer. The data comes from a ``FleetSource`` whose collection is the
unit tests' fleet (tests/unit/test_console_fleetview.py), not from services."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hetsched.console import access
from hetsched.console.fleetview import FleetIndex, FleetView, Holdings
from hetsched.console.server import ConsoleServer, StateSource
from hetsched.console.source import Collected, FleetSource
from shared.contracts.topology import NodeProfilePayload
from shared.infra.httpserver import Limits, Request
from tests.unit.test_console_fleetview import FLEET, LEDGER, NOW, REBALANCER, STATUSES

TOKEN = "k" * 43
PORT = 8470
HOST = f"127.0.0.1:{PORT}"


class Recorded(FleetSource):
    """The unit tests' fleet as the last collection; counts what the routes asked of it."""

    def __init__(self) -> None:
        super().__init__(rpc=None, now=lambda: NOW)  # type: ignore[arg-type]  # never asks a service
        self.asked: list[str] = []
        self.view = FleetView.of(FleetIndex.of(FLEET, version=1), LEDGER, Holdings.of(STATUSES, REBALANCER))

    async def current(self, *, max_age_s: float = 0.5) -> Collected:
        self.asked.append("current")
        return Collected(self.view, json.dumps({"fleet": self.view.summary()}).encode(), 0.0, {})

    async def profile(self, node: str, version: int) -> NodeProfilePayload | None:
        self.asked.append(f"profile {node}")
        return None


async def _nothing() -> dict[str, Any]:
    raise AssertionError("/api/state is not asked here")


def server(fleet: FleetSource) -> ConsoleServer:
    console = ConsoleServer(
        StateSource(_nothing),
        token=TOKEN,
        allowed_hosts="localhost,127.0.0.1",
        limits=Limits(max_connections=4, read_timeout_s=5),
        fleet=fleet,
    )
    # What start() sets once it listens (its port known).
    console._allowed = access.allowed_hosts("localhost,127.0.0.1", port=PORT, bound="127.0.0.1")
    console._cookie = access.cookie_name(PORT)
    return console


def get(path: str, query: dict[str, list[str]] | None = None, **headers: str) -> Request:
    return Request(method="GET", path=path, query=query or {}, headers=headers)


@pytest.mark.asyncio
@pytest.mark.parametrize("path", ["/api/summary", "/api/nodes", "/api/node"])
async def test_without_host_or_token_nothing_is_asked(path: str) -> None:
    fleet = Recorded()
    console = server(fleet)
    bearer = f"Bearer {TOKEN}"
    assert (await console._answer(get(path, host="attacker.example", authorization=bearer))).status == 421
    assert (await console._answer(get(path, host=HOST))).status == 401
    assert (await console._answer(get(path, host=HOST, authorization="Bearer wrong"))).status == 401
    assert fleet.asked == []
    cookie = f"{access.cookie_name(PORT)}={access.session_value(TOKEN)}"
    assert (await console._answer(get("/api/summary", host=HOST, cookie=cookie))).status == 200
    assert fleet.asked == ["current"]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("path", "query", "status", "error"),
    [
        ("/api/nodes", {"key": ["r1/c1"]}, 400, "by: required"),
        ("/api/nodes", {"by": ["rack"], "key": ["k1"]}, 400, "by: one of region, cluster, sku"),
        ("/api/nodes", {"by": ["cluster"], "key": ["r1/c1"], "offset": ["-1"]}, 400, "offset: a whole number"),
        ("/api/nodes", {"by": ["cluster"], "key": ["r1/c1"], "limit": ["1e9"]}, 400, "limit: a whole number"),
        ("/api/nodes", {"by": ["cluster"], "key": ["r1/c1"], "limit": ["0"]}, 400, "offset >= 0 and 1 <= limit <= 500"),
        ("/api/nodes", {"by": ["cluster"], "key": ["nope"]}, 404, "no cluster 'nope' in the fleet"),
        ("/api/node", {}, 400, "name: required"),
        ("/api/node", {"name": ["nope"]}, 404, "no node 'nope' in the fleet"),
    ],
)
async def test_bad_questions_get_a_typed_refusal(
    path: str, query: dict[str, list[str]], status: int, error: str
) -> None:
    fleet = Recorded()
    answer = await server(fleet)._answer(get(path, query, host=HOST, authorization=f"Bearer {TOKEN}"))
    assert (answer.status, answer.content_type) == (status, "application/json")
    assert json.loads(answer.body) == {"error": error}
    assert not any(a.startswith("profile") for a in fleet.asked)


@pytest.mark.asyncio
async def test_a_group_page_and_a_node() -> None:
    fleet = Recorded()
    console = server(fleet)
    bearer = f"Bearer {TOKEN}"
    query = {"by": ["cluster"], "key": ["r1/c1"], "limit": ["1"]}
    page = json.loads((await console._answer(get("/api/nodes", query, host=HOST, authorization=bearer))).body)
    assert (page["total"], [n["name"] for n in page["nodes"]]) == (2, ["a1"])
    node = json.loads((await console._answer(get("/api/node", {"name": ["a1"]}, host=HOST, authorization=bearer))).body)
    assert [g["state"] for g in node["gpus"]] == ["placed", "lent", "reserved_hard", "reserved_soft"]
    assert node["labels"] == {}  # no placement feed: no label, the ids alone
    assert fleet.asked[-1] == "profile a1"
