"""`hetsched console` in a real headless Chromium, on a real stack (topology with the demo fleet, the ledger,
placement, the reservation filler and the rebalancer as processes). The console runs as an operator runs it
(`python -m hetsched console --port 0`) and Chromium opens the login URL it prints (its token sets the session
cookie); Chromium is driven over the DevTools pipe (tests/browser.py). The page must draw the demo fleet's
summary (nodes per cluster and SKU, the legend of GPU states), the TPU pod grids, and on drill-down a node's
GPUs and NVLink graph; GPUs a reservation holds count and show as reserved, not free; a replica placed with
`hetsched place` must be counted within two page refreshes (the page polls every second), show in its node's
GPU bars and NVLink graph in its TP group's colour, and then in the recent placements with its explanation;
a TPU slice must colour its chips; releasing it marks the placement released. The same page on the 1,024-node
fleet of the placement benchmark: tests/integration/test_console_fleet.py.

Screenshots go to the test's tmp dir; with HETSCHED_UPDATE_DOCS_IMAGES=1 they are also copied to
docs/img/console*.png (the README's pictures)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator, Iterator
from math import prod
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from hetsched.stack import wait_healthy
from shared.contracts.fleet import FleetGetReply
from shared.contracts.placement import PlaceReply, PlaceRequest
from shared.contracts.reservation import (
    ReservationCancelReply,
    ReservationCancelRequest,
    ReservationCreateReply,
    ReservationCreateRequest,
)
from shared.contracts.subjects import Rpc, Subjects
from shared.infra.catalog import demo_fleet_path
from shared.infra.rpc import RpcClient
from shared.infra.settings import Settings
from tests.browser import Browser, Console, console_process
from tests.conftest import REPO, ServiceProcesses, service_env
from tests.system_tools import ensure_tool
from tests.waiting import wait_for

TENANT = "cs-tenant"
NAMES = {
    package: f"cs_{package}"
    for package in ("topology_discovery", "capacity_ledger", "placement", "reservation_filler", "rebalancer")
}


# -- the stack and the console -------------------------------------------------------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def rpc(service_processes: ServiceProcesses, settings: Settings) -> AsyncIterator[RpcClient]:
    service_processes.start(
        "topology_discovery",
        name=NAMES["topology_discovery"],
        HETSCHED_TOPOLOGY_INVENTORY=str(demo_fleet_path()),
    )
    service_processes.start("capacity_ledger", name=NAMES["capacity_ledger"])
    service_processes.start("placement", name=NAMES["placement"])
    service_processes.start("reservation_filler", name=NAMES["reservation_filler"])
    service_processes.start("rebalancer", name=NAMES["rebalancer"])
    health = await wait_healthy(
        nats_url=settings.kit.nats_url or "",
        subjects=Subjects(settings.kit.subject_prefix),
        deadline_s=60,
        only=set(NAMES),
    )
    assert all(h["status"] == "ok" for h in health.values()), health
    client = await RpcClient.connect(settings.kit.nats_url or "", Subjects(settings.kit.subject_prefix), timeout_s=15)

    async def placement_knows_the_fleet() -> bool:
        probe = PlaceRequest(
            request_id="cs-probe", tenant=TENANT, model="llama3.1-8b", context_tokens=8192, backend="gpu"
        )
        reply = await client.ask(Rpc.PLACEMENT_EXPLAIN, probe, PlaceReply, rejection_as_reply=True)
        return isinstance(reply, PlaceReply) and reply.status == "placed"

    await wait_for(placement_knows_the_fleet, 60, interval_s=0.5, what="placement sees the demo fleet")
    yield client
    await client.close()
    for name in reversed(NAMES.values()):
        service_processes.stop(name)


@pytest.fixture(scope="module")
def console(rpc: RpcClient, settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    """`python -m hetsched console --port 0`, as an operator starts it; the URLs it prints."""
    with console_process(service_env(settings), tmp_path_factory.mktemp("console") / "console.log", REPO) as started:
        yield started


@pytest_asyncio.fixture(loop_scope="session")
async def browser(console: Console, tmp_path: Path) -> AsyncIterator[Browser]:
    chromium = ensure_tool("chromium", "chromium")
    b = await Browser.launch(chromium, tmp_path / "chromium-profile", tmp_path / "chromium.log")
    try:
        await b.open(console.login_url)  # as the operator opens the printed URL: a cookie, then the page
        yield b
    finally:
        await b.close()


def hetsched_cli(settings: Settings, *args: str) -> dict[str, Any]:
    """`python -m hetsched ... --json` as an operator runs it; its JSON output (exit 0 expected)."""
    done = subprocess.run(
        [sys.executable, "-m", "hetsched", *args, "--json"],
        env=service_env(settings),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert done.returncode == 0, (args, done.stdout, done.stderr)
    answer: dict[str, Any] = json.loads(done.stdout)
    return answer


def keep(shot: Path, name: str) -> None:
    """Copy a screenshot to docs/img when asked (HETSCHED_UPDATE_DOCS_IMAGES=1): commit-worthy pictures."""
    if os.environ.get("HETSCHED_UPDATE_DOCS_IMAGES") == "1":
        shutil.copyfile(shot, REPO / "docs" / "img" / name)


# -- the tests -----------------------------------------------------------------------------------------


def test_api_state_serves_the_fleet_and_refuses_what_it_does_not_serve(console: Console) -> None:
    with urllib.request.urlopen(console.request("api/state"), timeout=30) as response:
        assert response.headers["Content-Type"] == "application/json"
        state = json.load(response)
    assert {"dgx-h100-01", "hgx-h100-4x4-01", "gh200-01"} <= {n["name"] for n in state["nodes"]}
    assert {p["name"]: p["shape"] for p in state["tpu_pods"]} == {"v5e-pod-1": [16, 16], "v5p-pod-1": [8, 8, 8]}
    assert state["rebalancer"] is not None and state["reservations"] is not None, state["errors"]
    for path, status in (("nope", 404), ("../pyproject.toml", 404)):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(console.request(path), timeout=30)
        assert refused.value.code == status
    request = console.request("api/state", method="POST", data=b"{}")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 405


@pytest.mark.asyncio(loop_scope="session")
async def test_the_page_draws_the_fleet_and_follows_placements(
    browser: Browser, rpc: RpcClient, settings: Settings, console: Console, tmp_path: Path
) -> None:
    fleet = await rpc.fleet()
    assert isinstance(fleet, FleetGetReply)
    reserved = await wait_for(lambda: _reserve(rpc), 60, interval_s=0.5, what="the reservation filler knows the fleet")
    assert reserved is not None
    reservation, reserved_gpus = reserved

    # The first state drawn: the fleet summary (every node counted, once per grouping), the legend, the pods.
    await wait_for(
        lambda: browser.js("!!window.hetschedConsole && window.hetschedConsole.refreshes >= 1"),
        30,
        what="the first refresh",
    )
    assert await browser.js("window.hetschedConsole.lastError") is None
    legend = await browser.js("[...document.querySelectorAll('#legend [data-legend]')].map(e => e.dataset.legend)")
    assert legend == ["placed", "lent", "reserved_hard", "reserved_soft", "free", "unavailable"]
    clusters = await browser.js(_ROWS)
    assert clusters == {"us-west-1/c1": 7, "us-east-1/c1": 6}  # nodes per `<region>/<cluster>`
    assert sum(clusters.values()) == len(fleet.nodes)
    await browser.click('[data-by="sku"]')
    assert (await browser.js(_ROWS))["H100-SXM-80GB"] == 3
    await browser.click('[data-by="cluster"]')
    chips = await browser.js(
        "Object.fromEntries([...document.querySelectorAll('[data-pod]')]"
        ".map(p => [p.dataset.pod, p.querySelectorAll('svg rect.chip').length]))"
    )
    assert chips == {"v5e-pod-1": 16 * 16, "v5p-pod-1": 8 * 8 * 8}
    await wait_for(
        lambda: browser.js(f"!!document.querySelector('[data-reservation=\"{reservation}\"]')"),
        10,
        what="the reservation listed",
    )
    # Reserved GPUs are not free: the summary counts them apart, the node's drill-down colours them apart.
    east = '#summary tr[data-group="us-east-1/c1"]'
    await wait_for(
        lambda: browser.js(f"document.querySelector('{east} [data-count=reserved]').textContent === '2'"),
        10,
        what="two GPUs reserved in us-east-1/c1",
    )
    await browser.click(east)
    host = reserved_gpus[0].split("/")[0]
    await wait_for(
        lambda: browser.js(f"!!document.querySelector('#group-nodes tr[data-node=\"{host}\"]')"), 10, what="its nodes"
    )
    await browser.click(f'#group-nodes tr[data-node="{host}"]')
    states = await wait_for(lambda: _states(browser, host), 10, what="the reserved node's GPUs")
    assert states is not None
    assert {states[g] for g in reserved_gpus if g.startswith(host)} == {"reserved_soft"}
    assert len(states) == 8

    # The NVLink graph of a node, in its drill-down: NVSwitch (every pair of 8) and 4+4 (two K4s).
    for name, domains in (
        ("dgx-h100-01", {"dgx-h100-01/nv0": 28}),
        ("hgx-h100-4x4-01", {"hgx-h100-4x4-01/nv0": 6, "hgx-h100-4x4-01/nv4": 6}),
    ):
        await _open_node(browser, name)
        assert await _edges_drawn(browser, domains) == domains

    # A TP-2 replica placed with the CLI: counted placed in the summary within two refreshes; in its node's
    # drill-down, its two GPUs placed, in the HBM bars and the NVLink graph in its TP group's colour.
    west = '#summary tr[data-group="us-west-1/c1"] [data-count=placed]'
    placed_before = int(await browser.js(f"document.querySelector('{west}').textContent"))
    placed = hetsched_cli(
        settings,
        "place",
        "--model", "llama3.1-8b",
        "--tenant", TENANT,
        "--context-tokens", "8192",
        "--tp", "2",
        "--backend", "gpu",
        "--sku", "H100-SXM-80GB",
        "--region", "us-west-1",
    )  # fmt: skip
    gpu_allocation = placed["allocation_id"]
    after = await browser.js("window.hetschedConsole.refreshes")
    # Every state is fresh: asked for now, it holds what the ledger committed before `place` returned.
    chosen = {a for p in placed["placements"] for a in p["accelerators"]}
    assert len(chosen) == 2 and set(await asyncio.to_thread(_holding, console, gpu_allocation)) == chosen
    shown_at = await wait_for(
        lambda: browser.js(
            f"Number(document.querySelector('{west}').textContent) === {placed_before + 2}"
            " && window.hetschedConsole.refreshes"
        ),
        10,
        what="the summary counting the replica",
    )
    # A fetch in flight when `place` returned may predate the commit; the next one started after it.
    assert shown_at <= after + 2, (after, shown_at)
    node = placed["placements"][0]["node"]
    await _open_node(browser, node)
    bars = f'#node-detail .gpu[data-allocations~="{gpu_allocation}"]'
    await wait_for(lambda: browser.js(f"document.querySelectorAll('{bars}').length === 2"), 10, what="the GPU bars")
    assert await browser.js(f"[...document.querySelectorAll('{bars}')].map(g => g.dataset.state)") == ["placed"] * 2
    dots = f'#node-detail [data-domain] g[data-allocations~="{gpu_allocation}"] circle'
    colours = await browser.js(f"[...document.querySelectorAll('{dots}')].map(c => c.getAttribute('fill'))")
    swatches = await browser.js(f"[...document.querySelectorAll('{bars} .swatch.holder')].map(d => d.style.background)")
    assert len(colours) == 2 and len(set(colours)) == 1, colours  # one TP group, one colour
    assert len(swatches) == 2 and len(set(swatches)) == 1, swatches

    # Then in the recent placements (the PLACEMENT stream), with its explanation.
    row = f'#placements li[data-allocation="{gpu_allocation}"]'
    explained = await wait_for(
        lambda: browser.js(f"[...document.querySelectorAll('{row} .explanation li')].map(li => li.textContent)"),
        15,
        what="the placement and its explanation",
    )
    assert explained == placed["explanation"]

    # A TPU slice colours its chips in the pod grid.
    sliced = hetsched_cli(
        settings, "place", "--model", "llama3.1-8b", "--tenant", TENANT, "--context-tokens", "8192", "--backend", "tpu"
    )
    tpu_allocation = sliced["allocation_id"]
    chip_cells = f'[data-pod="{sliced["tpu_slice"]["pod"]}"] rect[data-allocations~="{tpu_allocation}"]'
    coloured = await wait_for(
        lambda: browser.js(f"document.querySelectorAll('{chip_cells}').length"), 10, what="the slice's chips"
    )
    assert coloured == prod(sliced["tpu_slice"]["shape"])
    await wait_for(
        lambda: browser.js(f"!!document.querySelector('#placements li[data-allocation=\"{tpu_allocation}\"]')"),
        15,
        what="the TPU placement listed",
    )

    shots = tmp_path / "screenshots"
    shots.mkdir()
    for name, selector, from_top in (
        ("console.png", "#node-section", True),
        ("console-placements.png", ".columns", False),
        ("console-tpu.png", "#pods-section", False),
    ):
        keep(await browser.screenshot(shots / name, selector, from_top=from_top), name)
    assert all(p.stat().st_size > 10_000 for p in shots.iterdir())  # a picture, not an empty page

    # Released: its GPUs hold nothing and the placement says so.
    for allocation in (gpu_allocation, tpu_allocation):
        assert hetsched_cli(settings, "release", allocation, "--tenant", TENANT)["status"] == "released"
    await wait_for(lambda: browser.js(f"document.querySelectorAll('{bars}').length === 0"), 10, what="the bars emptied")
    await wait_for(
        lambda: browser.js(f"document.querySelector('{row}').dataset.status === 'released'"),
        15,
        what="the placement marked released",
    )
    cancelled = await rpc.ask(
        Rpc.RESERVATION_CANCEL,
        ReservationCancelRequest(reservation_id=reservation, tenant=TENANT),
        ReservationCancelReply,
    )
    assert isinstance(cancelled, ReservationCancelReply), cancelled
    assert browser.console_errors == []
    assert await browser.js("window.hetschedConsole.lastError") is None


# The summary's rows: group -> nodes.
_ROWS = (
    "Object.fromEntries([...document.querySelectorAll('#summary tr[data-group]')]"
    ".map(r => [r.dataset.group, Number(r.children[1].textContent)]))"
)


async def _open_node(browser: Browser, name: str) -> None:
    """Open a node's drill-down as an operator does by name (the form above the summary)."""
    await browser.js(
        f"(() => {{ const f = document.getElementById('find-node'); f.elements.node.value = {json.dumps(name)};"
        " f.requestSubmit(); })()"
    )
    await wait_for(
        lambda: browser.js(f"!!document.querySelector('[data-node-detail={json.dumps(name)}]')"),
        10,
        what=f"the drill-down of {name}",
    )


async def _states(browser: Browser, node: str) -> dict[str, str] | None:
    """The node's GPUs in its drill-down: accelerator -> state (None until it is drawn)."""
    states: dict[str, str] | None = await browser.js(
        f"(() => {{ const card = document.querySelector('[data-node-detail={json.dumps(node)}]');"
        " return card && Object.fromEntries([...card.querySelectorAll('.gpu')]"
        ".map(g => [g.dataset.accelerator, g.dataset.state])); })()"
    )
    return states


async def _edges_drawn(browser: Browser, domains: dict[str, int]) -> dict[str, int]:
    """NVLink edges per domain of the node drawn, once the drill-down shows these ``domains``."""

    async def seen() -> dict[str, int] | None:
        edges: dict[str, int] = await browser.js(
            "Object.fromEntries([...document.querySelectorAll('#node-detail [data-domain]')]"
            ".map(d => [d.dataset.domain, d.querySelectorAll('svg line.edge').length]))"
        )
        return edges if set(edges) == set(domains) else None

    drawn = await wait_for(seen, 10, what=f"the NVLink graphs {sorted(domains)}")
    assert drawn is not None
    return drawn


def _holding(console: Console, allocation_id: str) -> list[str]:
    """The GPUs `/api/state` shows holding the allocation."""
    with urllib.request.urlopen(console.request("api/state"), timeout=30) as response:
        state = json.load(response)
    return [g["id"] for n in state["nodes"] for g in n["gpus"] if allocation_id in g["allocations"]]


async def _reserve(rpc: RpcClient) -> tuple[str, list[str]] | None:
    """A soft reservation of two H200s (its fill rate shows on the page): its id and GPUs; None until the
    filler knows them."""
    reply = await rpc.ask(
        Rpc.RESERVATION_CREATE,
        ReservationCreateRequest(
            request_id="cs-reserve", tenant=TENANT, policy="soft", count=2, sku="H200-SXM-141GB", region="us-east-1"
        ),
        ReservationCreateReply,
    )
    if not isinstance(reply, ReservationCreateReply) or reply.reservation_id is None:
        return None
    return reply.reservation_id, reply.accelerators


def test_the_console_says_why_it_cannot_start(settings: Settings, console: Console) -> None:
    """Its port taken: exit 2 with the reason, not a traceback."""
    port = console.url.rsplit(":", 1)[1].strip("/")
    done = subprocess.run(
        [sys.executable, "-m", "hetsched", "console", "--port", port],
        env=service_env(settings),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "console:" in done.stderr and port in done.stderr, done.stderr
