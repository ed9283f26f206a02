"""A service's health subject: Postgres, NATS, workers, its dependencies (probed when their last call got no
answer), its consumers, its followers and its own checks."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version

from pydantic import BaseModel
from sqlalchemy import text

from shared.contracts.health import HealthReply, HealthRequest
from shared.contracts.subjects import Rpc
from shared.infra.consumers import consumers_check
from shared.infra.requests import RequestServer
from shared.infra.runtime import Runtime


def hetsched_version() -> str:
    try:
        return package_version("hetsched")
    except PackageNotFoundError:
        return "0.0.0+local"


def _workers_check(requests: RequestServer, *, after_s: float) -> str:
    """`ok`, or which subjects have had every worker busy for longer than ``after_s`` (callers wait)."""
    saturated = requests.saturated(after_s=after_s)
    if not saturated:
        return "ok"
    worst = ", ".join(f"{subject} for {seconds:.1f} s" for subject, seconds in sorted(saturated.items()))
    return f"saturated: every worker busy ({worst})"


HEALTH_PROBE_TIMEOUT_S = 1.0


def health_probes(calls: tuple[Rpc, ...]) -> dict[str, Rpc]:
    """The dependencies a service may probe: context (``reservation``) -> its health subject, for each
    health subject among the subjects the service calls (its NATS permissions allow just those)."""
    return {rpc.value.split(".", 1)[0]: rpc for rpc in calls if rpc.value.endswith(".health")}


async def _probe(runtime: Runtime, probes: Mapping[str, Rpc]) -> None:
    """Ask the health of each dependency whose latest call got no answer: one that answers is back (the
    call stats record the answer), so health does not wait for the next real call to say so."""
    failing = [probes[context] for context in runtime.rpc.stats.failing() if context in probes]

    async def one(rpc: Rpc) -> None:
        with contextlib.suppress(Exception):  # no answer: recorded as such, still failing
            await runtime.rpc.call(rpc, HealthRequest(), timeout_s=HEALTH_PROBE_TIMEOUT_S)

    await asyncio.gather(*(one(rpc) for rpc in failing))


def health_handler(
    runtime: Runtime,
    extra: Callable[[], Mapping[str, str]] | None,
    requests: RequestServer | None = None,
    *,
    probes: Mapping[str, Rpc] | None = None,
) -> Callable[[HealthRequest], Awaitable[BaseModel]]:
    async def handler(_request: HealthRequest) -> BaseModel:
        checks: dict[str, str] = {}
        slow_s = runtime.settings.kit.dependency_slow_ms / 1000
        if runtime.uses_database:
            started = time.monotonic()
            try:
                async with runtime.engine.connect() as conn:
                    await asyncio.wait_for(conn.execute(text("SELECT 1")), timeout=2)
                took = time.monotonic() - started
                checks["postgres"] = "ok" if took <= slow_s else f"slow: SELECT 1 took {took * 1000:.0f} ms"
            except Exception as exc:
                checks["postgres"] = f"error: {type(exc).__name__}"
        checks["nats"] = "ok" if runtime.nc is not None and runtime.nc.is_connected else "error: disconnected"
        if requests is not None:
            checks["workers"] = _workers_check(requests, after_s=runtime.settings.kit.request_saturated_ms / 1000)
        if probes:
            await _probe(runtime, probes)
        slow = runtime.rpc.stats.slow(slow_s=slow_s)
        checks["dependencies"] = (
            "ok" if not slow else "slow: " + "; ".join(f"{k}: {v}" for k, v in sorted(slow.items()))
        )
        loops = getattr(runtime, "consumers", None)  # a test's stand-in runtime may have none
        if loops:
            checks["consumers"] = consumers_check(loops)
        read_side = getattr(runtime, "read_side", None)  # a test's stand-in runtime may have none
        if read_side is not None:
            checks.update(read_side.checks())
        if extra is not None:
            checks.update(extra())
        healthy = all(v == "ok" for v in checks.values())
        return HealthReply(
            status="ok" if healthy else "degraded",
            service=runtime.name,
            version=hetsched_version(),
            checks=checks,
            metrics_url=getattr(getattr(runtime, "metrics", None), "url", None),
            http_url=getattr(runtime, "http_url", None),
        )

    return handler
