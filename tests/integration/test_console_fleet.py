"""`hetsched console` on the 1,024-node fleet of the placement benchmark (tests/bench/placement_e2e.py
``bench_fleet``: 1,024 synthetic nodes, about 7,200 GPUs, published by topology from its inventory), in a real
headless Chromium, on a stack of its own (topology, the ledger, placement, the reservation filler and the
rebalancer as processes, in a database and under a subject prefix of their own).

Replicas are placed and two reservations made (one hard, one soft); then the page must render the fleet
summary (rows per region, cluster and SKU whose counts are the ledger's and the reservations'), and a
drill-down (a cluster's nodes, then one node) must show the node's GPUs, placed and reserved ones apart.
It prints the time to first render of the summary, the drill-down times and the payload sizes; it asserts
what the page shows, not how fast."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from shared.contracts.subjects import Rpc
from tests.bench.ledger_harness import LedgerHarness
from tests.bench.placement_e2e import MIX, bench_fleet, placement_ready
from tests.browser import Browser, Console, console_process
from tests.conftest import REPO
from tests.servers import RealServers
from tests.system_tools import ensure_tool
from tests.waiting import wait_for

NODES = 1024
REPLICAS = 12
HARD = {"tenant": "fleet-hard", "policy": "hard", "count": 4, "sku": "H100-SXM-80GB", "region": "us-west-1"}
SOFT = {"tenant": "fleet-soft", "policy": "soft", "count": 4, "sku": "L40S-48GB", "region": "us-east-1"}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(
    servers: RealServers, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[LedgerHarness, dict[str, Any]]]:
    """The benchmark's fleet under topology, the ledger, placement, the filler and the rebalancer; replicas
    placed and two reservations made. Yields the harness and what was done (placements, reservations)."""
    fleet, gpus = bench_fleet(NODES)
    workdir = tmp_path_factory.mktemp("fleet")
    # Topology and the ledger first (the ledger learns the fleet from topology's events), then the others.
    async with LedgerHarness(servers, workdir, fleet=fleet, want_accelerators=gpus, ready_s=300) as h:
        for package in ("placement", "reservation_filler", "rebalancer"):
            h.start(package)
        await placement_ready(h, deadline_s=300)
        placed = []
        for i in range(REPLICAS):
            model, dtype, context, concurrency = MIX[i % len(MIX)]
            body = {
                "request_id": f"fleet-{i}",
                "tenant": "fleet",
                "model": model,
                "dtype": dtype,
                "context_tokens": context,
                "concurrency": concurrency,
                "backend": "gpu",
            }
            reply = await h.call(Rpc.PLACEMENT_PLACE, body, timeout=60)
            assert reply.get("status") == "placed", reply
            placed.append(reply)
        reservations = {spec["policy"]: await _reserved(h, spec) for spec in (HARD, SOFT)}
        yield h, {"fleet": fleet, "gpus": gpus, "placed": placed, "reservations": reservations}


async def _reserved(h: LedgerHarness, spec: dict[str, Any]) -> dict[str, Any]:
    """The reservation ``spec`` asks for, made once the filler knows the fleet (asked again until then)."""

    async def made() -> dict[str, Any] | None:
        reply = await h.call(Rpc.RESERVATION_CREATE, {"request_id": f"r-{spec['policy']}", **spec}, timeout=30)
        return reply if reply.get("status") == "created" else None

    reply = await wait_for(made, 120, interval_s=0.5, what="the filler knows the fleet")
    assert isinstance(reply, dict)
    return reply


@pytest.fixture(scope="module")
def console(stack: tuple[LedgerHarness, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    h, _ = stack
    with console_process(h.env(), tmp_path_factory.mktemp("console") / "console.log", REPO) as started:
        yield started


@pytest_asyncio.fixture(loop_scope="session")
async def browser(tmp_path: Path) -> AsyncIterator[Browser]:
    chromium = ensure_tool("chromium", "chromium")
    b = await Browser.launch(chromium, tmp_path / "chromium-profile", tmp_path / "chromium.log")
    try:
        yield b
    finally:
        await b.close()


async def _ledger_holding(h: LedgerHarness) -> dict[str, list[str]]:
    """Accelerator -> allocations, for those the ledger shows holding something (every page)."""
    holding: dict[str, list[str]] = {}
    cursor: str | None = None
    while True:
        body: dict[str, Any] = {"limit": 20_000, **({"cursor": cursor} if cursor else {})}
        page = await h.call(Rpc.LEDGER_SNAPSHOT, body, timeout=30)
        holding.update({a["id"]: a["allocations"] for a in page["accelerators"] if a["allocations"]})
        cursor = page.get("next_cursor")
        if not cursor:
            return holding


async def _reusing(console: Console) -> dict[str, Any] | None:
    """The summary, once it comes from a collection that reused the fleet's index (None before)."""
    summary, _ = await asyncio.to_thread(console.get, "api/summary")
    return summary if summary["timing"]["fleet_asked"] is False else None


async def _next_page(browser: Browser) -> None:
    """Click "next" above a group's nodes; back once another page is drawn."""
    first = "document.querySelector('#group-nodes tr[data-node]').dataset.node"
    shown = await browser.js(first)
    await browser.click('#group-pager [data-page="next"]')
    await wait_for(lambda: browser.js(f"{first} !== {json.dumps(shown)}"), 10, what="the next page")


def _where(fleet: dict[str, Any], node: str) -> str:
    """``<region>/<cluster>`` of a node of the inventory."""
    for region in fleet["regions"]:
        for cluster in region["clusters"]:
            for rack in cluster["racks"]:
                if any(n["name"] == node for n in rack["nodes"]):
                    return f"{region['name']}/{cluster['name']}"
    raise AssertionError(f"{node} not in the inventory")


@pytest.mark.asyncio(loop_scope="session")
async def test_the_summary_renders_and_a_node_drill_down_shows_its_gpus_on_1024_nodes(
    stack: tuple[LedgerHarness, dict[str, Any]], console: Console, browser: Browser, tmp_path: Path
) -> None:
    h, done = stack
    fleet, gpus = done["fleet"], done["gpus"]
    holding = await _ledger_holding(h)

    # The page, as an operator opens it once the console has started: from the login URL to the first
    # summary drawn (what the server did for that summary is in its `timing`).
    await browser.open(console.login_url)
    first = await wait_for(
        lambda: browser.js("window.hetschedConsole && window.hetschedConsole.firstRenderMs"),
        60,
        what="the first render of the summary",
    )
    first_timing = await browser.js("window.hetschedConsole.firstTiming")

    # The summary as the page gets it: every node and GPU counted (the ledger's and the reservations' counts),
    # a few kilobytes.
    started = time.perf_counter()
    summary, summary_bytes = await asyncio.to_thread(console.get, "api/summary")
    summary_ms = (time.perf_counter() - started) * 1000
    total = summary["fleet"]["total"]
    assert (total["nodes"], total["gpus"]) == (NODES, gpus), summary["errors"]
    assert total["placed"] + total["lent"] == len(holding)
    assert total["reserved_hard"] == HARD["count"]
    assert total["reserved_soft"] + total["lent"] == SOFT["count"]
    assert summary_bytes < 64_000

    assert await browser.js("window.hetschedConsole.lastError") is None
    rows = await browser.js(
        "[...document.querySelectorAll('#summary tr[data-group]')].map(r => ["
        "r.dataset.group, Number(r.children[1].textContent.replace(/,/g, '')),"
        " Number(r.querySelector('[data-count=placed]').textContent.replace(/,/g, ''))])"
    )
    assert {key for key, _, _ in rows} == {row["key"] for row in summary["fleet"]["groups"]["cluster"]}
    assert sum(nodes for _, nodes, _ in rows) == NODES
    assert sum(p for _, _, p in rows) == total["placed"]
    drawn = await browser.js("document.querySelectorAll('*').length")  # the page's size: groups, not GPUs

    # Drill-down: the cluster of the first replica's node, its nodes a page at a time, then the node.
    reply = done["placed"][0]
    node = reply["placements"][0]["node"]
    mine = {a for p in reply["placements"] if p["node"] == node for a in p["accelerators"]}
    cluster = _where(fleet, node)
    await browser.click(f'#summary tr[data-group="{cluster}"]')
    row = f'#group-nodes tr[data-node="{node}"]'
    for _ in range(NODES // 100 + 1):
        await wait_for(lambda: browser.js("!!document.querySelector('#group-nodes tr[data-node]')"), 10, what="nodes")
        if await browser.js(f"!!document.querySelector('{row}')"):
            break
        await _next_page(browser)
    listed = await browser.js("document.querySelectorAll('#group-nodes tr[data-node]').length")
    assert 0 < listed <= 100  # a page, not the cluster
    await browser.click(row)
    card = f'[data-node-detail="{node}"]'
    await wait_for(lambda: browser.js(f"!!document.querySelector('{card}')"), 10, what="the node's GPUs")
    states = await browser.js(
        f"Object.fromEntries([...document.querySelectorAll('{card} .gpu')].map(g => [g.dataset.accelerator,"
        " [g.dataset.state, (g.dataset.allocations || '').split(' ')]]))"
    )
    expected_gpus = next(
        n["gpus"]
        for r in fleet["regions"]
        for c in r["clusters"]
        for k in c["racks"]
        for n in k["nodes"]
        if n["name"] == node
    )
    assert len(states) == expected_gpus
    for acc in mine:
        assert states[acc][0] == "placed" and reply["allocation_id"] in states[acc][1], states[acc]
    assert {acc for acc, (state, _) in states.items() if state == "placed"} == {a for a in states if a in holding}

    # A GPU of the hard reservation, opened by name: reserved (hard), not free.
    reserved_gpu = done["reservations"]["hard"]["accelerators"][0]
    reserved_node = reserved_gpu.split("/")[0]
    await browser.js(
        "(() => { const f = document.getElementById('find-node');"
        f" f.elements.node.value = {json.dumps(reserved_node)}; f.requestSubmit(); }})()"
    )
    reserved_card = f'[data-node-detail="{reserved_node}"]'
    await wait_for(lambda: browser.js(f"!!document.querySelector('{reserved_card}')"), 10, what="the reserved node")
    state = await browser.js(
        f"document.querySelector('{reserved_card} .gpu[data-accelerator=\"{reserved_gpu}\"]').dataset.state"
    )
    assert state == "reserved_hard"

    timings = await browser.js("window.hetschedConsole.timings")
    page_bytes = await browser.js("window.hetschedConsole.summaryBytes")
    _, node_bytes = await asyncio.to_thread(console.get, f"api/node?name={node}")
    steady = await wait_for(lambda: _reusing(console), 30, interval_s=0.6, what="a collection reusing the fleet")
    for name, selector, from_top in (
        ("console-fleet.png", "#fleet-section", True),  # the summary
        ("console-fleet-node.png", "#node-section", False),  # one node's GPUs
    ):
        shot = await browser.screenshot(tmp_path / name, selector, from_top=from_top)
        assert shot.stat().st_size > 10_000
        if os.environ.get("HETSCHED_UPDATE_DOCS_IMAGES") == "1":
            shutil.copyfile(shot, REPO / "docs" / "img" / name)

    # A later visit (the console's fleet index built): the page loaded again, to its first summary drawn.
    before = await browser.js("performance.timeOrigin")
    await browser.send("Page.navigate", {"url": console.url})
    again = await wait_for(
        lambda: browser.js(
            f"performance.timeOrigin !== {before} && !!window.hetschedConsole && window.hetschedConsole.firstRenderMs"
        ),
        60,
        what="the first render of the page loaded again",
    )
    again_timing = await browser.js("window.hetschedConsole.firstTiming")
    started = time.perf_counter()
    _, state_bytes = await asyncio.to_thread(console.get, "api/state")
    state_ms = (time.perf_counter() - started) * 1000
    print(
        f"\nconsole on {NODES} nodes / {gpus} GPUs ({len(holding)} placed, {HARD['count']} reserved hard, "
        f"{SOFT['count']} reserved soft):\n"
        f"  time to first render of the summary: {first} ms (navigation start, login redirect included; "
        f"the server's collection for it: {first_timing}); a later visit: {again} ms ({again_timing})\n"
        f"  initial payload /api/summary: {page_bytes} bytes; page DOM {drawn} elements\n"
        f"  server: the test's first GET {summary_ms:.0f} ms, its collection {summary['timing']}; "
        f"a later one {steady['timing']}\n"
        f"  drill-down: a cluster's nodes {timings['nodes']} ms, a node's GPUs {timings['node']} ms "
        f"(/api/node {node_bytes} bytes)\n"
        f"  for comparison, the whole-fleet /api/state: {state_bytes} bytes in {state_ms:.0f} ms"
    )
    assert browser.console_errors == []
    assert await browser.js("window.hetschedConsole.lastError") is None
