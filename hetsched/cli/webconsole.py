"""`hetsched console`: the operators' live web page of the fleet, served from this process."""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer

from hetsched.cli.common import DataDirOption, bad_input, endpoints, err, settings_of
from hetsched.stack import operator_options
from shared.infra.refusal import NatsRefused

app = typer.Typer()


@app.command("console")
def console_page(
    port: Annotated[int, typer.Option(help="Port to serve on (0: any free port; the URL is printed).")] = 8470,
    host: Annotated[
        str, typer.Option(help="Address to listen on. The page shows operator data: keep it on loopback.")
    ] = "127.0.0.1",
    data_dir: DataDirOption = None,
) -> None:
    """Operators: a live web page of the fleet (a summary per region, cluster and SKU of GPUs placed, lent,
    reserved and free, with HBM, fill and alerts; a group's nodes and a node's GPUs and NVLink domains on
    click; TPU pods with their slices), reservations and fill rate, recent placements with their
    explanations, and the rebalancer; it polls every second. Read-only; connects to NATS as the other
    commands do. Ctrl-C stops it.

    It answers only with its token (printed at start in a URL that logs the browser in, or
    HETSCHED_CONSOLE_TOKEN) and only to the Host names of HETSCHED_CONSOLE_ALLOWED_HOSTS (loopback)."""
    import secrets

    from hetsched.console.server import run_console
    from shared.infra.httpserver import Limits

    settings = settings_of(data_dir)
    nats_url, _db, prefix = endpoints(settings)
    # An empty HETSCHED_CONSOLE_TOKEN (a compose file's blank) counts as unset.
    configured = (settings.console.token.get_secret_value() if settings.console.token is not None else "") or None
    if configured is not None and len(configured) < 16:
        bad_input("console: HETSCHED_CONSOLE_TOKEN must be at least 16 characters")
    token = configured or secrets.token_urlsafe(32)

    def announce(url: str) -> None:
        print(f"hetsched console at {url}", flush=True)
        if configured is None:  # printed once: the URL logs the browser in (an HttpOnly cookie)
            hint = "a new token at each start; HETSCHED_CONSOLE_TOKEN sets one"
            print(f"open {url}login?token={token}  ({hint})", flush=True)
        else:
            print(f"log in at {url}login with the token of HETSCHED_CONSOLE_TOKEN", flush=True)

    try:
        asyncio.run(
            run_console(
                nats_url=nats_url,
                subject_prefix=prefix,
                stream_prefix=settings.kit.stream_prefix,
                host=host,
                port=port,
                timeout_s=settings.kit.request_timeout_ms / 1000,
                connect_options=operator_options(settings),
                token=token,
                allowed_hosts=settings.console.allowed_hosts,
                limits=Limits(
                    max_connections=settings.console.max_connections, read_timeout_s=settings.console.read_timeout_s
                ),
                announce=announce,
            )
        )
    except NatsRefused as refused:  # its credential: one line naming the setting to fix
        bad_input(refused.line)
    except OSError as exc:
        err.print(f"[red]console: {type(exc).__name__} {exc} (NATS at {nats_url}, http on {host}:{port})[/red]")
        raise typer.Exit(2) from exc
