"""`hetsched credentials issue|list|revoke`: NATS identities for gateways and agents, and the HTTP
gateway's API keys (docs/SECURITY.md).

Each NATS credential is an NKey seed file (``nats.connect(nkeys_seed=FILE)``). Issuing or revoking one
updates ``<data-dir>/nats/identities.json`` and ``auth.conf`` and, when `hetsched up` runs the NATS
server, asks it to reload (SIGHUP): a revoked identity is disconnected at once.

An API key (``--tenant T --api-key``) is a row of ``gateway.api_keys``, written as the operator (the database
user of ``HETSCHED_DATABASE_URL``, else of the running `hetsched up`); its plaintext is printed once.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from sqlalchemy.ext.asyncio import AsyncConnection

from hetsched.cli.common import (
    NO_STACK_EXIT,
    DataDirOption,
    JsonOption,
    WideOption,
    bad_input,
    console,
    fail,
    say,
    settings_of,
    table,
)
from hetsched.lock import stack_running
from hetsched.stack import read_state, service_permission_map, services, write_identities
from services.gateway import keystore
from shared.contracts.permissions import agent_identity, gateway_identity, inbox_prefix, service_identity
from shared.contracts.subjects import token
from shared.domain.gateway.keys import ID_PREFIX, ApiKey
from shared.infra import identity as identities
from shared.infra.catalog import load_model_groups, load_models
from shared.infra.db import DatabaseMissing, database_tls, make_engine, missing_database, without_password
from shared.infra.identity import Registry, reload_server, write_auth_conf
from shared.infra.identity import nats_dir as identity_dir
from shared.infra.settings import Settings

T = TypeVar("T")

CREDENTIALS_DIR = "credentials"
"""Under the data dir: where `credentials issue` writes a credential without --out."""

app = typer.Typer(
    help="Credentials: NATS identities of gateways (tenants) and agents (nodes); API keys of the HTTP gateway.",
    no_args_is_help=True,
)


def _apply(settings: Settings, registry: Registry) -> str:
    """Save the registry, render auth.conf, reload a running embedded server; what happened, in words."""
    directory = identity_dir(settings.kit.data_dir)
    registry.save(directory)
    service_settings = settings.updated(
        kit={"subject_prefix": registry.subject_prefix, "stream_prefix": registry.stream_prefix}
    )
    path = write_auth_conf(directory, registry, service_permission_map(service_settings))
    state = read_state(settings) or {}
    pid = (state.get("servers") or {}).get("nats_pid")
    if reload_server(pid):
        return f"{path} rewritten; the running NATS server (pid {pid}) reloaded it"
    return f"{path} rewritten; a NATS server started by `hetsched up` reads it at its next start"


def _load(settings: Settings) -> Registry:
    directory = identity_dir(settings.kit.data_dir)
    if not (directory / "identities.json").exists():
        bad_input(f"no identities under {directory}: run `hetsched up` there first (or pass --data-dir)")
    return Registry.load(directory)


# -- API keys: rows of gateway.api_keys, written as the operator -------------------------------------------------


def _database_url(settings: Settings) -> str | None:
    """The operator's database: ``HETSCHED_DATABASE_URL``, else the one the running `hetsched up` migrated
    (from its state file; none when no `up` holds the data dir, whatever an old state file says)."""
    if settings.kit.database_url:
        return settings.kit.database_url
    if not stack_running(settings.kit.data_dir):
        return None
    url = (read_state(settings) or {}).get("database_url")
    return str(url) if url else None


def _with_database(settings: Settings, work: Callable[[AsyncConnection], Awaitable[T]]) -> T:
    """``work`` in one transaction on the operator's database (committed when it returns); no database, or
    none that answers: one line, exit 2."""
    url = _database_url(settings)
    if not url:
        bad_input(
            f"no database: no `hetsched up` runs in {settings.kit.data_dir} (pass --data-dir) and "
            "HETSCHED_DATABASE_URL is not set"
        )

    async def session() -> T:
        engine = make_engine(url, pool_size=1, application_name="hetsched-cli", tls=database_tls(settings))
        try:
            async with engine.begin() as conn:
                return await work(conn)
        finally:
            await engine.dispose()

    try:
        return asyncio.run(session())
    except Exception as exc:
        if missing_database(exc):
            bad_input(str(DatabaseMissing(url)))
        if "gateway" in str(exc) and "does not exist" in str(exc):
            bad_input(f"the database at {without_password(url)} has no schema gateway yet: migrate it (`hetsched up`)")
        fail(f"no answer from Postgres at {without_password(url)}: {type(exc).__name__} {exc}", NO_STACK_EXIT)


def _check_models(settings: Settings, names: list[str]) -> list[str]:
    """The allow-list as given, each a model or model group of the catalog; an unknown name is bad input."""
    models = load_models(settings.kit.model_catalog)
    known = set(models) | set(load_model_groups(settings.kit.model_groups, models))
    for name in names:
        if name not in known:
            bad_input(f"--model {name}: not a model or model group of the catalog (known: {', '.join(sorted(known))})")
    return list(dict.fromkeys(names))


def _key_row(key: ApiKey) -> dict[str, Any]:
    """What is shown of a key: never its secret, nor the secret's hash."""
    return {
        "id": key.key_id,
        "kind": "api_key",
        "tenant": key.tenant,
        "name": key.name,
        "priority": key.priority,
        "rpm": key.rpm,
        "tpm": key.tpm,
        "models": sorted(key.models) if key.models is not None else None,
        "revoked": key.revoked,
    }


def _issue_api_key(
    *,
    settings: Settings,
    tenant: str,
    name: str | None,
    priority: int,
    rpm: int | None,
    tpm: int | None,
    models: list[str] | None,
    as_json: bool,
) -> None:
    for option, value in (("--rpm", rpm), ("--tpm", tpm)):
        if value is not None and value <= 0:
            bad_input(f"{option} {value}: a quota per minute is at least 1 (leave it out for no limit)")
    allowed = _check_models(settings, models) if models else None

    async def work(conn: AsyncConnection) -> tuple[ApiKey, str]:
        return await keystore.issue(conn, tenant=tenant, name=name, priority=priority, rpm=rpm, tpm=tpm, models=allowed)

    key, plaintext = _with_database(settings, work)
    if as_json:
        print(json.dumps({"api_key": plaintext, "key_id": key.key_id, **_key_row(key)}, indent=2))
        return
    say(f"api_key={plaintext}")
    say(f"key_id={key.key_id}")
    say(f"tenant={key.tenant}")
    say("  shown once: only its hash is stored (lost: revoke it and issue another)")


@app.command()
def init(
    server_config: Annotated[
        Path | None, typer.Option(help="Also write a nats-server configuration that includes auth.conf.")
    ] = None,
    listen: Annotated[str, typer.Option(help="The server's client address (with --server-config).")] = "0.0.0.0:4222",
    store_dir: Annotated[str, typer.Option(help="The server's JetStream directory (with --server-config).")] = "/data",
    http_port: Annotated[int, typer.Option(help="Monitoring port (with --server-config); 0: none.")] = 8222,
    data_dir: DataDirOption = None,
) -> None:
    """Make the operator's and every service's NKey (once; kept) and auth.conf, for a NATS server run
    outside `hetsched up` (docker compose, Kubernetes): the server includes auth.conf, each service gets
    its seed (``identities/svc_<schema>.nk``) as HETSCHED_NATS_NKEY_SEED_FILE and its inbox prefix."""
    settings = settings_of(data_dir)
    written = write_identities(settings)
    if server_config is not None:
        lines = [
            "# Generated by `hetsched credentials init`.",
            f"listen: {listen}",
            f"jetstream {{ store_dir: {json.dumps(store_dir)} }}",
            *([f"http_port: {http_port}"] if http_port else []),
            f"include {json.dumps(str(written.auth_conf.resolve()))}",
        ]
        server_config.parent.mkdir(parents=True, exist_ok=True)
        server_config.write_text("\n".join(lines) + "\n")
    console.print(f"operator seed   {written.operator_seed}")
    for package, seed in written.service_seeds.items():
        inbox = inbox_prefix(service_identity(services()[package].schema))
        console.print(f"{package:<20} HETSCHED_NATS_NKEY_SEED_FILE={seed} HETSCHED_NATS_INBOX_PREFIX={inbox}")
    console.print(f"auth.conf       {written.auth_conf}")


@app.command()
def issue(
    tenant: Annotated[list[str] | None, typer.Option(help="A tenant this gateway acts for (repeatable).")] = None,
    agent: Annotated[str | None, typer.Option(help="Instead of tenants: an agent credential for this node.")] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            help="Where to write the credential (an NKey seed file, mode 0600); default "
            "<data-dir>/credentials/<name>.nk."
        ),
    ] = None,
    name: Annotated[
        str | None,
        typer.Option(
            help="Gateway name (default: the --out file's stem, else the tenants joined by '-' and '-gateway'); "
            "with --api-key, the key's name."
        ),
    ] = None,
    api_key: Annotated[
        bool,
        typer.Option("--api-key", help="Instead of a NATS credential: an API key of the HTTP gateway for --tenant."),
    ] = False,
    priority: Annotated[int, typer.Option(help="With --api-key: the admission priority of its requests.")] = 0,
    rpm: Annotated[int | None, typer.Option(help="With --api-key: requests per minute (default: no limit).")] = None,
    tpm: Annotated[int | None, typer.Option(help="With --api-key: tokens per minute (default: no limit).")] = None,
    model: Annotated[
        list[str] | None,
        typer.Option(
            help="With --api-key: a model or model group it may call (repeatable; default: every one of the catalog)."
        ),
    ] = None,
    as_json: JsonOption = False,
    data_dir: DataDirOption = None,
) -> None:
    """Write a gateway credential for --tenant T [--tenant U ...], or an agent credential for --agent NODE; or
    with --api-key, make an API key of the HTTP gateway for one --tenant and print it once."""
    if api_key:
        if agent or out or len(tenant or ()) != 1:
            bad_input("--api-key takes exactly one --tenant, and neither --agent nor --out")
        _issue_api_key(
            settings=settings_of(data_dir),
            tenant=(tenant or [""])[0],
            name=name,
            priority=priority,
            rpm=rpm,
            tpm=tpm,
            models=model,
            as_json=as_json,
        )
        return
    if priority or rpm is not None or tpm is not None or model:
        bad_input("--priority, --rpm, --tpm and --model are options of an API key: add --api-key")
    if bool(tenant) == bool(agent):
        bad_input("give --tenant (a gateway) or --agent (a node), not both and not neither")
    settings = settings_of(data_dir)
    registry = _load(settings)
    if agent:
        kind, name_ = "agent", agent
    else:
        kind, name_ = "gateway", name or (out.stem if out else "-".join(dict.fromkeys(tenant or ())) + "-gateway")
    # Outside the working tree by default, beside the other secrets of the data dir (0700 folder, 0600 file).
    out = out or settings.kit.data_dir / CREDENTIALS_DIR / f"{token(name_)}.nk"
    if out.exists():
        bad_input(f"{out} exists: a credential is never overwritten (revoke it, then issue a new one)")
    replaced = registry.identities.get(agent_identity(name_) if agent else gateway_identity(name_))
    identity = identities.issue(registry, kind=kind, name=name_, out=out, tenants=tenant or ())
    what = _apply(settings, registry)
    reply = {
        "id": identity.id,
        "kind": identity.kind,
        "public_key": identity.public_key,
        "tenants": identity.tenants,
        "node": identity.node or None,
        "credential_file": str(out),
        "inbox_prefix": inbox_prefix(identity.id),
        "subjects": {t: f"{registry.subject_prefix}.<subject>.{token(t)}" for t in identity.tenants},
        "replaced_public_key": replaced.public_key if replaced else None,
    }
    if as_json:
        print(json.dumps(reply, indent=2))
        return
    say(f"{identity.kind} credential {identity.id} -> {out}")
    say(f"  connect with nkeys_seed={out} and inbox_prefix={reply['inbox_prefix']}")
    for t in identity.tenants:
        say(f"  tenant {t}: call {registry.subject_prefix}.placement.place.{token(t)} (and the other public subjects)")
    if replaced:
        say(f"  (replaces the previous key of {identity.id}: {replaced.public_key})")
    say(f"  {what}")


@app.command("list")
def list_(
    as_json: JsonOption = False,
    wide: WideOption = False,
    data_dir: DataDirOption = None,
) -> None:
    """Every identity the NATS server admits (public keys only), then every API key (never a secret or its
    hash; revoked ones too)."""
    settings = settings_of(data_dir)
    has_registry = (identity_dir(settings.kit.data_dir) / "identities.json").exists()
    if not has_registry and not _database_url(settings):
        _load(settings)  # neither identities nor a database: says where it looked
    identities_ = list(Registry.load(identity_dir(settings.kit.data_dir)).identities.values()) if has_registry else []
    keys = _with_database(settings, keystore.list_keys) if _database_url(settings) else []
    rows = [
        {"id": i.id, "kind": i.kind, "public_key": i.public_key, "tenants": i.tenants, "node": i.node or None}
        for i in identities_
    ]
    if as_json:
        print(json.dumps(rows + [_key_row(k) for k in keys], indent=2))
        return
    if has_registry:
        table(
            ["id", "kind", "public key", "tenants / node"],
            [[i.id, i.kind, i.public_key, ", ".join(i.tenants) or i.node or "-"] for i in identities_],
            wide=wide,
        )
    if keys:
        if has_registry:
            console.print()

        def limit(value: int | None) -> str:
            return "-" if value is None else str(value)

        table(
            ["api key", "tenant", "name", "priority", "rpm", "tpm", "models", "revoked"],
            [
                [
                    k.key_id,
                    k.tenant,
                    k.name or "-",
                    str(k.priority),
                    limit(k.rpm),
                    limit(k.tpm),
                    ", ".join(sorted(k.models)) if k.models is not None else "all",
                    "yes" if k.revoked else "no",
                ]
                for k in keys
            ],
            wide=wide,
        )


@app.command()
def revoke(
    identity: Annotated[str, typer.Argument(help="Identity id or API key id `key-...` (`hetsched credentials list`).")],
    data_dir: DataDirOption = None,
) -> None:
    """Remove an identity: the server drops its connections when it reloads (at once under `hetsched up`).
    An API key id (`key-...`): the key is revoked, and the gateway refuses it from then on."""
    settings = settings_of(data_dir)
    if identity.startswith(ID_PREFIX):

        async def work(conn: AsyncConnection) -> bool:
            return await keystore.revoke(conn, identity)

        if not _with_database(settings, work):
            bad_input(f"{identity}: no such API key (see `hetsched credentials list`)")
        console.print(f"revoked API key {identity}", markup=False, highlight=False)
        return
    registry = _load(settings)
    found = registry.identities.get(identity)
    if found is None or found.kind in ("operator", "service"):
        bad_input(f"{identity}: no such gateway or agent credential")
    del registry.identities[identity]
    console.print(f"revoked {identity} ({found.public_key}); {_apply(settings, registry)}")
