"""Hostile input and abandoned requests against the six services on real NATS and Postgres (issue 10):
every subject answers a hostile body with a typed error, never silence (rows 1-3); a lease cannot end
in year 9999 (row 13); a request whose deadline passed is not executed (row 9); a commit that waited
on a stalled Postgres past its caller's deadline is not applied, and health says the workers are
saturated meanwhile (rows 7-8)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.errors import TimeoutError as NatsTimeoutError

from hetsched.stack import wait_healthy
from services.registry import SERVICES
from shared.contracts.ledger import CommitRequest
from shared.contracts.subjects import Rpc, Subjects
from shared.infra import deadline
from shared.infra.catalog import demo_fleet_path
from shared.infra.db import plain_url
from shared.infra.rpc import RpcClient, RpcError
from shared.infra.service import Route
from shared.infra.settings import Settings
from tests.conftest import ServiceProcesses
from tests.contract_examples import boolean_bodies, example_body
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")

GB = 10**9
SATURATED_MS = 300
ROUTES: list[tuple[str, Route]] = [(pkg, route) for pkg, d in SERVICES.items() for route in d.routes]
SUBJECTS: list[tuple[str, Rpc]] = [(pkg, d.health) for pkg, d in SERVICES.items()] + [
    (pkg, route.rpc) for pkg, route in ROUTES
]
HOSTILE = {
    "nested 100k deep": b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "5,000-digit integer": b'{"version": 1, "n": ' + b"7" * 5000 + b"}",
    "5,000-digit version": json.dumps({"version": "9" * 5000}).encode(),
    # 400 KB of DEL characters: four times longer once repr'd, so an echo of it could not be sent
    "echoed huge version": json.dumps({"version": "\x7f" * 400_000}, ensure_ascii=False).encode(),
    "600 KB body": json.dumps({"version": 1, "pad": "x" * 600_000}).encode(),
}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(service_processes: ServiceProcesses, settings: Settings) -> AsyncIterator[Client]:
    names = []
    for package in SERVICES:
        env = {"HETSCHED_REQUEST_SATURATED_MS": str(SATURATED_MS)}
        if package == "topology_discovery":
            env["HETSCHED_TOPOLOGY_INVENTORY"] = str(demo_fleet_path())
        service_processes.start(package, name=f"hostile_{package}", **env)
        names.append(f"hostile_{package}")
    health = await wait_healthy(
        nats_url=settings.kit.nats_url or "", subjects=Subjects(settings.kit.subject_prefix), deadline_s=60
    )
    assert all(h["status"] == "ok" for h in health.values()), health
    client = await nats.connect(settings.kit.nats_url or "")

    async def learnt() -> bool:
        reply = await ask(client, settings, Rpc.LEDGER_SNAPSHOT, {"node": "dgx-h100-01"})
        return len(reply.get("accelerators", [])) == 8

    await wait_for(learnt, 60, interval_s=0.2, what="the ledger learnt dgx-h100-01")
    yield client
    await client.close()
    for name in names:
        service_processes.stop(name)


async def ask(nc: Client, settings: Settings, rpc: Rpc, body: dict[str, Any] | bytes, **kw: Any) -> dict[str, Any]:
    raw = body if isinstance(body, bytes) else json.dumps(body, default=str).encode()
    msg = await nc.request(Subjects(settings.kit.subject_prefix).rpc(rpc), raw, timeout=kw.pop("timeout", 10), **kw)
    reply: dict[str, Any] = json.loads(msg.data)
    return reply


def commit(acc: str, gb: float, *, rid: str | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "request_id": rid or f"h-{uuid.uuid4().hex[:10]}",
        "tenant": "hostile",
        "shares": [{"accelerator_id": acc, "weights_bytes": int(gb * GB)}],
        **extra,
    }


async def reserved(nc: Client, settings: Settings, acc: str) -> int:
    snap = await ask(nc, settings, Rpc.LEDGER_SNAPSHOT, {"node": acc.split("/")[0]})
    return int(next(a["hbm_reserved_bytes"] for a in snap["accelerators"] if a["id"] == acc))


def with_nul(body: dict[str, Any]) -> dict[str, Any] | None:
    """``body`` with a NUL in its first string field (None when it has none)."""
    for key, value in body.items():
        if isinstance(value, str) and key != "version":
            return {**body, key: value + "\x00x"}
    return None


# -- rows 1-3 -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("package", "rpc"), SUBJECTS, ids=[rpc.value for _, rpc in SUBJECTS])
async def test_every_subject_answers_hostile_bodies_with_invalid_request(
    stack: Client, settings: Settings, service_processes: ServiceProcesses, package: str, rpc: Rpc
) -> None:
    for what, body in HOSTILE.items():
        msg = await stack.request(Subjects(settings.kit.subject_prefix).rpc(rpc), body, timeout=5)
        assert len(msg.data) < 2000, (what, len(msg.data))  # the input is never echoed whole
        reply = json.loads(msg.data)
        assert reply["status"] == "rejected" and reply["error"]["code"] == "invalid_request", (what, reply)
    assert service_processes.procs[f"hostile_{package}"].poll() is None


@pytest.mark.parametrize(("package", "route"), ROUTES, ids=[r.rpc.value for _, r in ROUTES])
async def test_a_nul_in_a_string_is_invalid_request_on_every_subject(
    stack: Client, settings: Settings, package: str, route: Route
) -> None:
    body = with_nul(example_body(route.model))
    if body is None:
        pytest.skip("no string field")
    reply = await ask(stack, settings, route.rpc, body)
    assert reply["status"] == "rejected" and reply["error"]["code"] == "invalid_request", reply
    assert "NUL" in reply["error"]["message"]


# Every integer or number field of every request, nested ones included (``version`` aside: dispatch
# refused an unreadable version before the contract ever saw it).
NUMBERS: list[tuple[Route, str, dict[str, Any]]] = [
    (route, path, body) for _, route in ROUTES for path, body in boolean_bodies(route.model) if path != "version"
]


@pytest.mark.parametrize(
    ("route", "path", "body"), NUMBERS, ids=[f"{route.rpc.value}:{path}" for route, path, _ in NUMBERS]
)
async def test_a_boolean_for_a_number_is_invalid_request_on_every_subject(
    stack: Client, settings: Settings, route: Route, path: str, body: dict[str, Any]
) -> None:
    """Issue 23 row 9: `lease_s: true`, `context_tokens: true` (and every other integer or number field of
    every request) were read as 1; now each is `invalid_request` naming the field."""
    reply = await ask(stack, settings, route.rpc, body)
    assert reply["status"] == "rejected" and reply["error"]["code"] == "invalid_request", reply
    message = reply["error"]["message"]
    assert f"field '{path}" in message and ("valid integer" in message or "valid number" in message), message


async def test_every_request_with_numbers_is_probed() -> None:
    probed = {(route.rpc, path) for route, path, _ in NUMBERS}
    assert {(Rpc.PLACEMENT_ADMIT, "lease_s"), (Rpc.PLACEMENT_PLACE, "context_tokens")} <= probed
    assert (Rpc.LEDGER_COMMIT_BATCH, "commits.0.shares.0.kv_bytes") in probed and len(probed) > 60


async def test_a_nul_in_a_commits_tenant_never_reaches_postgres(stack: Client, settings: Settings) -> None:
    body = commit("dgx-h100-01/gpu7", 1)
    body["tenant"] = "ev\u0000il"
    reply = await ask(stack, settings, Rpc.LEDGER_COMMIT, body)
    assert reply["error"]["code"] == "invalid_request", reply  # was `internal` (Postgres refused the NUL)


async def test_names_over_the_length_limit_are_refused(stack: Client, settings: Settings) -> None:
    reply = await ask(
        stack, settings, Rpc.TOPOLOGY_REPORT, {"node": "n" * 90_000, "error": {"message": "x", "provider": "p"}}
    )
    assert reply["error"]["code"] == "invalid_request" and "node" in reply["error"]["message"]
    place = {"request_id": "r", "tenant": "t", "model": "m" * 400_000, "context_tokens": 8}
    reply = await ask(stack, settings, Rpc.PLACEMENT_PLACE, place)
    assert reply["status"] == "rejected" and reply["error"]["code"] == "invalid_request"


# -- row 13: no lease ends in year 9999 ----------------------------------------------------------------


async def test_a_lease_ending_in_year_9999_is_refused_on_commit_and_renew(stack: Client, settings: Settings) -> None:
    acc = "dgx-h100-01/gpu6"
    before = await reserved(stack, settings, acc)
    far = {"lease_expires_at": "9999-12-31T00:00:00Z"}
    reply = await ask(stack, settings, Rpc.LEDGER_COMMIT, commit(acc, 1, **far))
    assert reply["status"] == "rejected" and reply["error"]["code"] == "invalid_request", reply
    assert await reserved(stack, settings, acc) == before

    ok = await ask(stack, settings, Rpc.LEDGER_COMMIT, commit(acc, 1, lease_s=60))
    assert ok["status"] == "committed", ok
    renew = {"allocation_id": ok["allocation_id"], "tenant": "hostile", **far}
    reply = await ask(stack, settings, Rpc.LEDGER_RENEW, renew)
    assert reply["status"] == "rejected" and reply["error"]["code"] == "invalid_request", reply
    naive = {**renew, "lease_expires_at": "9999-12-31T00:00:00"}  # no zone: read as UTC, still too far
    reply = await ask(stack, settings, Rpc.LEDGER_RENEW, naive)
    assert reply["status"] == "rejected" and reply["error"]["code"] == "invalid_request", reply
    reply = await ask(
        stack,
        settings,
        Rpc.PLACEMENT_RENEW,
        {"allocation_id": ok["allocation_id"], "tenant": "hostile", "lease_s": 10**9},
    )
    assert reply["status"] == "rejected" and reply["error"]["code"] == "invalid_request", reply
    await ask(stack, settings, Rpc.LEDGER_RELEASE, {"allocation_id": ok["allocation_id"], "tenant": "hostile"})


# -- row 9: a request whose caller has gone is not executed ---------------------------------------------


async def test_a_commit_whose_deadline_passed_is_not_executed(stack: Client, settings: Settings) -> None:
    acc = "dgx-h100-01/gpu5"
    before = await reserved(stack, settings, acc)
    body = commit(acc, 3)
    past = {deadline.HEADER: str(int(deadline.now_ms() - 5_000))}
    with pytest.raises(NatsTimeoutError):  # dropped unanswered: the caller is gone
        await ask(stack, settings, Rpc.LEDGER_COMMIT, body, headers=past, timeout=1)
    # The same request id with a live deadline is a first commit, not a duplicate: nothing was reserved.
    again = await ask(stack, settings, Rpc.LEDGER_COMMIT, body)
    assert again["status"] == "committed" and again["duplicate"] is False, again
    assert await reserved(stack, settings, acc) == before + 3 * GB
    await ask(stack, settings, Rpc.LEDGER_RELEASE, {"allocation_id": again["allocation_id"], "tenant": "hostile"})


# -- rows 7-8: Postgres stalls; callers give up; nothing they asked for is committed ----------------------


class Stall:
    """Holds the row lock of one accelerator from the test's own superuser connection, so the ledger's
    commit transactions on it wait (Postgres "frozen" for that row) until ``release``."""

    def __init__(self, settings: Settings, acc: str) -> None:
        self.settings = settings
        self.acc = acc

    async def __aenter__(self) -> Stall:
        self.conn = await asyncpg.connect(plain_url(self.settings.kit.database_url or ""))
        self.lock = self.conn.transaction()
        self.released = False
        await self.lock.start()
        await self.conn.execute("SELECT id FROM ledger.accelerators WHERE id = $1 FOR UPDATE", self.acc)
        return self

    async def ledger_waits(self) -> bool:
        waiting = await self.conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        return bool(waiting)

    async def release(self) -> None:
        await self.lock.rollback()
        self.released = True

    async def __aexit__(self, *exc: object) -> None:
        if not self.released:
            await self.release()
        await self.conn.close()


async def commit_until_timeout(rpc: RpcClient, body: dict[str, Any]) -> str:
    try:  # the client sends its deadline: now + its timeout
        await rpc.call(Rpc.LEDGER_COMMIT, CommitRequest.model_validate(body))
        return "answered"
    except RpcError:
        return "timed out"


async def test_commits_stalled_past_their_callers_deadline_are_not_applied(stack: Client, settings: Settings) -> None:
    acc = "dgx-h100-01/gpu4"
    before = await reserved(stack, settings, acc)
    rpc = await RpcClient.connect(settings.kit.nats_url or "", Subjects(settings.kit.subject_prefix), timeout_s=1.5)
    stalled = [commit(acc, 1) for _ in range(20)]
    async with Stall(settings, acc) as stall:
        sending = asyncio.gather(*(commit_until_timeout(rpc, b) for b in stalled))
        await wait_for(stall.ledger_waits, 10, what="the ledger's commit waits for the row lock")
        assert set(await sending) == {"timed out"}  # every caller gave up while the row was locked
        await stall.release()
        # A barrier on the same row, queued behind the stalled transactions: once it is answered, they ended.
        barrier = await ask(stack, settings, Rpc.LEDGER_COMMIT_BATCH, {"commits": [commit(acc, 2)]})
        assert barrier["results"][0]["status"] == "committed", barrier
        rids = [b["request_id"] for b in stalled]
        applied = await stall.conn.fetchval("SELECT count(*) FROM ledger.allocations WHERE request_id = ANY($1)", rids)
    await rpc.close()
    assert applied == 0  # was 400 of 400 in the issue: work done for callers who had left
    assert await reserved(stack, settings, acc) == before + 2 * GB
    allocation = barrier["results"][0]["allocation_id"]
    await ask(stack, settings, Rpc.LEDGER_RELEASE, {"allocation_id": allocation, "tenant": "hostile"})


async def test_health_says_degraded_while_a_subjects_workers_are_all_stuck(stack: Client, settings: Settings) -> None:
    acc = "dgx-h100-01/gpu3"
    rpc = await RpcClient.connect(settings.kit.nats_url or "", Subjects(settings.kit.subject_prefix), timeout_s=3)
    async with Stall(settings, acc):
        stuck = settings.kit.request_workers + 4  # every worker of the subject busy, and some waiting
        sending = asyncio.gather(*(commit_until_timeout(rpc, commit(acc, 1)) for _ in range(stuck)))

        async def degraded() -> dict[str, Any] | None:
            health = await ask(stack, settings, Rpc.LEDGER_HEALTH, {})
            return health if health["status"] == "degraded" else None

        health = await wait_for(degraded, 10, what="ledger health says its workers are saturated")
        assert health["checks"]["workers"].startswith("saturated"), health
        await sending
    await rpc.close()

    async def recovered() -> bool:
        return bool((await ask(stack, settings, Rpc.LEDGER_HEALTH, {}))["status"] == "ok")

    await wait_for(recovered, 10, what="ledger health back to ok")
