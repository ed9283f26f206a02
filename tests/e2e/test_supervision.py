"""`hetsched up` supervises its embedded servers: a SIGKILLed nats-server or Postgres is reaped and
restarted on its port with its data, the state file names the new pid, and the services ride it out
(healthy again, `hetsched place` works); a server that cannot come back stops `up` naming it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from hetsched.stack import ServerDied, Stack, server_liveness
from services.registry import SERVICES
from shared.infra.settings import Settings
from tests.waiting import wait_for_sync

pytestmark = pytest.mark.e2e

START_TIMEOUT_S = 180.0  # how long to wait before calling a start failed (not a timing assertion)
RECOVER_TIMEOUT_S = 120.0  # how long the stack may take to be whole again after a server is killed


def _reaped(pid: int, *, parent: int) -> bool:
    """The killed server is gone and no zombie of it is left under ``parent``."""
    try:
        proc = psutil.Process(pid)
        return not (proc.ppid() == parent and proc.status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def _cli(data_dir: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hetsched.cli", *args, "--data-dir", str(data_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _whole_again(data_dir: Path, env: dict[str, str], request_id: str) -> dict[str, Any]:
    """Wait for `hetsched status` to show every service healthy, then for a placement to succeed."""
    last: list[subprocess.CompletedProcess[str]] = []

    def healthy() -> dict[str, Any] | None:
        last.append(_cli(data_dir, env, "status", "--json"))
        return json.loads(last[-1].stdout) if last[-1].returncode == 0 else None

    try:
        report = wait_for_sync(healthy, RECOVER_TIMEOUT_S, interval_s=0.5, what="hetsched status: all healthy")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{last[-1].stdout}{last[-1].stderr}") from exc
    assert len(report["services"]) == len(SERVICES) and all(s["status"] == "ok" for s in report["services"].values())
    place = (
        "place",
        *("--model", "llama3-8b", "--tenant", "acme", "--context-tokens", "4096", "--backend", "gpu"),
        *("--request-id", request_id, "--json"),
    )

    def placed() -> dict[str, Any] | None:
        last.append(_cli(data_dir, env, *place))
        return json.loads(last[-1].stdout) if last[-1].returncode == 0 else None

    try:
        reply = wait_for_sync(placed, RECOVER_TIMEOUT_S, interval_s=0.5, what=f"hetsched place {request_id}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{last[-1].stdout}{last[-1].stderr}") from exc
    assert reply["status"] == "placed" and reply["allocation_id"]
    return report


def test_up_restarts_a_killed_nats_server_and_postgres(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETSCHED_")}  # embedded servers
    up = subprocess.Popen(
        [sys.executable, "-m", "hetsched.cli", "up", "--data-dir", str(data_dir)],
        env={**env, "COLUMNS": "200"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    state_file = data_dir / "stack.json"
    out = ""
    try:

        def launched() -> bool:
            assert up.poll() is None, f"hetsched up exited early:\n{up.stdout.read() if up.stdout else ''}"
            return state_file.exists()

        wait_for_sync(launched, START_TIMEOUT_S, what="stack.json appears")
        _whole_again(data_dir, env, "sup-before")
        state = json.loads(state_file.read_text())

        for server, key in (("nats", "nats_pid"), ("postgres", "postgres_pid")):
            old = int(state["servers"][key])
            os.kill(old, signal.SIGKILL)

            def restarted(key: str = key, old: int = old) -> dict[str, Any] | None:
                assert up.poll() is None, "hetsched up exited instead of restarting the server"
                now: dict[str, Any] = json.loads(state_file.read_text())
                return now if now["servers"][key] not in (None, old) else None

            state = wait_for_sync(restarted, RECOVER_TIMEOUT_S, interval_s=0.1, what=f"{server} restarted")
            new = int(state["servers"][key])
            assert psutil.Process(new).ppid() == up.pid  # the supervisor's own child, on the same port
            assert state["nats_url"] == json.loads(state_file.read_text())["nats_url"]
            wait_for_sync(lambda old=old: _reaped(old, parent=up.pid), 10, what=f"old {server} pid {old} reaped")
            report = _whole_again(data_dir, env, f"sup-after-{server}")
            assert report["servers"][server] == {"pid": new, "running": True}
        assert server_liveness(state) == {
            "nats": {"pid": state["servers"]["nats_pid"], "running": True},
            "postgres": {"pid": state["servers"]["postgres_pid"], "running": True},
        }
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            out, _ = up.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            up.kill()
            raise
    assert up.returncode == 0, out
    # Loud: the operator reads which server died and that it came back.
    assert "embedded nats-server" in out and "embedded postgres" in out and "restarted" in out, out
    assert not state_file.exists()


def test_a_server_that_cannot_come_back_is_named(tmp_path: Path) -> None:
    """Its port taken while it was down: `up` gives up after its tries, naming the dead server."""
    # A database URL: no embedded Postgres (the stack never connects to it here).
    settings = Settings(
        kit={"data_dir": tmp_path, "nats_url": None, "database_url": "postgresql://unused@127.0.0.1:1/x"}
    )
    said: list[str] = []
    stack = Stack(settings, echo=said.append)
    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        stack.start_servers()
        assert stack.nats is not None and stack.nats.proc is not None and stack.postgres is None
        stack.write_state()
        old = stack.nats.proc
        old.kill()
        old.wait()
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", stack.nats.port))
        squatter.listen()
        started = time.monotonic()
        with pytest.raises(ServerDied) as died:
            stack.supervise_once()
        assert died.value.server == "nats-server"
        assert "nats-server died" in str(died.value) and str(stack.nats.port) in str(died.value)
        assert any("!!! embedded nats-server" in line for line in said), said
        assert stack.nats.proc.poll() is not None  # the failed tries are reaped too
        print(f"\ngave up after {time.monotonic() - started:.1f}s")
    finally:
        squatter.close()
        stack.stop()
