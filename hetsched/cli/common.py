"""What every `hetsched` command shares: the consoles, the options, where the running stack is, one RPC
session, the way replies are printed, and one way out for bad input (one line on stderr, exit 2)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar, cast

import nkeys
import typer
from pydantic import BaseModel, ValidationError
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text
from typer.core import TyperGroup

from hetsched.lock import stack_running
from hetsched.stack import operator_options, read_state
from shared.contracts.permissions import INBOX, inbox_prefix
from shared.contracts.subjects import TENANT_SCOPED, Rpc, Subjects
from shared.infra.identity import Registry, connect_options, nats_dir, public_key, read_seed
from shared.infra.refusal import NatsRefused
from shared.infra.rpc import RpcClient
from shared.infra.settings import Settings, load_settings

BAD_INPUT_EXIT = 2
NO_STACK_EXIT = 2  # as a stack that does not answer (`with_rpc`)
REJECTED_EXIT = 1

console = Console()
err = Console(stderr=True)

DataDirOption = Annotated[
    Path | None,
    typer.Option(help="Data dir of `hetsched up` (its state file, NATS and identities); default as `up`."),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON.")]
WideOption = Annotated[
    bool, typer.Option("--wide", help="Every column in full, one line per row (no folding to the terminal's width).")
]
TenantOption = Annotated[str, typer.Option(help="Tenant.")]
RequestIdOption = Annotated[str | None, typer.Option(help="Request id (random by default).")]
CredentialOption = Annotated[
    Path | None,
    typer.Option(
        "--credential",
        envvar="HETSCHED_CLI_CREDENTIAL",
        help="Act as a tenant's gateway: the NKey seed file `hetsched credentials issue --tenant T` wrote. Calls go "
        "on the tenant's subjects, as that gateway's; default: the operator's credential.",
    ),
]

ReplyT = TypeVar("ReplyT")
ModelT = TypeVar("ModelT", bound=BaseModel)


# -- bad input: one line, exit 2 ------------------------------------------------------------------------------


def bad_input(message: str) -> NoReturn:
    """Input the command cannot use (an option, a combination, a file, what the contract or the service
    refused in it): one line on stderr saying what is wrong and what is allowed, exit 2."""
    fail(message, BAD_INPUT_EXIT)


def fail(message: str, code: int) -> NoReturn:
    """``error: MESSAGE`` on one line on stderr, exit ``code``."""
    _print_error(message)
    raise typer.Exit(code)


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
    """NATS URL, database URL and subject prefix: from the environment, else a running `hetsched up`.
    Neither (no HETSCHED_NATS_URL, no `up` holding the data dir's lock): one line saying so, exit 2,
    instead of asking whatever listens on the default port."""
    if not settings.kit.nats_url and not stack_running(settings.kit.data_dir):
        fail(
            f"no hetsched stack is running (data dir {settings.kit.data_dir}): start one with `hetsched up` "
            "(or set HETSCHED_NATS_URL to use a NATS server of yours)",
            NO_STACK_EXIT,
        )
    state = read_state(settings) or {}
    nats_url = settings.kit.nats_url or state.get("nats_url")
    if not nats_url:  # its lock is held and its state file not written yet
        fail(
            f"the hetsched stack in {settings.kit.data_dir} is still starting: try again once `hetsched up` says ready",
            NO_STACK_EXIT,
        )
    database_url = settings.kit.database_url or state.get("database_url")
    prefix = (
        state.get("subject_prefix", settings.kit.subject_prefix)
        if not settings.kit.nats_url
        else settings.kit.subject_prefix
    )
    return nats_url, database_url, prefix


def with_rpc(
    data_dir: Path | None,
    what: str,
    work: Callable[[RpcClient], Awaitable[ReplyT]],
    *,
    acting: Acting | None = None,
) -> ReplyT:
    """Run ``work`` with a client on the stack's NATS (timeout: ``HETSCHED_REQUEST_TIMEOUT_MS``), as the
    operator or, with ``acting``, as that credential; no answer exits 2 and says where it asked. Tests
    replace it (tests/unit/cli_fake.py): commands call it through this module, never a copy of the name."""
    settings = settings_of(data_dir)
    nats_url, _db, prefix = endpoints(settings)

    async def session() -> ReplyT:
        rpc = await RpcClient.connect(
            nats_url,
            Subjects(prefix),
            timeout_s=settings.kit.request_timeout_ms / 1000,
            name="hetsched-cli",
            operator=acting is None,
            scope_by_tenant=acting is not None and acting.scoped,
            **(acting.options(settings) if acting is not None else operator_options(settings)),
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
    data_dir: Path | None,
    rpc: Rpc,
    request: BaseModel,
    reply_type: type[ModelT],
    *,
    rejection_as_reply: bool = False,
    credential: Path | None = None,
) -> Any:
    """One call: the reply, or the ``Rejected`` a service refuses with. ``rejection_as_reply``: only for
    the routes whose reply model still carries its refusal (``placement.place``/``explain``: the
    ``PlaceReply`` with its explanation); the service refusing the body as ``invalid_request`` is bad
    input (exit 2). ``credential``: act as that gateway (``CredentialOption``), on its tenant's subject."""
    acting = acting_as(data_dir, credential)
    options = call_options(acting, rpc, request)
    if rejection_as_reply:
        options["rejection_as_reply"] = True

    async def work(client: RpcClient) -> Any:
        return await client.ask(rpc, request, reply_type, **options)  # by default a refusal comes as Rejected

    reply = with_rpc(data_dir, rpc.value, work, **acting_option(acting))
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
    data_dir: Path | None,
    rpc: Rpc,
    request: BaseModel,
    reply_type: type[ModelT],
    as_json: bool,
    *,
    credential: Path | None = None,
) -> ModelT | None:
    """Ask; a refusal exits 1 (``refusal``); with --json the reply is printed and None comes back (nothing
    more to show); otherwise the reply, for the command to show in words."""
    answer = ask(data_dir, rpc, request, reply_type, credential=credential)
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


def table(headers: list[str], rows: list[list[str]], *, wide: bool = False) -> None:
    """A table that never loses a character. Plain ``columns`` when asked (``--wide``), when stdout is not a
    terminal (scripts read whole rows) or when the rows fit the terminal; otherwise a table whose long cells
    fold onto further lines within the terminal's width."""
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows, strict=False)]
    if wide or not console.is_terminal or sum(widths) + 2 * (len(widths) - 1) <= console.width:
        columns(headers, rows)
        return
    folded = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for header in headers:
        folded.add_column(header, overflow="fold")
    for row in rows:
        folded.add_row(*(Text(cell) for cell in row))  # as they are: no markup read into a cell
    console.print(folded)


def columns(headers: list[str], rows: list[list[str]]) -> None:
    """A plain table, each column as wide as its widest cell: nothing is cut or folded to fit the
    terminal (an id is copied from it into `--cancel`), and `awk` reads it."""
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows, strict=False)]
    for line in [headers, *rows]:
        say("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip())


# -- acting as a gateway (--credential) -------------------------------------------------------------------------


@dataclass(frozen=True)
class Acting:
    """A credential the CLI connects with instead of the operator's: its seed, its inbox prefix (where its
    replies may arrive), and, for a gateway (``scoped``), the tenants it acts for (empty when the stack's
    registry does not know it)."""

    seed: Path
    inbox_prefix: str
    scoped: bool = True
    tenants: tuple[str, ...] = ()

    def options(self, settings: Settings) -> dict[str, Any]:
        """``nats.connect`` options: this seed and inbox, and TLS as configured."""
        return connect_options(
            settings.updated(kit={"nats_nkey_seed_file": self.seed, "nats_inbox_prefix": self.inbox_prefix})
        )

    def scope(self, tenant: str | None) -> str | None:
        """The tenant whose subject a call goes on: the request's when this gateway acts for it (or its
        tenants are unknown), else one of its own, so the service, not a timeout, answers a request naming
        another tenant (``forbidden``)."""
        if not self.scoped:
            return None
        if tenant is not None and (not self.tenants or tenant in self.tenants):
            return tenant
        return self.tenants[0] if self.tenants else tenant

    def tenant(self, given: str | None) -> str:
        """The tenant a call names: ``given``, else this gateway's only tenant; exit 2 when neither."""
        if given is not None:
            return given
        if len(self.tenants) == 1:
            return self.tenants[0]
        acts_for = ", ".join(self.tenants) if self.tenants else "tenants this stack does not list"
        bad_input(f"--tenant is required: the credential acts for {acts_for}")


def acting_option(acting: Acting | None) -> dict[str, Any]:
    """``with_rpc``'s keyword for acting as a credential: none for the operator (so a stand-in ``with_rpc``
    that knows nothing of credentials still serves the operator's calls)."""
    return {"acting": acting} if acting is not None else {}


def call_options(acting: Acting | None, rpc: Rpc, request: BaseModel) -> dict[str, Any]:
    """``RpcClient.ask`` options of one call: acting as a gateway, the tenant subject it goes on."""
    if acting is None or rpc not in TENANT_SCOPED:
        return {}
    scope = acting.scope(getattr(request, "tenant", None))
    return {"scope": scope} if scope is not None else {}


def acting_as(data_dir: Path | None, credential: Path | None) -> Acting | None:
    """Who ``credential`` is, from the registry of the stack that issued it (``<data-dir>/nats/identities.json``,
    by its public key): its inbox prefix and tenants. A credential the registry does not list takes its inbox
    prefix from ``HETSCHED_NATS_INBOX_PREFIX`` (``credentials issue`` prints it). None: the operator's."""
    if credential is None:
        return None
    try:
        key = public_key(read_seed(credential))
    except (OSError, ValueError, nkeys.NkeysError) as exc:
        bad_input(f"--credential {credential}: not a readable NKey seed file ({type(exc).__name__})")
    settings = settings_of(data_dir)
    registry = Registry.load(nats_dir(settings.kit.data_dir))
    found = next((i for i in registry.identities.values() if i.public_key == key), None)
    if found is not None and found.kind == "gateway":
        return Acting(seed=credential, inbox_prefix=inbox_prefix(found.id), tenants=tuple(found.tenants))
    if found is not None and found.kind == "operator":
        return Acting(seed=credential, inbox_prefix=settings.kit.nats_inbox_prefix, scoped=False)
    if found is not None:
        bad_input(f"--credential {credential}: the {found.kind} credential {found.id}, not a gateway's")
    if settings.kit.nats_inbox_prefix != INBOX:
        return Acting(seed=credential, inbox_prefix=settings.kit.nats_inbox_prefix)
    bad_input(
        f"--credential {credential}: not issued by the stack under {settings.kit.data_dir}; pass its --data-dir, "
        "or set HETSCHED_NATS_INBOX_PREFIX to the inbox prefix `hetsched credentials issue` printed for it"
    )
