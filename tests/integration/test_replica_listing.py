"""`placement.replicas`, `hetsched replicas` and `hetsched renew` against the real services.

Two parts. The listing over thousands of placed decisions in a database of its own (placement's handler on
real Postgres: every page, every filter, replicas placed and ended between pages). Then the stack as a
tenant's platform team runs it: topology (demo fleet), ledger and placement on an authenticated NATS, two
tenants placing replicas with their own gateway credentials through the CLI (`--credential`); each
tenant's `hetsched replicas` lists only its own, the operator's lists both, `hetsched renew` moves a lease
end, and a tenant can neither list nor renew another's.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from pydantic import SecretStr
from sqlalchemy.dialects.postgresql import insert
from typer.testing import CliRunner, Result

from hetsched.cli import app
from hetsched.engine_sim import EngineLoad, publish_engine_status
from services.placement.listing import ReplicaListing
from services.placement.store import DECISIONS, DecisionStore
from shared.contracts.base import Rejected
from shared.contracts.permissions import gateway_identity
from shared.contracts.placement import NodePlacement, PlaceReply, ReplicasReply, ReplicasRequest, TpuSlice
from shared.contracts.subjects import Rpc, Subjects
from shared.infra.catalog import demo_fleet_path, load_models
from shared.infra.db import make_engine, make_sessions, service_database_url
from shared.infra.identity import nats_dir
from shared.infra.migrate import upgrade
from shared.infra.settings import Settings
from shared.infra.uow import UnitOfWorkFactory
from tests.integration.secure_stack import SecureBus, secure_stack
from tests.servers import ROLE_PASSWORD, RealServers
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")

# -- the listing over thousands of replicas --------------------------------------------------------------------

TENANTS = ("acme", "globex", "initech")
MODELS = ("llama3-8b", "llama3-70b", "mixtral-8x7b")
NODES = tuple(f"dgx-{i:02d}" for i in range(8))
PLACED = 2_400  # placed replicas (every 10th on a TPU pod), besides ended and rejected decisions
ENDED = 600


def _reply(i: int, tenant: str) -> PlaceReply:
    if i % 10 == 9:
        return PlaceReply(
            status="placed",
            request_id=f"r{i:05d}",
            allocation_id=f"al-{i:05d}",
            model=MODELS[i % 3],
            backend="tpu",
            tp=4,
            tpu_slice=TpuSlice(pod="v5e-pod-1", origin=[0, 0], shape=[2, 2]),
        )
    node = NODES[i % len(NODES)]
    gpus = [(i + k) % 8 for k in range(2)]
    return PlaceReply(
        status="placed",
        request_id=f"r{i:05d}",
        allocation_id=f"al-{i:05d}",
        model=MODELS[i % 3],
        backend="gpu",
        tp=2,
        placements=[NodePlacement(node=node, accelerators=[f"{node}/gpu{g}" for g in gpus])],
    )


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def many(servers: RealServers, settings: Settings) -> AsyncIterator[tuple[ReplicaListing, UnitOfWorkFactory]]:
    """A database of its own holding ``PLACED`` placed replicas of three tenants and ``ENDED`` decisions that
    are not (released, expired, rejected), and placement's listing over it as the service wires it."""
    name = f"hetsched_replicas_{servers.run_id}"
    url = await servers.create_database(name)
    await asyncio.to_thread(upgrade, url, role_password=SecretStr(ROLE_PASSWORD))
    engine = make_engine(service_database_url(settings.updated(kit={"database_url": url}), "placement"))
    uow = UnitOfWorkFactory(
        sessions=make_sessions(engine), schema="placement", source="placement", subjects=Subjects("t")
    )
    now = datetime.now(UTC)
    rows = []
    for i in range(PLACED + ENDED):
        tenant = TENANTS[i % 3]
        placed = i < PLACED
        reply = _reply(i, tenant)
        rows.append(
            {
                "tenant": tenant,
                "request_id": reply.request_id,
                "status": "placed" if placed else ("released", "expired", "rejected")[i % 3],
                "allocation_id": reply.allocation_id if i % 3 != 2 or placed else None,
                "reply": reply.model_dump(mode="json"),
                "lease_expires_at": now + timedelta(seconds=i),
                "created_at": now,
                "updated_at": now,
            }
        )

    async def fill(u: Any) -> None:
        await u.session.execute(insert(DECISIONS), rows)

    await uow.run(fill)
    listing = ReplicaListing(
        store=DecisionStore(),
        uow=uow,
        models=load_models(None),
        knows_node=lambda node: node in NODES or node == "v5e-pod-1",
        draining=lambda: DRAINING,
        serving=lambda: SERVING,
    )
    yield listing, uow
    await engine.dispose()
    await servers.drop_database(name)


DRAINING = {"al-00003", "al-00004"}
SERVING = {"al-00004", "al-00005", "al-00006"}


async def every_page(listing: ReplicaListing, **filters: Any) -> tuple[list[dict[str, Any]], int, list[float]]:
    """Follow ``next_cursor`` from the first page: every replica listed, the total, each page's time (ms)."""
    request = ReplicasRequest(limit=500, **filters)
    listed: list[dict[str, Any]] = []
    took: list[float] = []
    while True:
        started = time.perf_counter()
        page = await listing.replicas(request)
        took.append((time.perf_counter() - started) * 1000)
        assert isinstance(page, ReplicasReply), page
        listed += [r.model_dump(mode="json") for r in page.replicas]
        if page.next_cursor is None:
            return listed, page.total, took
        request = request.model_copy(update={"cursor": page.next_cursor})


def expected(**filters: Any) -> list[str]:
    """The placed replicas ``filters`` keep, in listing order (tenant, request id): their ids."""
    out = []
    for i in range(PLACED):
        reply = _reply(i, TENANTS[i % 3])
        nodes = {p.node for p in reply.placements} | ({reply.tpu_slice.pod} if reply.tpu_slice else set())
        if filters.get("tenant") not in (None, TENANTS[i % 3]) or filters.get("model") not in (None, reply.model):
            continue
        if filters.get("node") not in (None, *nodes):
            continue
        out.append((TENANTS[i % 3], reply.request_id, reply.allocation_id))
    return [allocation for _t, _r, allocation in sorted(out)]


async def test_every_page_lists_every_placed_replica_once_in_order(
    many: tuple[ReplicaListing, UnitOfWorkFactory],
) -> None:
    listing, _uow = many
    listed, total, took = await every_page(listing)
    ids = [r["replica_id"] for r in listed]
    assert ids == expected() and total == PLACED  # 5 pages of 500; no ended or rejected decision among them
    first = next(r for r in listed if r["replica_id"] == "al-00000")
    assert first["placements"] == [
        {"node": "dgx-00", "accelerators": ["dgx-00/gpu0", "dgx-00/gpu1"], "domain": None, "gpus": [0, 1]}
    ]
    assert (first["tenant"], first["model"], first["tp"], first["pp"], first["state"]) == (
        "acme",
        "llama3-8b",
        2,
        1,
        "placed",
    )
    tpu = next(r for r in listed if r["replica_id"] == "al-00009")
    assert tpu["tpu_slice"]["pod"] == "v5e-pod-1" and tpu["placements"] == []
    states = {r["replica_id"]: r["state"] for r in listed}
    assert [states[i] for i in ("al-00003", "al-00004", "al-00005")] == ["draining", "draining", "ready"]
    print(f"\n{PLACED} replicas in {len(took)} pages of 500: " + ", ".join(f"{ms:.0f}" for ms in took) + " ms")


@pytest.mark.parametrize(
    "filters",
    [
        {"tenant": "globex"},
        {"model": "llama3-70b"},
        {"node": "dgx-03"},
        {"node": "v5e-pod-1"},
        {"tenant": "initech", "model": "mixtral-8x7b", "node": "dgx-05"},
    ],
    ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()),
)
async def test_each_filter_keeps_exactly_its_replicas(
    many: tuple[ReplicaListing, UnitOfWorkFactory], filters: dict[str, str]
) -> None:
    listing, _uow = many
    listed, total, _took = await every_page(listing, **filters)
    assert [r["replica_id"] for r in listed] == expected(**filters)
    assert total == len(listed) > 0


@pytest.mark.parametrize(
    ("state", "ids"),
    [("ready", ["al-00005", "al-00006"]), ("draining", ["al-00003", "al-00004"]), ("failed", [])],
)
async def test_the_state_filter(many: tuple[ReplicaListing, UnitOfWorkFactory], state: str, ids: list[str]) -> None:
    listing, _uow = many
    listed, total, _took = await every_page(listing, state=state)
    assert sorted(r["replica_id"] for r in listed) == ids and total == len(ids)
    placed, placed_total, _took = await every_page(listing, state="placed")
    # 2,400 - 4: al-00003 and al-00004 draining, al-00005 and al-00006 ready
    assert placed_total == PLACED - 4 and not {r["replica_id"] for r in placed} & (DRAINING | SERVING)


@pytest.mark.parametrize(
    ("filters", "code"),
    [({"model": "no-such-model"}, "unknown_model"), ({"node": "no-such-node"}, "not_found")],
)
async def test_a_filter_naming_nothing_known_is_a_typed_refusal(
    many: tuple[ReplicaListing, UnitOfWorkFactory], filters: dict[str, str], code: str
) -> None:
    listing, _uow = many
    reply = await listing.replicas(ReplicasRequest(**filters))
    assert isinstance(reply, Rejected) and reply.error.code == code


async def test_replicas_placed_and_ended_between_pages(many: tuple[ReplicaListing, UnitOfWorkFactory]) -> None:
    """Keyset paging: a replica placed behind the cursor is not listed again, one ended ahead of it is not
    listed, one placed ahead of it is; every replica that stays is listed once."""
    listing, uow = many
    first = await listing.replicas(ReplicasRequest(tenant="globex", limit=100))
    assert isinstance(first, ReplicasReply) and first.next_cursor is not None
    ahead = expected(tenant="globex")[150]
    tag = uuid.uuid4().hex[:6]

    async def churn(u: Any) -> None:
        for request_id in (f"a-{tag}", f"z-{tag}"):  # "a-" sorts before every r..., "z-" after
            await u.session.execute(
                insert(DECISIONS).values(
                    tenant="globex",
                    request_id=request_id,
                    status="placed",
                    allocation_id=f"al-{request_id}",
                    reply=PlaceReply(status="placed", request_id=request_id, model="llama3-8b").model_dump(mode="json"),
                )
            )
        await DecisionStore().mark_released(session=u.session, allocation_id=ahead)

    await uow.run(churn)
    try:
        rest: list[str] = []
        request = ReplicasRequest(tenant="globex", limit=100, cursor=first.next_cursor)
        while True:
            page = await listing.replicas(request)
            assert isinstance(page, ReplicasReply)
            rest += [r.replica_id for r in page.replicas]
            if page.next_cursor is None:
                break
            request = request.model_copy(update={"cursor": page.next_cursor})
        seen = [r.replica_id for r in first.replicas] + rest
        assert len(seen) == len(set(seen)), "none twice"
        assert set(seen) == (set(expected(tenant="globex")) - {ahead}) | {f"al-z-{tag}"}
    finally:

        async def undo(u: Any) -> None:
            await u.session.execute(DECISIONS.delete().where(DECISIONS.c.request_id.in_([f"a-{tag}", f"z-{tag}"])))
            await u.session.execute(
                DECISIONS.update().where(DECISIONS.c.allocation_id == ahead).values(status="placed")
            )

        await uow.run(undo)


# -- the stack, with tenants' gateway credentials ---------------------------------------------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def bus(
    servers: RealServers, settings: Settings, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[SecureBus]:
    async with secure_stack(
        servers,
        settings,
        tmp_path_factory.mktemp("replicas"),
        tag="r",
        services=("topology_discovery", "capacity_ledger", "placement"),
        gateways={"acme-gw": ["acme"], "globex-gw": ["globex"]},
        env={"HETSCHED_TOPOLOGY_INVENTORY": str(demo_fleet_path())},
    ) as state:
        yield state


@pytest.fixture(scope="module")
def cli_dir(bus: SecureBus, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A data dir as `hetsched up` leaves one, for the CLI: the registry of identities (who each credential
    is) and the operator's seed (the CLI's default credential)."""
    data = tmp_path_factory.mktemp("cli") / "data"
    nats_dir(data).mkdir(parents=True)
    shutil.copy(bus.directory / "identities.json", nats_dir(data) / "identities.json")
    shutil.copy(bus.seeds["operator"], nats_dir(data) / "admin.nk")
    yield data


async def hetsched(bus: SecureBus, data: Path, *args: str, credential: str | None = None) -> Result:
    """`hetsched ARGS` in-process (a thread: it runs its own event loop), on the stack's NATS, as the operator
    or as the gateway named (``acme-gw``)."""
    env: dict[str, str | None] = {
        **cli_env(bus, data, base={}),
        "HETSCHED_CLI_CREDENTIAL": str(bus.seeds[gateway_identity(credential)]) if credential else None,
    }
    return await asyncio.to_thread(CliRunner().invoke, app, list(args), env=env)


def cli_env(bus: SecureBus, data: Path, *, base: dict[str, str] | None = None) -> dict[str, str]:
    """The CLI's environment for the stack: its NATS, its subject prefix, the data dir with the registry."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETSCHED_")} if base is None else dict(base)
    env.update(
        HETSCHED_NATS_URL=bus.url,
        HETSCHED_SUBJECT_PREFIX=bus.subjects.prefix,
        HETSCHED_DATA_DIR=str(data),
        HETSCHED_REQUEST_TIMEOUT_MS="10000",
    )
    return env


def ok_json(result: Result) -> Any:
    assert result.exit_code == 0, (result.exit_code, result.stdout, result.stderr)
    return json.loads(result.stdout)


async def place(bus: SecureBus, data: Path, tenant: str, model: str) -> dict[str, Any]:
    placed = ok_json(
        await hetsched(
            bus,
            data,
            *("place", "--model", model, "--tenant", tenant, "--context-tokens", "4096", "--tp", "1"),
            *("--backend", "gpu", "--lease-s", "600", "--json"),
            credential=f"{tenant}-gw",
        )
    )
    assert placed["status"] == "placed", placed
    return dict(placed)


async def listed(bus: SecureBus, data: Path, *args: str, credential: str | None = None) -> dict[str, dict[str, Any]]:
    reply = ok_json(await hetsched(bus, data, "replicas", "--json", *args, credential=credential))
    return {r["replica_id"]: r for r in reply["replicas"]}


async def test_each_tenant_lists_its_own_replicas_and_renews_its_own(bus: SecureBus, cli_dir: Path) -> None:
    acme = [await place(bus, cli_dir, "acme", "llama3-8b") for _ in range(2)]
    globex = [await place(bus, cli_dir, "globex", "mamba2-2.7b")]
    acme_ids = {p["allocation_id"] for p in acme}
    globex_ids = {p["allocation_id"] for p in globex}

    # Each gateway lists its own tenant's replicas only (its credential's tenant, on its subject), also
    # as a user runs the command (its own process) ...
    mine = await listed(bus, cli_dir, credential="acme-gw")
    assert set(mine) == acme_ids
    shell = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable,
            "-m",
            "hetsched",
            "replicas",
            "--json",
            "--credential",
            str(bus.seeds[gateway_identity("acme-gw")]),
        ],
        env=cli_env(bus, cli_dir),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shell.returncode == 0, shell.stderr
    assert {r["replica_id"] for r in json.loads(shell.stdout)["replicas"]} == acme_ids
    assert set(await listed(bus, cli_dir, credential="globex-gw")) == globex_ids
    # ... with where each runs and until when, as placement placed it.
    first = mine[acme[0]["allocation_id"]]
    assert (first["tenant"], first["model"], first["tp"], first["pp"], first["state"]) == (
        "acme",
        "llama3-8b",
        1,
        1,
        "placed",
    )
    assert first["placements"][0]["node"] == acme[0]["placements"][0]["node"]
    assert first["placements"][0]["gpus"] == [
        int(a.rsplit("gpu", 1)[1]) for a in acme[0]["placements"][0]["accelerators"]
    ]
    lease = datetime.fromisoformat(first["lease_expires_at"])
    assert timedelta(seconds=500) < lease - datetime.now(UTC) <= timedelta(seconds=600)

    # The operator sees every tenant's, or one tenant's.
    everyone = await listed(bus, cli_dir)
    assert acme_ids | globex_ids <= set(everyone)
    assert set(await listed(bus, cli_dir, "--tenant", "globex")) == globex_ids
    table = await hetsched(bus, cli_dir, "replicas", "--tenant", "acme")
    assert (
        table.exit_code == 0
        and all(i in table.stdout for i in acme_ids)
        and "2 of 2 replica(s) of acme" in table.stdout
    )

    # `hetsched renew` moves the lease end, in the reply and in the listing.
    target = acme[0]["allocation_id"]
    renewed = await hetsched(bus, cli_dir, "renew", target, "--lease-s", "7200", credential="acme-gw")
    assert renewed.exit_code == 0, renewed.output
    assert f"renewed {target} for acme: the lease ends" in renewed.stdout
    after = datetime.fromisoformat((await listed(bus, cli_dir, credential="acme-gw"))[target]["lease_expires_at"])
    assert after - lease > timedelta(seconds=6000)  # 7200 s from now instead of 600

    # acme cannot list globex's, nor renew them: naming globex is `forbidden` on acme's subject ...
    refused = await hetsched(bus, cli_dir, "replicas", "--tenant", "globex", credential="acme-gw")
    assert refused.exit_code == 1 and "rejected: forbidden" in refused.stderr, refused.output
    theirs = globex[0]["allocation_id"]
    globex_lease = (await listed(bus, cli_dir, credential="globex-gw"))[theirs]["lease_expires_at"]
    refused = await hetsched(bus, cli_dir, "renew", theirs, "--tenant", "globex", credential="acme-gw")
    assert refused.exit_code == 1 and "rejected: forbidden" in refused.stderr, refused.output
    # ... and globex's id under acme's own name is no allocation of acme's (an id tells nothing).
    refused = await hetsched(bus, cli_dir, "renew", theirs, credential="acme-gw")
    assert refused.exit_code == 1 and "rejected: not_found" in refused.stderr, refused.output
    assert (await listed(bus, cli_dir, credential="globex-gw"))[theirs]["lease_expires_at"] == globex_lease

    # The server itself keeps a gateway to its tenant's subject (a request on another's is dropped).
    gateway = await bus.connect(gateway_identity("acme-gw"))
    subject = bus.subjects.scoped(Rpc.PLACEMENT_REPLICAS, "globex")
    await gateway.publish(subject, json.dumps({"tenant": "globex"}).encode())
    await gateway.refused(subject)
    unscoped = bus.subjects.rpc(Rpc.PLACEMENT_REPLICAS)
    await gateway.publish(unscoped, b"{}")
    await gateway.refused(unscoped)


async def test_a_replica_whose_engine_reports_is_ready(bus: SecureBus, cli_dir: Path) -> None:
    placed = await place(bus, cli_dir, "acme", "llama3-8b")
    replica = placed["allocation_id"]
    operator = await bus.connect("operator")
    status = EngineLoad(jitter=0).status(replica_id=replica, node=placed["placements"][0]["node"], rng=random.Random(0))

    async def ready() -> bool:
        await publish_engine_status(operator.nc.jetstream(), bus.subjects, status)
        return replica in await listed(bus, cli_dir, "--state", "ready", credential="acme-gw")

    await wait_for(ready, 30, interval_s=0.5, what=f"{replica} ready once its engine reports")
    assert replica not in await listed(bus, cli_dir, "--state", "placed", credential="acme-gw")


@pytest.mark.parametrize(
    ("args", "exit_code", "says"),
    [
        (("--model", "no-such-model"), 1, "rejected: unknown_model"),
        (("--node", "no-such-node"), 1, "rejected: not_found"),
        (("--limit", "0"), 2, "error: --limit"),
        (("--cursor", "garbage"), 2, "error: --cursor"),
        (("--state", "running"), 2, "error:"),
    ],
)
async def test_bad_filters_give_typed_errors(
    bus: SecureBus, cli_dir: Path, args: tuple[str, ...], exit_code: int, says: str
) -> None:
    result = await hetsched(bus, cli_dir, "replicas", *args, credential="acme-gw")
    assert result.exit_code == exit_code and says in result.stderr, (result.exit_code, result.output)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"cursor": "garbage"}, "cursor"),
        ({"limit": 10_000}, "limit"),
        ({"limit": True}, "limit"),
        ({"state": "running"}, "state"),
    ],
)
async def test_the_service_refuses_a_bad_body_as_invalid_request(
    bus: SecureBus, body: dict[str, Any], message: str
) -> None:
    """What a caller other than the CLI (which checks first) gets: `invalid_request` naming the field."""
    gateway = await bus.connect(gateway_identity("acme-gw"))
    reply = await gateway.request(bus.subjects.scoped(Rpc.PLACEMENT_REPLICAS, "acme"), {"tenant": "acme", **body})
    assert reply["status"] == "rejected" and reply["error"]["code"] == "invalid_request", reply
    assert message in reply["error"]["message"]
