"""Bad input to `hetsched`, one path: whoever refuses it (Typer for an Enum or a missing option, the
command's own checks, the request contract, or the service answering `invalid_request`), the user
gets one line on stderr naming what is wrong and what is allowed, and exit code 2, before anything
else is printed. And every command the README shows still parses."""

from __future__ import annotations

import re
import shlex
from enum import StrEnum
from pathlib import Path
from typing import Any, get_args

import pytest
import typer
from typer.testing import CliRunner, Result

from hetsched.cli import app, choices
from shared.contracts.base import ErrorBody, Rejected
from shared.contracts.placement import Backend, Dtype, EngineHint, PlaceReply
from shared.contracts.reservation import PolicyName, ReservationCreateReply
from shared.contracts.routing import RegionStateName
from shared.domain.sim import POLICIES
from tests.unit.cli_fake import run_cli

REPO = Path(__file__).resolve().parents[2]
PLACE = ["place", "--model", "llama3-70b", "--tenant", "acme", "--context-tokens", "8192"]
RESERVE = ["reserve", "--tenant", "acme", "--policy", "soft", "--accelerator", "dgx-h100-01/gpu0"]
SIM = ["sim", "--fleet", "shared/catalog/demo_fleet.yaml", "--trace", "tests/fixtures/traces/sim_small.csv"]


def _one_line_exit_2(result: Result) -> str:
    """The stderr line of a refusal: exit 2, nothing on stdout, exactly one line on stderr."""
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


# -- the Enums are the contracts' choices ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("enum", "allowed"),
    [
        (choices.Backend, get_args(Backend)),
        (choices.Dtype, get_args(Dtype)),
        (choices.EngineHint, get_args(EngineHint)),
        (choices.RegionState, get_args(RegionStateName)),
        (choices.SimPolicy, POLICIES),
    ],
)
def test_each_enum_has_exactly_the_contracts_values(enum: type[StrEnum], allowed: tuple[str, ...]) -> None:
    assert [member.value for member in enum] == list(allowed)


def test_the_reservation_policies_are_the_contracts() -> None:
    assert {member.value for member in choices.ReservationPolicy} == set(get_args(PolicyName))


# -- an Enum option given a value it does not list -------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "option", "allowed"),
    [
        ([*PLACE, "--backend", "fpga"], "--backend", "'gpu', 'tpu', 'any'"),
        ([*PLACE, "--dtype", "fp6"], "--dtype", "'fp32', 'bf16', 'fp16', 'fp8', 'int8', 'int4', 'fp4'"),
        (["admit", "--model", "m", "--tenant", "t", "--input-tokens", "1", "--hint", "rnn"], "--hint", "'moe'"),
        (["route-region", "us-east-1", "--state", "closed"], "--state", "'up', 'drain', 'down'"),
        (["reserve", "--tenant", "acme", "--policy", "premium"], "--policy", "'soft', 'hard', 'spot'"),
        ([*SIM, "--policy", "best"], "--policy", "'hetsched', 'gpu-index', 'random', 'first-fit', 'cheapest-sku'"),
        ([*SIM, "--sharing", "sometimes"], "--sharing", "'exclusive', 'shared', 'compare'"),
        ([*SIM, "--bad-rows", "maybe"], "--bad-rows", "'reject', 'skip'"),
    ],
)
def test_an_enum_option_with_a_wrong_value_names_the_allowed_ones(
    monkeypatch: pytest.MonkeyPatch, args: list[str], option: str, allowed: str
) -> None:
    result, client = run_cli(monkeypatch, PlaceReply(status="placed", request_id="r"), *args)
    line = _one_line_exit_2(result)
    assert f"'{option}'" in line and allowed in line
    assert client.calls == []


def test_the_choices_are_listed_in_help() -> None:
    result = CliRunner().invoke(app, ["place", "--help"], terminal_width=200)
    assert result.exit_code == 0
    assert "gpu|tpu|any" in result.stdout


# -- what Typer refuses before the command runs -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["place", "--tenant", "acme", "--context-tokens", "1"], "Missing option '--model'"),
        ([*PLACE, "--gpus", "8"], "No such option: --gpus"),
        ([*PLACE, "--concurrency", "many"], "Invalid value for '--concurrency'"),
        (["placement"], "No such command 'placement'"),
        (["credentials", "issue", "--tenant"], "Option '--tenant' requires an argument"),
    ],
)
def test_a_usage_error_is_one_line(monkeypatch: pytest.MonkeyPatch, args: list[str], says: str) -> None:
    result, client = run_cli(monkeypatch, PlaceReply(status="placed", request_id="r"), *args)
    assert says in _one_line_exit_2(result)
    assert client.calls == []


def test_hetsched_alone_still_prints_its_help() -> None:
    result = CliRunner().invoke(app, [])
    assert result.exit_code == 2
    assert "Commands" in result.stdout and "place" in result.stdout


# -- what the command or the contract refuses -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["reserve", "--tenant", "acme", "--policy", "soft", "--count", "8"], "--sku, --region missing"),
        ([*RESERVE, "--spot-eviction-s", "10"], "--spot-eviction-s: only with --policy spot"),
        ([*PLACE, "--context-tokens", "0"], "--context-tokens: Input should be greater than 0, got 0"),
        ([*PLACE, "--tp", "3"], "--tp: tp must be a power of two, got 3"),
        (["admit", "--model", "m", "--tenant", "t", "--input-tokens", "-1"], "--input-tokens"),
        ([*SIM, "--load", "0"], "--load: expected a positive load, got 0.0"),
        ([*SIM, "--sweep", "--live"], "--load and --sweep: not with --live"),
        ([*SIM, "--reserve", "acme:gold:8:H100-SXM-80GB"], "policy 'gold' is not one of"),
    ],
)
def test_a_malformed_option_the_cli_checks_is_one_line(
    monkeypatch: pytest.MonkeyPatch, args: list[str], says: str
) -> None:
    result, client = run_cli(monkeypatch, PlaceReply(status="placed", request_id="r"), *args)
    assert says in _one_line_exit_2(result)
    assert client.calls == []


# -- the service refusing the body the CLI sent ---------------------------------------------------------------

INVALID = ErrorBody(code="invalid_request", message="model 'llama9' is not in the catalog")


@pytest.mark.parametrize(
    ("args", "reply"),
    [
        (PLACE, PlaceReply(status="rejected", request_id="r", error=INVALID)),
        ([*PLACE, "--json"], PlaceReply(status="rejected", request_id="r", error=INVALID)),
        ([*PLACE, "--emit", "vllm"], PlaceReply(status="rejected", request_id="r", error=INVALID)),
        (RESERVE, ReservationCreateReply(status="rejected", error=INVALID)),
        (["reservations", "--tenant", "acme"], Rejected(request_id="r", error=INVALID)),
        (["rebalance"], Rejected(request_id="r", error=INVALID)),
    ],
)
def test_an_invalid_request_reply_is_bad_input_too(
    monkeypatch: pytest.MonkeyPatch, args: list[str], reply: Any
) -> None:
    result, client = run_cli(monkeypatch, reply, *args)
    assert _one_line_exit_2(result) == "error: invalid_request: model 'llama9' is not in the catalog"
    assert len(client.calls) == 1


def test_any_other_refusal_still_exits_1_with_the_reply(monkeypatch: pytest.MonkeyPatch) -> None:
    full = PlaceReply(status="rejected", request_id="r", error=ErrorBody(code="no_capacity", message="full"))
    result, _client = run_cli(monkeypatch, full, *PLACE, "--json")
    assert result.exit_code == 1
    assert '"no_capacity"' in result.stdout


# -- every command of the README parses -----------------------------------------------------------------------


def _readme_commands() -> list[list[str]]:
    """Each `hetsched ...` line of the README's code blocks (continuations joined), as arguments: comments,
    pipes and `&` cut, `[optional]` brackets dropped, and the first of `a|b` alternatives taken."""
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    commands = []
    for line in lines:
        found = re.search(r"(?:^|&& )(?:\.venv/bin/)?hetsched (.*)", line)
        if not found:
            continue
        command = re.split(r" \| | # | &$|&\s", found.group(1) + " ")[0]
        args = [token.strip("[]").split("|")[0] for token in shlex.split(command)]
        commands.append([a for a in args if a])
    return commands


README_COMMANDS = _readme_commands()


def test_the_readme_shows_the_commands() -> None:
    names = {args[0] for args in README_COMMANDS}
    assert {"up", "status", "fleet", "place", "release", "route", "admit", "reserve", "sim", "credentials"} <= names


@pytest.mark.parametrize("args", README_COMMANDS, ids=[" ".join(a) for a in README_COMMANDS])
def test_each_readme_command_parses(args: list[str]) -> None:
    """Parsed as the command would be (options, values, choices), without running it."""
    root = typer.main.get_command(app)
    ctx = root.make_context("hetsched", [args[0]])
    command: Any = root
    rest = list(args)
    while hasattr(command, "list_commands"):  # a group: down to its subcommand
        name, rest = rest[0], rest[1:]
        command = command.get_command(ctx, name)
        assert command is not None, f"no command {name!r}: {args}"
    command.make_context(name, rest, parent=ctx)  # click's usage error on anything that does not parse
    help_result = CliRunner().invoke(app, [*args[: 2 if args[0] in ("credentials", "topo") else 1], "--help"])
    assert help_result.exit_code == 0, help_result.output
