"""Issue 23 rows 4 and 7 (quotas) on the real stack, as the probe met them: an authenticated NATS from
the ``auth.conf`` `hetsched up` writes, topology, ledger, placement and the reservation filler as
processes with their own NKeys and Postgres roles, and each tenant calling through its own gateway
credential.

Row 4: acme queues 205 A100 groups (its A100 node is taken), globex queues an L40S replica behind them;
once the L40S frees, globex's is placed (each pass reads every queued row, a page of
``HETSCHED_PLACEMENT_QUEUE_PAGE`` = 20 at a time, round robin by tenant), and requests due behind the
backlog time out. Row 7: quotas of queued requests, placed GPUs and reserved GPUs (settings and a
per-tenant override) refuse ``quota_exceeded`` naming the quota, its limit and the use, and record
nothing.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from shared.contracts.permissions import gateway_identity
from shared.contracts.subjects import Rpc
from shared.infra.settings import Settings
from tests.integration.secure_stack import Caller, SecureBus, secure_stack
from tests.servers import RealServers
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")

REGION = "probe-1"
TENANTS = ("acme", "globex", "initech")
SERVICES_RUN = ("topology_discovery", "capacity_ledger", "placement", "reservation_filler")
BACKLOG = 205  # the probe's: more than the 200 rows the old pass read
RESERVED_QUOTA = 8
# initech: 8 placed GPUs and 2 queued requests; the others keep the (large) defaults.
OVERRIDES = {"initech": {"gpus_placed": 8, "queued_requests": 2}}

FLEET = f"""
regions:
  - name: {REGION}
    clusters:
      - name: c1
        racks:
          - name: r-a100
            power_kw: 24
            nodes:
              - {{name: a100-01, sku: A100-SXM-80GB, gpus: 8, topology: nvswitch-8}}
          - name: r-l40s
            power_kw: 24
            nodes:
              - {{name: l40s-01, sku: L40S-48GB, gpus: 1, topology: pcie}}
          - name: r-h100-1
            power_kw: 24
            nodes:
              - {{name: h100-01, sku: H100-SXM-80GB, gpus: 8, topology: nvswitch-8}}
          - name: r-h100-2
            power_kw: 24
            nodes:
              - {{name: h100-02, sku: H100-SXM-80GB, gpus: 8, topology: nvswitch-8}}
          - name: r-h100-3
            power_kw: 24
            nodes:
              - {{name: h100-03, sku: H100-SXM-80GB, gpus: 8, topology: nvswitch-8}}
"""


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def probe(
    servers: RealServers, settings: Settings, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[SecureBus]:
    tmp = tmp_path_factory.mktemp("probe-queue")
    inventory = tmp / "fleet.yaml"
    inventory.write_text(FLEET)
    async with secure_stack(
        servers,
        settings,
        tmp,
        tag="q",
        services=SERVICES_RUN,
        gateways={f"{tenant}-gw": [tenant] for tenant in TENANTS},
        env={
            "HETSCHED_TOPOLOGY_INVENTORY": str(inventory),
            "HETSCHED_PLACEMENT_QUEUE_PAGE": "20",  # a page smaller than the backlog: the pass pages
            "HETSCHED_PLACEMENT_QUEUE_RETRY_S": "0.5",
            "HETSCHED_QUOTA_GPUS_RESERVED_PER_TENANT": str(RESERVED_QUOTA),
            "HETSCHED_QUOTA_TENANT_OVERRIDES": json.dumps(OVERRIDES),
        },
    ) as state:
        acme = await gateway(state, "acme")

        async def sees_the_fleet() -> bool:
            replies = [await explain(acme, state, body) for body in (a100_group("probe"), h100_group("probe"))]
            return all(reply["status"] == "placed" for reply in replies)

        await wait_for(sees_the_fleet, 30, what="placement sees the probe's fleet")
        yield state


async def gateway(bus: SecureBus, tenant: str) -> Caller:
    return await bus.connect(gateway_identity(f"{tenant}-gw"))


def body(rid: str, tenant: str, **fields: Any) -> dict[str, Any]:
    return {
        "request_id": rid,
        "tenant": tenant,
        "model": "llama3-70b",
        "dtype": "fp8",
        "context_tokens": 8192,
        "concurrency": 4,
        "backend": "gpu",
        "region": REGION,
        **fields,
    }


def a100_group(rid: str, tenant: str = "acme", **fields: Any) -> dict[str, Any]:
    return body(rid, tenant, tp=8, skus=["A100-SXM-80GB"], **fields)


def h100_group(rid: str, tenant: str = "acme", **fields: Any) -> dict[str, Any]:
    return body(rid, tenant, tp=8, skus=["H100-SXM-80GB"], **fields)


def l40s_replica(rid: str, tenant: str = "globex", **fields: Any) -> dict[str, Any]:
    return body(rid, tenant, model="llama3-8b", dtype="bf16", context_tokens=4096, tp=1, skus=["L40S-48GB"], **fields)


async def place(caller: Caller, bus: SecureBus, request: dict[str, Any]) -> dict[str, Any]:
    return await caller.request(bus.subjects.scoped(Rpc.PLACEMENT_PLACE, request["tenant"]), request)


async def explain(caller: Caller, bus: SecureBus, request: dict[str, Any]) -> dict[str, Any]:
    return await caller.request(bus.subjects.scoped(Rpc.PLACEMENT_EXPLAIN, request["tenant"]), request)


async def release(caller: Caller, bus: SecureBus, tenant: str, allocation_id: str) -> None:
    reply = await caller.request(
        bus.subjects.scoped(Rpc.PLACEMENT_RELEASE, tenant), {"allocation_id": allocation_id, "tenant": tenant}
    )
    assert reply["status"] == "released", reply


async def reserved_on(bus: SecureBus, prefix: str) -> dict[str, int]:
    operator = await bus.connect("operator")
    snap = await operator.request(bus.subjects.rpc(Rpc.LEDGER_SNAPSHOT), {"limit": 10_000})
    return {a["id"]: a["hbm_reserved_bytes"] for a in snap["accelerators"] if a["node"].startswith(prefix)}


def quota_refusal(reply: dict[str, Any], quota: str) -> dict[str, Any]:
    assert reply["status"] == "rejected", reply
    error = reply["error"]
    assert error["code"] == "quota_exceeded" and quota in error["message"], error
    assert f"limit {error['details']['limit']}" in error["message"]
    assert f"in use {error['details']['used']}" in error["message"]
    details: dict[str, Any] = error["details"]
    return details


# -- row 4 ----------------------------------------------------------------------------------------------


async def test_a_backlog_of_205_does_not_keep_another_tenants_request_from_an_idle_l40s(probe: SecureBus) -> None:
    acme, globex = await gateway(probe, "acme"), await gateway(probe, "globex")
    assert (await place(acme, probe, a100_group("a-first")))["status"] == "placed"  # the A100 node is acme's
    first = await place(globex, probe, l40s_replica("g-first"))  # the one L40S is globex's
    assert first["status"] == "placed", first
    for start in range(0, BACKLOG, 25):
        replies = await asyncio.gather(
            *(place(acme, probe, a100_group(f"a-{i}")) for i in range(start, min(start + 25, BACKLOG)))
        )
        assert all(reply["status"] == "queued" for reply in replies), [r for r in replies if r["status"] != "queued"]
    waiting = await place(globex, probe, l40s_replica("g-second"))
    assert waiting["status"] == "queued" and waiting["queue_position"] > BACKLOG, waiting

    await release(globex, probe, "globex", first["allocation_id"])  # the L40S is idle now

    async def placed() -> dict[str, Any] | None:
        reply = await place(globex, probe, l40s_replica("g-second"))
        return reply if reply["status"] == "placed" else None

    second = await wait_for(placed, 30, what="globex's L40S replica placed from behind acme's backlog")
    assert [a for p in second["placements"] for a in p["accelerators"]] == ["l40s-01/gpu0"]
    again = await place(acme, probe, a100_group("a-0"))  # acme's backlog still waits, in arrival order
    assert again["status"] == "queued" and again["queue_position"] <= 25, again


async def test_requests_due_behind_the_backlog_time_out(probe: SecureBus) -> None:
    """With the L40S taken, three more wait behind acme's 205 with a 1 s timeout, and each is rejected
    `no_capacity` (queue timeout) although more than 10 pages of rows come first."""
    globex = await gateway(probe, "globex")
    if (await explain(globex, probe, l40s_replica("g-probe", fallbacks=[])))["status"] == "placed":
        assert (await place(globex, probe, l40s_replica("g-hold")))["status"] == "placed"  # taken, whatever came before
    late = [l40s_replica(f"g-late-{i}", queue_timeout_s=1) for i in range(3)]
    for request in late:
        reply = await place(globex, probe, request)
        assert reply["status"] == "queued" and reply["queue_position"] > BACKLOG, reply

    async def all_timed_out() -> list[dict[str, Any]] | None:
        replies = [await place(globex, probe, request) for request in late]
        return replies if all(r["status"] == "rejected" for r in replies) else None

    for reply in await wait_for(all_timed_out, 30, what="the due requests behind the backlog timed out"):
        assert reply["error"]["code"] == "no_capacity" and "queue timeout" in reply["error"]["message"]


# -- row 7: quotas ------------------------------------------------------------------------------------


async def test_a_tenant_past_its_queued_requests_quota_is_refused_and_nothing_is_queued(probe: SecureBus) -> None:
    """initech may have 2 requests queued (its override): the third is `quota_exceeded`, and asked again
    it is refused again (nothing was recorded for it); acme's 205 are not capped by initech's limit."""
    initech = await gateway(probe, "initech")
    for rid in ("i-q-1", "i-q-2"):
        assert (await place(initech, probe, a100_group(rid, "initech")))["status"] == "queued"
    third = a100_group("i-q-3", "initech")
    details = quota_refusal(await place(initech, probe, third), "queued_requests")
    assert details == {"quota": "queued_requests", "limit": 2, "used": 2, "asked": 1}
    assert quota_refusal(await place(initech, probe, third), "queued_requests")["used"] == 2
    kept = await place(initech, probe, a100_group("i-q-2", "initech"))
    assert kept["status"] == "queued", kept


async def test_a_placement_past_the_tenants_gpus_placed_quota_is_refused_and_reserves_nothing(
    probe: SecureBus,
) -> None:
    """initech may hold 8 placed GPUs: its second H100 group is `quota_exceeded` with the ledger
    unchanged; once its first is released, the same request id is placed."""
    initech = await gateway(probe, "initech")
    first = await place(initech, probe, h100_group("i-p-1", "initech"))
    assert first["status"] == "placed", first
    before = await reserved_on(probe, "h100-")
    second = h100_group("i-p-2", "initech")
    details = quota_refusal(await place(initech, probe, second), "gpus_placed")
    assert details == {"quota": "gpus_placed", "limit": 8, "used": 8, "asked": 8}
    assert await reserved_on(probe, "h100-") == before  # nothing reserved
    acme = await gateway(probe, "acme")
    theirs = await place(acme, probe, h100_group("a-p-1"))  # acme's own quota is the large default
    assert theirs["status"] == "placed", theirs

    await release(initech, probe, "initech", first["allocation_id"])
    placed = await place(initech, probe, second)
    assert placed["status"] == "placed", placed
    for tenant, caller, reply in (("initech", initech, placed), ("acme", acme, theirs)):
        await release(caller, probe, tenant, reply["allocation_id"])


async def test_a_reservation_past_the_tenants_gpus_reserved_quota_is_refused_and_records_nothing(
    probe: SecureBus,
) -> None:
    """The probe reserved 22 of 24 H100s from one gateway: with a quota of 8 per tenant, acme's 8 are
    created and 8 more are `quota_exceeded` (16 H100s are free); its reservations stay the one; globex has a
    quota of its own."""
    acme, globex = await gateway(probe, "acme"), await gateway(probe, "globex")

    def reservation(rid: str, tenant: str, count: int) -> dict[str, Any]:
        return {
            "request_id": rid,
            "tenant": tenant,
            "policy": "hard",
            "count": count,
            "sku": "H100-SXM-80GB",
            "region": REGION,
        }

    async def create(caller: Caller, request: dict[str, Any]) -> dict[str, Any]:
        return await caller.request(probe.subjects.scoped(Rpc.RESERVATION_CREATE, request["tenant"]), request)

    async def created() -> dict[str, Any] | None:  # the filler learns the H100s from TOPOLOGY
        reply = await create(acme, reservation("r-first", "acme", RESERVED_QUOTA))
        return reply if reply["status"] == "created" else None

    first = await wait_for(created, 30, what="acme's first H100s reserved")
    details = quota_refusal(await create(acme, reservation("r-8", "acme", 8)), "gpus_reserved")
    assert details == {"quota": "gpus_reserved", "limit": RESERVED_QUOTA, "used": RESERVED_QUOTA, "asked": 8}
    status = await acme.request(probe.subjects.scoped(Rpc.RESERVATION_STATUS, "acme"), {"tenant": "acme"})
    assert [r["reservation_id"] for r in status["reservations"]] == [first["reservation_id"]]
    repeat = await create(acme, reservation("r-first", "acme", RESERVED_QUOTA))  # its own id: its own answer
    assert repeat["status"] == "created" and repeat["duplicate"] is True

    async def theirs() -> dict[str, Any] | None:  # once the filler has heard the H100s were released
        reply = await create(globex, reservation("r-g", "globex", 8))
        return reply if reply["status"] == "created" else None

    await wait_for(theirs, 30, what="globex's 8 H100s reserved")
