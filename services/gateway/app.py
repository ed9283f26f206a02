"""Wiring of the gateway (the shape of docs/SERVICE.md): an OpenAI-compatible HTTP server started with the
service, the API keys it re-reads, and the usage it writes; on NATS it answers its health subject and calls
`route.select`, `placement.admit` and `placement.release`. Nothing on its request path writes Postgres."""

from __future__ import annotations

import gc
from dataclasses import dataclass
from datetime import date
from typing import Any

from faststream import FastStream
from sqlalchemy.ext.asyncio import AsyncSession

from services.gateway import keystore
from services.gateway.keyring import KeyRing
from services.gateway.metrics import GatewayMetrics
from services.gateway.server import Gateway
from services.gateway.tables import SCHEMA
from services.gateway.usage import UsageBook, UsageRow
from shared.contracts.subjects import Rpc
from shared.domain.gateway.keys import ApiKey
from shared.infra.catalog import load_model_groups, load_models, load_regions
from shared.infra.service import Loop, Runtime, ServiceDefinition, build_app
from shared.infra.settings import Settings
from shared.infra.uow import UnitOfWork


@dataclass(frozen=True)
class Ctx:
    runtime: Runtime
    gateway: Gateway
    keys: KeyRing
    usage: UsageBook


async def _add_usage(uow: UnitOfWork, totals: dict[UsageRow, tuple[int, int, int]]) -> None:
    await keystore.add_usage(
        uow.session,
        [
            keystore.UsageDelta(tenant, day, model, key_id, requests, prompt, completion)
            for (tenant, day, model, key_id), (requests, prompt, completion) in totals.items()
        ],
    )


def wire(runtime: Runtime) -> Ctx:
    settings = runtime.settings
    models = load_models(settings.kit.model_catalog)
    groups = load_model_groups(settings.kit.model_groups, models)
    region = settings.gateway.region or next(iter(load_regions(settings.kit.regions_file)))

    async def active() -> list[ApiKey]:
        return await runtime.uow.read(keystore.active_keys)

    async def usage_of(tenant: str, since: date) -> list[dict[str, Any]]:
        async def read(session: AsyncSession) -> list[dict[str, Any]]:
            return await keystore.usage_of(session, tenant, since)

        return await runtime.uow.read(read)

    keys = KeyRing(active, every_s=settings.gateway.keys_refresh_s, log=runtime.log)
    usage = UsageBook(
        run=runtime.uow.run,
        add=_add_usage,
        every_s=settings.gateway.usage_flush_s,
        log=runtime.log,
        wake_relay=runtime.wake_relay,
    )
    gateway = Gateway(
        settings=settings.gateway,
        rpc=runtime.rpc,
        keys=keys,
        usage=usage,
        metrics=GatewayMetrics(runtime.metrics),
        models=models,
        groups=groups,
        region=region,
        usage_of=usage_of,
        ready=lambda: runtime.nc is not None and runtime.nc.is_connected,
        log=runtime.log,
    )
    return Ctx(runtime=runtime, gateway=gateway, keys=keys, usage=usage)


async def _start(ctx: Ctx) -> None:
    try:
        await ctx.keys.refresh()
    except Exception as exc:  # the refresh loop tries again; until then every key is unknown (401)
        ctx.runtime.log.warning("API keys not loaded yet", extra={"error": str(exc)[:200]})
    ctx.runtime.http_url = await ctx.gateway.start()
    # What start-up built lives as long as the process: out of the collector's way, so a full collection
    # mid-stream walks only what requests made (a gen-2 pass over the catalogues is a latency spike).
    gc.collect()
    gc.freeze()


async def _stop(ctx: Ctx) -> None:
    await ctx.gateway.stop()
    try:
        await ctx.usage.flush()
    except Exception as exc:
        ctx.runtime.log.error(
            "usage not written at shutdown", extra={"error": str(exc)[:200], "pending": len(ctx.usage.pending)}
        )


def _checks(ctx: Ctx) -> dict[str, str]:
    return {
        "http": "ok" if ctx.gateway.url else "error: not listening",
        "api_keys": "ok" if ctx.keys.loaded else "error: not loaded",
    }


SERVICE = ServiceDefinition(
    name="gateway",
    health=Rpc.GATEWAY_HEALTH,
    schema=SCHEMA,
    wire=wire,
    on_start=(_start,),
    on_stop=(_stop,),
    loops=(
        Loop("api-keys", lambda ctx: ctx.keys.run),
        Loop("usage-flush", lambda ctx: ctx.usage.run),
    ),
    checks=_checks,
    calls=(Rpc.ROUTE_SELECT, Rpc.PLACEMENT_ADMIT, Rpc.PLACEMENT_RELEASE, Rpc.PLACEMENT_RENEW),
)


def bootstrap(settings: Settings, **overrides: Any) -> tuple[FastStream, Runtime]:
    return build_app(SERVICE, settings, **overrides)


def main() -> None:
    """``python -m services.gateway`` and ``hetsched gateway``: the service on uvloop where it is installed (the
    gateway relays every streamed token: libuv's loop costs it less per event than asyncio's own)."""
    import asyncio

    from shared.infra.service import run_service

    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:  # pragma: no cover - a platform without it runs asyncio's loop
        pass
    run_service(bootstrap, name=SERVICE.name)
