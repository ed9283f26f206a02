"""`hetsched up` and `hetsched status`: the local stack, started in the foreground, and its health."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from functools import partial
from pathlib import Path
from typing import Annotated, Any

import typer

from hetsched.cli.common import (
    BAD_INPUT_EXIT,
    DataDirOption,
    JsonOption,
    WideOption,
    bad_input,
    console,
    endpoints,
    err,
    fail,
    settings_of,
    table,
)
from hetsched.lock import ALREADY_RUNNING_EXIT, StackLock, StackRunning
from hetsched.stack import ServerDied, Stack, operator_options, read_state, server_liveness, wait_healthy
from services.registry import SERVICES
from shared.contracts.subjects import Subjects
from shared.infra.db import DatabaseMissing
from shared.infra.refusal import NatsRefused

app = typer.Typer()


@app.command()
def up(
    fleet: Annotated[Path | None, typer.Option(help="Fleet inventory file (YAML); a demo fleet by default.")] = None,
    data_dir: Annotated[Path | None, typer.Option(help="Where embedded servers keep their data.")] = None,
    health_timeout_s: Annotated[float, typer.Option(help="How long to wait for the services to be healthy.")] = 60.0,
    engines: Annotated[
        str,
        typer.Option(
            help="`sim`: one node agent per GPU node of the fleet runs a simulated engine (a real OpenAI-compatible "
            "HTTP server) for each replica placed there; `none`: no engines."
        ),
    ] = "none",
) -> None:
    """Start the local stack in the foreground; SIGINT/SIGTERM stops everything cleanly. Another `up`
    running from the same data dir: exit 4 at once, touching nothing."""
    if engines not in ("none", "sim"):
        bad_input(f"--engines must be `sim` or `none`, not {engines!r}")
    settings = settings_of(data_dir)
    try:
        lock = StackLock.acquire(settings.kit.data_dir)  # before anything in the data dir is written
    except StackRunning as exc:
        fail(str(exc), ALREADY_RUNNING_EXIT)
    stack = Stack(settings, echo=partial(console.print, soft_wrap=True), fleet_file=fleet, engines=engines)
    stop_requested = False

    def _on_signal(signum: int, _frame: Any) -> None:
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    started = time.monotonic()
    died: ServerDied | None = None
    try:
        stack.start_servers()
        if stop_requested:
            return
        stack.check_nats()
        console.print(f"NATS      {stack.nats_url}{'  (embedded)' if stack.nats else ''}")
        console.print(f"Postgres  {stack.database_url}{'  (embedded)' if stack.postgres else ''}", soft_wrap=True)
        stack.migrate()
        console.print("migrations at head")
        console.print(f"fleet     {fleet or settings.topology.inventory or 'built-in demo fleet'}")
        stack.create_streams()
        stack.start_services()
        if engines != "none":
            agents = stack.agent_nodes()
            console.print(f"engines   {engines}: {len(agents)} node agents start an engine per replica placed")
        stack.write_state()
        if stack.operator_seed is not None:
            console.print(f"operator  NKey seed {stack.operator_seed} (NATS requires authentication)")
        health = asyncio.run(
            wait_healthy(
                nats_url=stack.nats_url,
                subjects=Subjects(settings.kit.subject_prefix),
                deadline_s=health_timeout_s,
                operator=True,
                **stack.nats_options(),
            )
        )
        for package, reply in health.items():
            console.print(f"  {SERVICES[package].name:<22} {reply.get('status')}")
        gateway_url = (health.get("gateway") or {}).get("http_url")
        if gateway_url:
            console.print(
                f"gateway   {gateway_url}/v1 (OpenAI-compatible; keys: hetsched credentials issue --tenant T --api-key)"
            )
        ok = all(r.get("status") == "ok" for r in health.values())
        console.print(
            f"{'ready' if ok else 'NOT ready'} in {time.monotonic() - started:.1f}s; state in {settings.kit.data_dir}; "
            "Ctrl-C stops everything"
        )
        while not stop_requested:
            stack.supervise_once()
            time.sleep(0.2)
    except DatabaseMissing as exc:
        fail(str(exc), BAD_INPUT_EXIT)
    except NatsRefused as refused:  # the operator's credential: one line naming the setting, no retries
        fail(refused.line, BAD_INPUT_EXIT)
    except ServerDied as exc:
        died = exc
        err.print(f"[bold red]!!! {exc}: stopping the stack[/bold red]")
    finally:
        console.print("stopping...")
        stack.stop()
        lock.release()
        console.print("stopped")
    if died is not None:
        err.print(f"[bold red]hetsched up exits: embedded {died.server} died[/bold red]")
        raise typer.Exit(3)


@app.command()
def status(
    as_json: JsonOption = False,
    wide: WideOption = False,
    data_dir: DataDirOption = None,
) -> None:
    """Health of each service and the NATS and Postgres endpoints in use."""
    settings = settings_of(data_dir)
    nats_url, database_url, prefix = endpoints(settings)
    try:
        health = asyncio.run(
            wait_healthy(
                nats_url=nats_url, subjects=Subjects(prefix), deadline_s=0, operator=True, **operator_options(settings)
            )
        )
    except NatsRefused as refused:  # not the stack's health: this command's credential
        bad_input(refused.line)
    except Exception as exc:
        health = {p: {"status": "down", "error": f"NATS unreachable: {type(exc).__name__}"} for p in SERVICES}
    services = {SERVICES[p].name: r for p, r in health.items()}
    report: dict[str, Any] = {
        "nats_url": nats_url,
        "database_url": database_url,
        "nats_nkey_seed_file": (read_state(settings) or {}).get("nats_nkey_seed_file"),
        "servers": server_liveness(read_state(settings) or {}),
        "services": services,
        "gateway_url": (services.get("gateway") or {}).get("http_url"),
    }
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        console.print(f"NATS      {nats_url}\nPostgres  {database_url}", soft_wrap=True)  # a URL is not folded
        if report["gateway_url"]:
            console.print(
                f"Gateway   {report['gateway_url']}  (OpenAI-compatible: {report['gateway_url']}/v1)", soft_wrap=True
            )
        for server, live in report["servers"].items():
            console.print(f"embedded {server}: pid {live['pid']} {'running' if live['running'] else 'NOT RUNNING'}")
        rows = [
            [name, str(reply.get("status")), str(reply.get("version", "")), _checks(reply, wide=wide)]
            for name, reply in services.items()
        ]
        table(["service", "status", "version", "checks" if wide else "checks not ok (--wide: all)"], rows, wide=wide)
    if not all(r.get("status") == "ok" for r in health.values()):
        raise typer.Exit(1)


def _checks(reply: dict[str, Any], *, wide: bool) -> str:
    """A service's checks: all of them as JSON with --wide; else only those not "ok" (a reply without
    checks says why it has none)."""
    checks = reply.get("checks")
    if not isinstance(checks, dict):
        return str(reply.get("error", "-"))
    if wide:
        return json.dumps(checks)
    failing = {name: value for name, value in checks.items() if value != "ok"}
    return (
        "; ".join(
            f"{name}: {json.dumps(value) if not isinstance(value, str) else value}" for name, value in failing.items()
        )
        or "-"
    )


@app.command()
def gateway() -> None:
    """Run the OpenAI-compatible gateway in the foreground (`hetsched up` starts one): the settings of
    `settings.gateway` (HETSCHED_GATEWAY_*), NATS and Postgres from the environment, as every service."""
    from services.gateway.app import main

    main()
