"""Headless Chromium for the console's tests, driven with the Chrome DevTools Protocol over its debugging pipe
(`--remote-debugging-pipe`: JSON messages ended by NUL on fds 3 and 4; no websocket client, no new dependency).

    chromium = ensure_tool("chromium", "chromium")
    browser = await Browser.launch(chromium, tmp_path / "profile", tmp_path / "chromium.log")
    await browser.open(url)
    await browser.js("document.title")
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fcntl
import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VIEWPORT = {"width": 1400, "height": 1000}
CDP_TIMEOUT_S = 30.0


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

    async def click(self, selector: str) -> None:
        """Click the first element ``selector`` finds (it must exist)."""
        assert await self.js(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)});"
            " if (!e) return false; e.click(); return true; })()"
        ), f"nothing to click at {selector}"

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


# -- the console as an operator starts it --------------------------------------------------------------


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

    def get(self, path: str) -> tuple[Any, int]:
        """``GET path`` with the token: its JSON and its size in bytes."""
        with urllib.request.urlopen(self.request(path), timeout=60) as response:
            body = response.read()
        return json.loads(body), len(body)


@contextlib.contextmanager
def console_process(env: Mapping[str, str], log: Path, cwd: Path) -> Iterator[Console]:
    """`python -m hetsched console --port 0` with ``env``; the URLs it prints. SIGTERM at the end must be a
    clean stop (exit 0)."""
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hetsched", "console", "--port", "0"],
            env=dict(env),
            stdout=subprocess.PIPE,
            stderr=err,
            cwd=cwd,
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
        assert proc.wait(timeout=30) == 0, log.read_text()
