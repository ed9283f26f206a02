"""`hetsched console` in a real headless Chromium, on a real stack (topology with the demo fleet, the ledger,
placement, the reservation filler and the rebalancer as processes). The console runs as an operator runs it
(`python -m hetsched console --port 0`) and Chromium opens the login URL it prints (its token sets the session
cookie); Chromium is driven with the Chrome DevTools Protocol over its
debugging pipe (`--remote-debugging-pipe`: JSON messages ended by NUL on fds 3 and 4; no websocket client,
no new dependency). The page must draw the demo fleet (every node, the NVLink graphs, the TPU pod grids);
a replica placed with `hetsched place` must show within two page refreshes (the page polls every second) in
the HBM bars and the NVLink graph in its TP group's colour, and then in the recent placements with its
explanation; a TPU slice must colour its chips; releasing it marks the placement released.

Screenshots go to the test's tmp dir; with HETSCHED_UPDATE_DOCS_IMAGES=1 they are also copied to
docs/img/console*.png (the README's pictures)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
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
from tests.conftest import REPO, ServiceProcesses, service_env
from tests.system_tools import ensure_tool
from tests.waiting import wait_for

TENANT = "cs-tenant"
NAMES = {
    package: f"cs_{package}"
    for package in ("topology_discovery", "capacity_ledger", "placement", "reservation_filler", "rebalancer")
}
VIEWPORT = {"width": 1400, "height": 1000}
CDP_TIMEOUT_S = 30.0


# -- Chromium over the DevTools pipe -------------------------------------------------------------------


class Browser:
    """One headless Chromium and one page, driven over ``--remote-debugging-pipe``."""

    def __init__(self, proc: subprocess.Popen[bytes], reader: asyncio.StreamReader, write_fd: int) -> None:
        self.proc = proc
        self._reader = reader
        self._write_fd = write_fd
        self._next_id = 0
        self.session: str | None = None
        self.console_errors: list[str] = []

    @classmethod
    async def launch(cls, chromium: Path, profile_dir: Path, log: Path) -> Browser:
        to_chrome_r, to_chrome_w = os.pipe()
        from_chrome_r, from_chrome_w = os.pipe()

        def on_fds_3_and_4() -> None:  # in the child, before exec: Chromium reads fd 3 and writes fd 4
            high_r = fcntl.fcntl(to_chrome_r, fcntl.F_DUPFD_CLOEXEC, 10)
            high_w = fcntl.fcntl(from_chrome_w, fcntl.F_DUPFD_CLOEXEC, 10)
            os.dup2(high_r, 3)
            os.dup2(high_w, 4)

        args = [
            str(chromium),
            "--headless",
            "--no-sandbox",  # tests run as root in a container
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--no-default-browser-check",
            "--hide-scrollbars",
            "--remote-debugging-pipe",
            f"--user-data-dir={profile_dir}",
            f"--window-size={VIEWPORT['width']},{VIEWPORT['height']}",
            "about:blank",
        ]
        with log.open("ab") as out:
            proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=out, stderr=out, preexec_fn=on_fds_3_and_4, close_fds=False
            )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=64 * 1024 * 1024)  # a screenshot comes as one message
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(from_chrome_r, "rb"))
        return cls(proc, reader, to_chrome_w)

    async def send(self, method: str, params: dict[str, Any] | None = None, *, page: bool = True) -> dict[str, Any]:
        """One command (to the page's session unless ``page`` is False); its result, or AssertionError."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if page and self.session:
            message["sessionId"] = self.session
        os.write(self._write_fd, json.dumps(message).encode() + b"\0")
        while True:
            raw = await asyncio.wait_for(self._reader.readuntil(b"\0"), CDP_TIMEOUT_S)
            reply = json.loads(raw[:-1])
            if reply.get("method") == "Runtime.exceptionThrown":
                details = reply["params"]["exceptionDetails"]
                self.console_errors.append(str(details.get("exception", {}).get("description") or details))
            if reply.get("id") == self._next_id:
                assert "error" not in reply, f"{method}: {reply['error']}"
                result: dict[str, Any] = reply.get("result", {})
                return result

    async def open(self, url: str) -> None:
        target = await self.send("Target.createTarget", {"url": "about:blank"}, page=False)
        attached = await self.send(
            "Target.attachToTarget", {"targetId": target["targetId"], "flatten": True}, page=False
        )
        self.session = attached["sessionId"]
        await self.send("Runtime.enable")
        await self.send("Page.enable")
        await self.send("Emulation.setDeviceMetricsOverride", {**VIEWPORT, "deviceScaleFactor": 1, "mobile": False})
        await self.send("Page.navigate", {"url": url})

    async def js(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (JSON-serialisable)."""
        reply = await self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        assert "exceptionDetails" not in reply, reply["exceptionDetails"]
        return reply["result"].get("value")

    async def screenshot(self, path: Path, selector: str, *, from_top: bool = False) -> Path:
        """A PNG of one element (or of the page from its top down to that element's bottom)."""
        box = await self.js(
            f"(() => {{ const r = document.querySelector({json.dumps(selector)}).getBoundingClientRect();"
            f" return {json.dumps(from_top)}"
            " ? {x: 0, y: 0, width: document.documentElement.clientWidth, height: r.bottom + scrollY}"
            " : {x: r.left + scrollX, y: r.top + scrollY, width: r.width, height: r.height}; })()"
        )
        params = {"format": "png", "clip": {**box, "scale": 1}, "captureBeyondViewport": True}
        shot = await self.send("Page.captureScreenshot", params)
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.send("Browser.close", page=False), 5)
        with contextlib.suppress(OSError):
            os.close(self._write_fd)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


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


@dataclass(frozen=True)
class Console:
    url: str  # what it prints first
    login_url: str  # what it prints next: the URL that logs a browser in (sets the session cookie)

    @property
    def token(self) -> str:
        return self.login_url.split("token=", 1)[1]

    def request(self, path: str, **kw: Any) -> urllib.request.Request:
        """A request to the console with its token (every route but the login page needs it)."""
        return urllib.request.Request(self.url + path, headers={"Authorization": f"Bearer {self.token}"}, **kw)


@pytest.fixture(scope="module")
def console(rpc: RpcClient, settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    """`python -m hetsched console --port 0`, as an operator starts it; the URLs it prints."""
    log = tmp_path_factory.mktemp("console") / "console.log"
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hetsched", "console", "--port", "0"],
            env=service_env(settings),
            stdout=subprocess.PIPE,
            stderr=err,
            cwd=REPO,
        )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()  # the first line, once it listens (or EOF if it died)
    assert line.startswith("hetsched console at http://"), (line, log.read_text())
    login = proc.stdout.readline().decode().split()
    assert login[0] == "open" and "/login?token=" in login[1], login
    try:
        yield Console(line.split(" at ", 1)[1].strip(), login[1])
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0, log.read_text()  # SIGTERM is a clean stop


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
    reservation = await wait_for(
        lambda: _reserve(rpc), 60, interval_s=0.5, what="the reservation filler knows the fleet"
    )

    # The first state drawn: every node of the demo fleet, the NVLink graphs, the TPU pod grids.
    await wait_for(lambda: browser.js("window.hetschedConsole.refreshes >= 1"), 30, what="the first refresh")
    assert await browser.js("window.hetschedConsole.lastError") is None
    drawn = await browser.js("[...document.querySelectorAll('#nodes [data-node]')].map(e => e.dataset.node)")
    assert sorted(drawn) == sorted(n.name for n in fleet.nodes)
    edges = await browser.js(
        "Object.fromEntries([...document.querySelectorAll('[data-domain]')]"
        ".map(d => [d.dataset.domain, d.querySelectorAll('svg line.edge').length]))"
    )
    assert edges["dgx-h100-01/nv0"] == 8 * 7 // 2  # NVSwitch: every pair of the 8 GPUs, 28 edges
    assert edges["hgx-h100-4x4-01/nv0"] == edges["hgx-h100-4x4-01/nv4"] == 4 * 3 // 2  # 4+4: two K4s, 6 each
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

    # A TP-2 replica placed with the CLI: in the HBM bars and the NVLink graph within two refreshes.
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
    bars = f'#nodes [data-allocations~="{gpu_allocation}"]'
    shown_at = await wait_for(
        lambda: browser.js(f"document.querySelector('{bars}') && window.hetschedConsole.refreshes"),
        10,
        what="the GPU bars",
    )
    # A fetch in flight when `place` returned may predate the commit; the next one started after it.
    assert shown_at <= after + 2, (after, shown_at)
    assert await browser.js(f"document.querySelectorAll('{bars}').length") == 2
    dots = f'[data-domain] g[data-allocations~="{gpu_allocation}"] circle'
    colours = await browser.js(f"[...document.querySelectorAll('{dots}')].map(c => c.getAttribute('fill'))")
    bar_colours = await browser.js(f"[...document.querySelectorAll('{bars} .bar > div')].map(d => d.style.background)")
    assert len(colours) == 2 and len(set(colours)) == 1, colours  # one TP group, one colour
    assert len(bar_colours) == 2 and len(set(bar_colours)) == 1, bar_colours

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
        ("console.png", "#domains-section", True),
        ("console-placements.png", ".columns", False),
        ("console-tpu.png", "#pods-section", False),
    ):
        keep(await browser.screenshot(shots / name, selector, from_top=from_top), name)
    assert all(p.stat().st_size > 10_000 for p in shots.iterdir())  # a picture, not an empty page

    # Released: the bars empty and the placement says so.
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


def _holding(console: Console, allocation_id: str) -> list[str]:
    """The GPUs `/api/state` shows holding the allocation."""
    with urllib.request.urlopen(console.request("api/state"), timeout=30) as response:
        state = json.load(response)
    return [g["id"] for n in state["nodes"] for g in n["gpus"] if allocation_id in g["allocations"]]


async def _reserve(rpc: RpcClient) -> str | None:
    """A soft reservation of two H200s (its fill rate shows on the page); None until the filler knows them."""
    reply = await rpc.ask(
        Rpc.RESERVATION_CREATE,
        ReservationCreateRequest(
            request_id="cs-reserve", tenant=TENANT, policy="soft", count=2, sku="H200-SXM-141GB", region="us-east-1"
        ),
        ReservationCreateReply,
    )
    return reply.reservation_id if isinstance(reply, ReservationCreateReply) else None


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
