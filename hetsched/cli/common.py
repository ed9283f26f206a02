"""What every `hetsched` command shares: the consoles, the options, where the running stack is, one RPC
session, the way replies are printed, and one way out for bad input (one line on stderr, exit 2)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar, cast

import typer
from pydantic import BaseModel, ValidationError
from rich.console import Console
from typer.core import TyperGroup

from hetsched.stack import operator_options, read_state
from shared.contracts.subjects import Rpc, Subjects
from shared.infra.refusal import NatsRefused
from shared.infra.rpc import RpcClient
from shared.infra.settings import Settings, load_settings

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"  # where a stack without HETSCHED_NATS_URL or a state file listens
BAD_INPUT_EXIT = 2
REJECTED_EXIT = 1

console = Console()
err = Console(stderr=True)

DataDirOption = Annotated[
    Path | None,
    typer.Option(help="Data dir of `hetsched up` (its state file, NATS and identities); default as `up`."),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON.")]
TenantOption = Annotated[str, typer.Option(help="Tenant.")]
RequestIdOption = Annotated[str | None, typer.Option(help="Request id (random by default).")]

ReplyT = TypeVar("ReplyT")
ModelT = TypeVar("ModelT", bound=BaseModel)


# -- bad input: one line, exit 2 ------------------------------------------------------------------------------


def bad_input(message: str) -> NoReturn:
    """Input the command cannot use (an option, a combination, a file, what the contract or the service
    refused in it): one line on stderr saying what is wrong and what is allowed, exit 2."""
    _print_error(message)
    raise typer.Exit(BAD_INPUT_EXIT)


def _print_error(message: str) -> None:
    """``error: MESSAGE`` on one line (pydantic's "Value error, " prefix says nothing to a user)."""
    line = " ".join(message.replace("Value error, ", "").split())
    err.print(f"error: {line}", style="red", markup=False, highlight=False, soft_wrap=True)


# A contract field and the option that sets it, where their names differ.
_OPTION_OF_FIELD = {"skus": "--sku", "accelerators": "--accelerator", "origin_region": "--origin"}


def _option(loc: Sequence[int | str]) -> str:
    """The option a pydantic error location comes from: its last named field (``("slo", "ttft_ms")``
    is ``--ttft-ms``, ``("skus", 0)`` is ``--sku``); the whole request for a rule over several fields."""
    names = [part for part in loc if isinstance(part, str)]
    if not names:
        return "the request"
    return _OPTION_OF_FIELD.get(names[-1], "--" + names[-1].replace("_", "-"))


def contract_refusal(exc: ValidationError) -> str:
    """A request the contract refused, in one line: each option, what is allowed and what it got."""
    parts = []
    for error in exc.errors(include_url=False):
        message = str(error["msg"])
        got = error.get("input")
        suffix = f", got {got!r}" if error["loc"] and not isinstance(got, dict) else ""
        parts.append(f"{_option(error['loc'])}: {message}{suffix}")
    return "; ".join(parts)


def build(make: Callable[[], ModelT]) -> ModelT:
    """The request, or exit 2 with what the contract refused in it (the answer the service would give)."""
    try:
        return make()
    except ValidationError as exc:
        bad_input(contract_refusal(exc))


def _click_error() -> type[Exception]:
    """click's ClickException (typer vendors click in newer releases): the base of the usage errors."""
    found = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
    return cast(type[Exception], found)


_CLICK_ERROR = _click_error()


class OneLineErrors(TyperGroup):
    """The root command: a usage error (unknown option, missing one, a choice not allowed) prints one line
    naming it and what is allowed, as the commands' own checks do, instead of a usage panel."""

    def make_context(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().make_context(*args, **kwargs)
        except _CLICK_ERROR as exc:
            _usage_error(exc)

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except _CLICK_ERROR as exc:
            _usage_error(exc)


def _usage_error(exc: Exception) -> NoReturn:
    if type(exc).__name__ == "NoArgsIsHelpError":  # `hetsched` alone: the help, as before
        raise exc
    format_message = getattr(exc, "format_message", lambda: str(exc))
    _print_error(str(format_message()))
    raise typer.Exit(getattr(exc, "exit_code", BAD_INPUT_EXIT))


# -- where the stack is, and one RPC session ------------------------------------------------------------------


def settings_of(data_dir: Path | None = None) -> Settings:
    return load_settings(kit={"data_dir": data_dir}) if data_dir else load_settings()


def endpoints(settings: Settings) -> tuple[str, str | None, str]:
    """NATS URL, database URL and subject prefix: from the environment, else a running `hetsched up`."""
    state = read_state(settings) or {}
    nats_url = settings.kit.nats_url or state.get("nats_url") or DEFAULT_NATS_URL
    database_url = settings.kit.database_url or state.get("database_url")
    prefix = (
        state.get("subject_prefix", settings.kit.subject_prefix)
        if not settings.kit.nats_url
        else settings.kit.subject_prefix
    )
    return nats_url, database_url, prefix


def with_rpc(data_dir: Path | None, what: str, work: Callable[[RpcClient], Awaitable[ReplyT]]) -> ReplyT:
    """Run ``work`` with a client on the stack's NATS (timeout: ``HETSCHED_REQUEST_TIMEOUT_MS``); no
    answer exits 2 and says where it asked. Tests replace it (tests/unit/cli_fake.py): commands call it
    through this module, never a copy of the name."""
    settings = settings_of(data_dir)
    nats_url, _db, prefix = endpoints(settings)

    async def session() -> ReplyT:
        rpc = await RpcClient.connect(
            nats_url,
            Subjects(prefix),
            timeout_s=settings.kit.request_timeout_ms / 1000,
            name="hetsched-cli",
            operator=True,
            **operator_options(settings),
        )
        try:
            return await work(rpc)
        finally:
            await rpc.close()

    try:
        return asyncio.run(session())
    except NatsRefused as refused:  # its credential: one line naming the setting to fix
        bad_input(refused.line)
    except Exception as exc:
        err.print(f"[red]no answer from {what} at {nats_url}: {type(exc).__name__} {exc}[/red]")
        raise typer.Exit(2) from exc


def ask(
    data_dir: Path | None, rpc: Rpc, request: BaseModel, reply_type: type[ModelT], *, rejection_as_reply: bool = False
) -> Any:
    """One call: the reply, or the ``Rejected`` a service refuses with. ``rejection_as_reply``: only for
    the routes whose reply model still carries its refusal (``placement.place``/``explain``: the
    ``PlaceReply`` with its explanation); the service refusing the body as ``invalid_request`` is bad
    input (exit 2)."""

    async def work(client: RpcClient) -> Any:
        if rejection_as_reply:
            return await client.ask(rpc, request, reply_type, rejection_as_reply=True)
        return await client.ask(rpc, request, reply_type)  # the client's default: a refusal comes as Rejected

    reply = with_rpc(data_dir, rpc.value, work)
    refused_input(reply)
    return reply


def refused_input(reply: BaseModel) -> None:
    """A reply that refuses the request as malformed (``invalid_request``) exits 2 as bad input does."""
    error = getattr(reply, "error", None)
    if getattr(reply, "status", None) == "rejected" and getattr(error, "code", None) == "invalid_request":
        bad_input(f"invalid_request: {getattr(error, 'message', '')}")


def request_id(given: str | None) -> str:
    return given or f"cli-{uuid.uuid4().hex[:12]}"


# -- printing replies ------------------------------------------------------------------------------------------


def print_reply(reply: BaseModel, as_json: bool) -> None:
    """A reply exactly as the service sent it (its contract model), as JSON; a refusal exits 1."""
    text = reply.model_dump_json(indent=2)
    if as_json:
        print(text)
    else:
        console.print_json(text)
    if getattr(reply, "status", None) == "rejected":
        raise typer.Exit(REJECTED_EXIT)


def refusal(reply: BaseModel, as_json: bool) -> None:
    """A `rejected` reply exits 1 with its code and message on stderr (after the JSON with --json)."""
    if getattr(reply, "status", None) != "rejected":
        return
    if as_json:
        print(reply.model_dump_json(indent=2))
    error = getattr(reply, "error", None)
    what = f"{error.code}: {error.message}" if error is not None else "no reason given"
    err.print(f"rejected: {what}", style="red", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(REJECTED_EXIT)


def shown(
    data_dir: Path | None, rpc: Rpc, request: BaseModel, reply_type: type[ModelT], as_json: bool
) -> ModelT | None:
    """Ask; a refusal exits 1 (``refusal``); with --json the reply is printed and None comes back (nothing
    more to show); otherwise the reply, for the command to show in words."""
    answer = ask(data_dir, rpc, request, reply_type)
    refusal(answer, as_json)
    if as_json:
        print(answer.model_dump_json(indent=2))
        return None
    assert isinstance(answer, reply_type)
    return answer


def fraction(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def say(text: str) -> None:
    """One line as it is: no markup, no highlighting, never folded (ids are copied from it)."""
    console.print(text, markup=False, highlight=False, soft_wrap=True)


def columns(headers: list[str], rows: list[list[str]]) -> None:
    """A plain table, each column as wide as its widest cell: nothing is cut or folded to fit the
    terminal (an id is copied from it into `--cancel`), and `awk` reads it."""
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows, strict=False)]
    for line in [headers, *rows]:
        say("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip())
