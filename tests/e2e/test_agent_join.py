"""A node's agent joins the stack `hetsched up` started, exactly as the README says, and every process
NATS refuses (no credential, a wrong one, a revoked one, another identity's inbox) exits within seconds
with one line naming the setting to fix, instead of reconnecting forever.

One `hetsched up` serves the module (its start is the slow part); the last test breaks one of its
services' credentials on purpose."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hetsched.stack import wait_healthy
from services.registry import SERVICES
from shared.contracts.permissions import agent_identity, inbox_prefix
from shared.contracts.subjects import Subjects
from shared.infra.identity import new_seed, write_secret
from shared.infra.refusal import REFUSED_EXIT
from tests.waiting import wait_for_sync

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180.0  # how long to wait before calling a start failed (not a timing assertion)
REFUSED_WITHIN_S = 15.0  # a refused process is gone well within this (it takes about a second)
SNIPPET_NODE = "gpu-node-07"  # the node the README's agent snippet joins
A100_80GB_BYTES = 81920 * 2**20  # the shipped sample's memory.total, 81920 MiB per GPU


@dataclass
class Stack:
    data_dir: Path
    env: dict[str, str]  # HETSCHED_DATA_DIR names the stack, nothing else from the environment
    state: dict[str, Any]
    up: subprocess.Popen[str]

    @property
    def nats_url(self) -> str:
        return str(self.state["nats_url"])

    def cli(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "hetsched.cli", *args],
            env={**self.env, **env},
            capture_output=True,
            text=True,
            timeout=60,
        )

    def fleet_node(self, name: str) -> dict[str, Any] | None:
        shown = self.cli("fleet", "--json")
        assert shown.returncode == 0, shown.stdout + shown.stderr
        return next((n for n in json.loads(shown.stdout)["nodes"] if n["name"] == name), None)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    data_dir = tmp_path_factory.mktemp("agent-join") / "data"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETSCHED_")}  # no URLs: embedded servers
    env["HETSCHED_DATA_DIR"] = str(data_dir)  # as a user's default data dir: no --data-dir anywhere
    up = subprocess.Popen(
        [sys.executable, "-m", "hetsched.cli", "up"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    state_file = data_dir / "stack.json"
    try:

        def launched() -> bool:
            assert up.poll() is None, f"hetsched up exited early:\n{up.stdout.read() if up.stdout else ''}"
            return state_file.exists()

        wait_for_sync(launched, START_TIMEOUT_S, what="stack.json appears")
        state = json.loads(state_file.read_text())
        health = asyncio.run(
            wait_healthy(
                nats_url=state["nats_url"],
                subjects=Subjects(state["subject_prefix"]),
                deadline_s=START_TIMEOUT_S,
                nkeys_seed=state["nats_nkey_seed_file"],
            )
        )
        assert {p: r["status"] for p, r in health.items()} == {p: "ok" for p in SERVICES}
        yield Stack(data_dir=data_dir, env=env, state=state, up=up)
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            up.kill()
            up.communicate()


def readme_agent_snippet() -> str:
    """The README's agent snippet, as printed: the bash block that starts the topology agent."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), flags=re.DOTALL)
    found = [b for b in blocks if "HETSCHED_TOPOLOGY_MODE=agent" in b]
    assert len(found) == 1, f"expected one README block that starts an agent, found {len(found)}"
    return found[0]


def checkout(tmp: Path) -> Path:
    """A directory the README's commands run in as in a checkout: `.venv/bin/python` and
    `.venv/bin/hetsched` are this interpreter, `shared/` is the repository's (its shipped samples)."""
    root = tmp / "checkout"
    bin_dir = root / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    # Scripts, not links: an interpreter finds its virtual environment next to the path it was started as.
    for name, command in (("python", ""), ("hetsched", " -m hetsched.cli")):
        script = bin_dir / name
        script.write_text(f'#!/bin/sh\nexec "{sys.executable}"{command} "$@"\n')
        script.chmod(0o755)
    (root / "shared").symlink_to(REPO / "shared")
    return root


def stop_group(proc: subprocess.Popen[str]) -> str:
    """Stop a process started in its own session (the snippet's shell and the agent under it); its output."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    return out or ""


def run_refused(command: list[str], env: dict[str, str]) -> tuple[int, list[str], float]:
    """Run a process NATS should refuse: its exit status, its output lines, how long it took."""
    started = time.monotonic()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=REFUSED_WITHIN_S, cwd=REPO)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        raise AssertionError(f"still running after {REFUSED_WITHIN_S}s (a reconnect loop?):\n{out[-3000:]}") from exc
    return done.returncode, (done.stdout + done.stderr).splitlines(), time.monotonic() - started


def naming(lines: list[str], setting: str) -> list[str]:
    return [line for line in lines if setting in line]


AGENT_ENV = {
    "HETSCHED_TOPOLOGY_MODE": "agent",
    "HETSCHED_TOPOLOGY_PROVIDER": "nvidia-smi",
    "HETSCHED_TOPOLOGY_SMI_TOPO_FILE": str(REPO / "shared/catalog/topo/dgx-a100-8.txt"),
    "HETSCHED_TOPOLOGY_SMI_QUERY_FILE": str(REPO / "shared/catalog/topo/dgx-a100-8.query.csv"),
    "HETSCHED_LOG_FORMAT": "text",
}
AGENT = [sys.executable, "-m", "services.topology_discovery"]


def test_the_readme_agent_snippet_joins_the_fleet(stack: Stack, tmp_path: Path) -> None:
    """Pasted after `hetsched up`, the README's snippet issues the node's credential and starts its agent,
    which reports the node: `hetsched fleet --json` lists it up, with the sample's eight 80 GB A100s in
    one fully connected NVLink domain."""
    snippet = readme_agent_snippet()
    assert "credentials issue --agent" in snippet, snippet  # the agent needs its node's credential
    shell = subprocess.Popen(
        ["bash", "-euc", snippet],
        cwd=checkout(tmp_path),
        env=stack.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:

        def joined() -> dict[str, Any] | None:
            assert shell.poll() is None, f"the snippet exited with {shell.returncode}:\n{stop_group(shell)}"
            node = stack.fleet_node(SNIPPET_NODE)
            return node if node is not None and node["state"] == "up" else None

        node = wait_for_sync(joined, 60, interval_s=0.5, what=f"{SNIPPET_NODE} in `hetsched fleet --json`, up")
        assert node["region"] == "us-west-1" and node["sku"] == "A100-SXM-80GB" and node["kind"] == "fully_connected"
        assert [a["hbm_total_bytes"] for a in node["accelerators"]] == [A100_80GB_BYTES] * 8
        assert len({a["domain"] for a in node["accelerators"]}) == 1
    finally:
        out = stop_group(shell)
    assert "Authorization Violation" not in out and "Permissions Violation" not in out, out[-3000:]


def test_an_agent_without_a_credential_exits_with_one_line(stack: Stack) -> None:
    """The README's agent command as it was (no credential): refused, it exits 78 within seconds with one
    line naming HETSCHED_NATS_NKEY_SEED_FILE, instead of hundreds of "Authorization Violation" lines."""
    env = {**stack.env, **AGENT_ENV, "HETSCHED_NATS_URL": stack.nats_url, "HETSCHED_TOPOLOGY_NODE": "no-cred-01"}
    code, lines, took = run_refused(AGENT, env)
    print(f"\nan agent without a credential exited {code} after {took:.1f}s with {len(lines)} line(s)")
    assert code == REFUSED_EXIT, lines
    refusal = naming(lines, "HETSCHED_NATS_NKEY_SEED_FILE")
    assert len(refusal) == 1 and f"NATS at {stack.nats_url} refused this client (Authorization Violation)" in refusal[0]
    assert "credentials issue --agent" in refusal[0]
    assert len(lines) <= 3, lines  # its start line and the refusal: no tracebacks, no loop


def test_a_service_with_a_wrong_credential_exits_with_one_line(stack: Stack, tmp_path: Path) -> None:
    """A service (placement) whose seed the server does not admit, and one whose seed file is missing:
    each exits 78 within seconds with one line naming the seed file and the setting."""
    wrong = tmp_path / "wrong.nk"
    write_secret(wrong, new_seed())
    base = {
        **stack.env,
        "HETSCHED_NATS_URL": stack.nats_url,
        # The stack's own database: a service checks its database before NATS (a missing one exits 2).
        "HETSCHED_DATABASE_URL": str(stack.state["database_url"]),
        "HETSCHED_LOG_FORMAT": "text",
        "HETSCHED_METRICS_PORT": "-1",
    }
    for seed, words in ((wrong, "refused the NKey in"), (tmp_path / "missing.nk", "No such file or directory")):
        env = {**base, "HETSCHED_NATS_NKEY_SEED_FILE": str(seed)}
        code, lines, took = run_refused([sys.executable, "-m", "services.placement"], env)
        print(f"\nplacement with {seed.name} exited {code} after {took:.1f}s with {len(lines)} line(s)")
        assert code == REFUSED_EXIT, lines
        refusal = naming(lines, "HETSCHED_NATS_NKEY_SEED_FILE")
        assert len(refusal) == 1 and words in refusal[0] and str(seed) in refusal[0], lines
        assert len(lines) <= 3, lines


def test_an_agent_with_another_identitys_inbox_exits_naming_the_inbox_setting(stack: Stack, tmp_path: Path) -> None:
    """The node's credential but the default inbox prefix: its replies are refused, so it exits naming
    HETSCHED_NATS_INBOX_PREFIX (not waiting for answers that cannot come)."""
    seed = tmp_path / "inbox-01.nk"
    issued = stack.cli("credentials", "issue", "--agent", "inbox-01", "--out", str(seed))
    assert issued.returncode == 0, issued.stdout + issued.stderr
    env = {
        **stack.env,
        **AGENT_ENV,
        "HETSCHED_NATS_URL": stack.nats_url,
        "HETSCHED_TOPOLOGY_NODE": "inbox-01",
        "HETSCHED_NATS_NKEY_SEED_FILE": str(seed),
    }
    code, lines, _took = run_refused(AGENT, env)
    assert code == REFUSED_EXIT, lines
    refusal = naming(lines, "HETSCHED_NATS_INBOX_PREFIX")
    assert len(refusal) == 1 and "(Permissions Violation)" in refusal[0], lines


def test_a_running_agent_whose_credential_is_revoked_exits_with_one_line(stack: Stack, tmp_path: Path) -> None:
    """An agent that was up, then revoked (`hetsched credentials revoke`): it exits 78 with the line,
    once, instead of reconnecting forever."""
    seed = tmp_path / "revoked-01.nk"
    assert stack.cli("credentials", "issue", "--agent", "revoked-01", "--out", str(seed)).returncode == 0
    env = {
        **stack.env,
        **AGENT_ENV,
        "HETSCHED_NATS_URL": stack.nats_url,
        "HETSCHED_TOPOLOGY_NODE": "revoked-01",
        "HETSCHED_NATS_NKEY_SEED_FILE": str(seed),
        "HETSCHED_NATS_INBOX_PREFIX": inbox_prefix(agent_identity("revoked-01")),
    }
    agent = subprocess.Popen(
        AGENT, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        wait_for_sync(
            lambda: (stack.fleet_node("revoked-01") or {}).get("state") == "up", 60, interval_s=0.5, what="agent up"
        )
        revoked = stack.cli("credentials", "revoke", agent_identity("revoked-01"))
        assert revoked.returncode == 0, revoked.stdout + revoked.stderr
        started = time.monotonic()
        wait_for_sync(lambda: agent.poll() is not None, REFUSED_WITHIN_S, what="the revoked agent exits")
        print(f"\na revoked agent exited {agent.returncode} {time.monotonic() - started:.1f}s after the revocation")
    finally:
        out = stop_group(agent)
    assert agent.returncode == REFUSED_EXIT, out[-3000:]
    refusal = naming(out.splitlines(), "HETSCHED_NATS_NKEY_SEED_FILE")
    assert len(refusal) == 1 and "refused the NKey in" in refusal[0], out[-3000:]
    assert "Traceback" not in out.split(refusal[0])[1], out[-3000:]  # after the line: a clean stop


def test_the_cli_refused_exits_2_with_one_line(stack: Stack, tmp_path: Path) -> None:
    """`hetsched fleet`, `status` and `console` with a seed the server does not admit, and with none at all
    (a data dir with no operator seed): exit 2, one line on stderr naming the setting."""
    wrong = tmp_path / "wrong-cli.nk"
    write_secret(wrong, new_seed())
    for args in (("fleet", "--json"), ("status", "--json"), ("console", "--port", "0")):
        shown = stack.cli(*args, HETSCHED_NATS_NKEY_SEED_FILE=str(wrong))
        assert shown.returncode == 2 and shown.stdout == "", shown.stdout + shown.stderr
        assert shown.stderr.startswith("error: ") and len(shown.stderr.splitlines()) == 1, shown.stderr
        assert "HETSCHED_NATS_NKEY_SEED_FILE" in shown.stderr and str(wrong) in shown.stderr
    bare = stack.cli("fleet", HETSCHED_NATS_URL=stack.nats_url, HETSCHED_DATA_DIR=str(tmp_path / "elsewhere"))
    assert bare.returncode == 2 and len(bare.stderr.splitlines()) == 1, bare.stdout + bare.stderr
    assert "refused this client (Authorization Violation)" in bare.stderr and "--data-dir" in bare.stderr


def test_replicas_lists_what_place_made_per_tenant(stack: Stack, tmp_path: Path) -> None:
    """Two tenants' gateways place through the CLI with their own credentials: `hetsched replicas` with a
    gateway's credential lists that tenant's replicas only, the operator's lists both; `hetsched renew`
    moves the lease end it shows; one gateway cannot renew the other's replica."""
    seeds = {tenant: tmp_path / f"{tenant}-gw.nk" for tenant in ("acme", "globex")}
    placed: dict[str, str] = {}
    for tenant, seed in seeds.items():
        issued = stack.cli("credentials", "issue", "--tenant", tenant, "--out", str(seed))
        assert issued.returncode == 0, issued.stdout + issued.stderr
        shown = stack.cli(
            "place", "--model", "llama3-8b", "--context-tokens", "4096", "--json", "--credential", str(seed)
        )
        assert shown.returncode == 0, shown.stdout + shown.stderr
        reply = json.loads(shown.stdout)
        assert reply["status"] == "placed", reply
        placed[tenant] = reply["allocation_id"]

    def listed(*args: str) -> dict[str, dict[str, Any]]:
        shown = stack.cli("replicas", "--json", *args)
        assert shown.returncode == 0, shown.stdout + shown.stderr
        return {r["replica_id"]: r for r in json.loads(shown.stdout)["replicas"]}

    for tenant, seed in seeds.items():
        own = listed("--credential", str(seed))
        assert set(own) == {placed[tenant]} and own[placed[tenant]]["tenant"] == tenant, own
        assert own[placed[tenant]]["model"] == "llama3-8b" and own[placed[tenant]]["placements"], own
    everyone = listed()
    assert set(placed.values()) <= set(everyone), everyone
    table = stack.cli("replicas", "--wide", "--credential", str(seeds["acme"]))
    assert table.returncode == 0 and placed["acme"] in table.stdout and placed["globex"] not in table.stdout, table

    acme_id = placed["acme"]
    before = listed("--credential", str(seeds["acme"]))[acme_id]["lease_expires_at"]
    renewed = stack.cli("renew", acme_id, "--lease-s", "7200", "--credential", str(seeds["acme"]))
    assert renewed.returncode == 0 and "renewed" in renewed.stdout, renewed.stdout + renewed.stderr
    after = listed("--credential", str(seeds["acme"]))[acme_id]["lease_expires_at"]
    assert before is not None and after is not None and after > before, (before, after)
    other = stack.cli("renew", placed["globex"], "--tenant", "globex", "--credential", str(seeds["acme"]))
    assert other.returncode == 1 and "forbidden" in other.stderr, other.stdout + other.stderr


def test_up_on_a_server_that_refuses_its_credential_exits_2_with_one_line(stack: Stack, tmp_path: Path) -> None:
    """`hetsched up` on an existing NATS (the stack's) with an operator seed the server does not admit: exit 2
    at once with one line naming the setting, before it migrates or starts anything."""
    wrong = tmp_path / "wrong-up.nk"
    write_secret(wrong, new_seed())
    data_dir = tmp_path / "second"
    started = time.monotonic()
    shown = stack.cli(
        "up",
        "--data-dir",
        str(data_dir),
        HETSCHED_NATS_URL=stack.nats_url,
        HETSCHED_DATABASE_URL=str(stack.state["database_url"]),
        HETSCHED_NATS_NKEY_SEED_FILE=str(wrong),
    )
    took = time.monotonic() - started
    print(f"\nup refused by NATS exited {shown.returncode} after {took:.1f}s")
    assert shown.returncode == 2, shown.stdout + shown.stderr
    errors = [line for line in shown.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "HETSCHED_NATS_NKEY_SEED_FILE" in errors[0] and str(wrong) in errors[0], shown.stderr
    assert "migrations at head" not in shown.stdout and not (data_dir / "logs" / "placement.log").exists()


def test_a_supervised_service_refused_logs_one_line_per_restart(stack: Stack) -> None:
    """Last (it breaks the stack's rebalancer): the rebalancer's seed replaced by one the server does not
    admit, and the process killed. `hetsched up` restarts it with its backoff; each attempt exits 78 and
    adds one refusal line to its log, not a reconnect loop's hundreds."""
    package = "rebalancer"
    log = stack.data_dir / "logs" / f"{package}.log"
    seed = stack.data_dir / "nats" / "identities" / f"svc_{SERVICES[package].schema}.nk"
    assert seed.exists(), sorted(p.name for p in seed.parent.iterdir())
    write_secret(seed, new_seed())
    before = len(log.read_text().splitlines())
    pid = json.loads((stack.data_dir / "stack.json").read_text())["services"][package]
    os.kill(pid, signal.SIGKILL)

    def attempts() -> list[str]:
        lines = log.read_text().splitlines()[before:]
        return naming(lines, "HETSCHED_NATS_NKEY_SEED_FILE")

    refused = wait_for_sync(lambda: len(attempts()) >= 3 and attempts(), 60, interval_s=0.5, what="three refusals")
    new_lines = log.read_text().splitlines()[before:]
    starts = [line for line in new_lines if "FastStream app starting" in line]
    print(f"\n{len(starts)} restarts of a refused {package}: {len(new_lines)} log lines")
    assert all("refused the NKey in" in line for line in refused)
    assert len(refused) in (len(starts), len(starts) - 1)  # the newest attempt may still be connecting
    assert len(new_lines) <= 3 * len(starts), new_lines[-20:]
