"""`hetsched fleet` and `hetsched topo parse`: the fleet as the services see it, and one node's
`nvidia-smi topo -m` parsed offline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from hetsched.cli import common
from hetsched.cli.common import DataDirOption, JsonOption, bad_input, console, err, print_reply
from shared.contracts.base import Rejected
from shared.contracts.subjects import Rpc

app = typer.Typer()
topo_app = typer.Typer(help="Topology tools.", no_args_is_help=True)


@app.command()
def fleet(
    region: Annotated[str | None, typer.Option(help="Only this region.")] = None,
    as_json: JsonOption = False,
    data_dir: DataDirOption = None,
) -> None:
    """The fleet as the services see it: nodes, NVLink domains, HBM, TPU pods."""
    reply = common.with_rpc(data_dir, Rpc.FLEET_GET.value, lambda client: client.fleet(region=region))
    common.refused_input(reply)
    if as_json or isinstance(reply, Rejected):
        print_reply(reply, as_json)
        return
    from hetsched.fleet_view import render_fleet

    render_fleet(reply, console)


@topo_app.command("parse")
def topo_parse(
    file: Annotated[Path, typer.Argument(help="A saved `nvidia-smi topo -m` output.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON (API.md shape).")] = False,
) -> None:
    """Parse one `nvidia-smi topo -m` output: GPUs, link matrix, NVLink domains, NUMA/CPU affinity."""
    from hetsched.fleet_view import render_topology, topology_json
    from shared.domain.topology import TopologyParseError, parse_topo_matrix

    try:
        text = file.read_text()
    except OSError as exc:
        bad_input(f"{file}: {exc.strerror}")
    try:
        parsed = parse_topo_matrix(text)
    except TopologyParseError as exc:
        err.print(f"[red]{file}: {exc}[/red]")
        raise typer.Exit(1) from exc
    if as_json:
        print(json.dumps(topology_json(parsed), indent=2))
    else:
        render_topology(parsed, console)
