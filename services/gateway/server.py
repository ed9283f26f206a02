"""The gateway's HTTP side: OpenAI-compatible endpoints on aiohttp, proxying to the engines with aiohttp's
client. One request: its API key (401), its model (404), its key's quota (429), one ``route.select`` that
also admits it (a queued admission is asked again until it is admitted), then the engine; an engine that
fails before its first token is reported (``failed_replica_id``) and the next replica answers; at the end
the admission is released and the usage recorded (docs/GATEWAY.md)."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.gateway.keyring import KeyRing
from services.gateway.metrics import GatewayMetrics
from services.gateway.usage import UsageBook
from shared.contracts.base import ErrorCode, Rejected
from shared.contracts.gateway import UsageOutcome, UsageRecord
from shared.contracts.placement import (
    AdmitReply,
    AdmitRequest,
    ReleaseReply,
    ReleaseRequest,
    RenewReply,
    RenewRequest,
    Slo,
)
from shared.contracts.routing import RouteSelectReply, RouteSelectRequest
from shared.contracts.subjects import Rpc
from shared.domain.gateway.keys import ApiKey
from shared.domain.gateway.openai import Api, Ask, BadRequest, error_body, parse_ask, upstream_body
from shared.domain.gateway.quota import retry_after
from shared.domain.gateway.sse import read_line, split_events, usage_counts
from shared.infra.rpc import RpcClient, RpcError
from shared.infra.settings import GatewaySettings

REQUEST_ID_HEADER = "x-request-id"
ROUTED_LEASE_S: int = AdmitRequest.model_fields["lease_s"].default
"""The lease of an admission `route.select` makes (it asks admission with the default)."""
QUEUE_POLL_S = 0.02
"""How often a queued admission is asked again."""

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "Connection": "keep-alive"}


class HttpError(Exception):
    """An answer in OpenAI's error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str,
        code: str,
        param: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.type, self.code, self.param, self.retry_after_s = status, type, code, param, retry_after_s

    def response(self, request_id: str | None = None) -> web.Response:
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(self.retry_after_s)
        if request_id:
            headers[REQUEST_ID_HEADER] = request_id
        body = error_body(str(self), type=self.type, code=self.code, param=self.param)
        return web.json_response(body, status=self.status, headers=headers)


def unauthorized() -> HttpError:
    return HttpError(
        401,
        "Incorrect API key provided. Send `Authorization: Bearer <key>` with a key from "
        "`hetsched credentials issue --tenant T --api-key`.",
        type="invalid_request_error",
        code="invalid_api_key",
    )


class UpstreamFailed(Exception):
    """The engine failed the request before its first token: another replica may answer it."""


# Refusals of route.select / placement.admit, as HTTP.
_REFUSALS: dict[str, tuple[int, str]] = {
    ErrorCode.NO_CAPACITY.value: (503, "service_unavailable"),
    ErrorCode.UNKNOWN_MODEL.value: (404, "invalid_request_error"),
    ErrorCode.INVALID_REQUEST.value: (400, "invalid_request_error"),
    ErrorCode.FORBIDDEN.value: (403, "permission_error"),
}


def refusal(code: str, message: str) -> HttpError:
    status, type_ = _REFUSALS.get(code, (502, "server_error"))
    if code == ErrorCode.UNKNOWN_MODEL.value:
        code = "model_not_found"
    return HttpError(status, message, type=type_, code=code, retry_after_s=1 if status == 503 else None)


@dataclass(slots=True)
class Attempt:
    """The replica a request runs on now, and what the request has seen so far."""

    admission: AdmitReply
    failovers: int = 0
    queued: bool = False
    ttft_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    broken: bool = False  # the engine failed after the first token: the stream ended with an error event

    @property
    def labels(self) -> tuple[str, str, str, str]:
        a = self.admission
        return (a.model or "", a.engine or "", a.sku or "", a.region or "")


class Renewals:
    """A timer that calls ``renew`` every ``every_s`` until cancelled."""

    def __init__(self, loop: asyncio.AbstractEventLoop, every_s: float, renew: Callable[[], None]) -> None:
        self._loop, self._every_s, self._renew = loop, every_s, renew
        self._handle = loop.call_later(every_s, self._tick)

    def _tick(self) -> None:
        self._renew()
        self._handle = self._loop.call_later(self._every_s, self._tick)

    def cancel(self) -> None:
        self._handle.cancel()


class Gateway:
    def __init__(
        self,
        *,
        settings: GatewaySettings,
        rpc: RpcClient,
        keys: KeyRing,
        usage: UsageBook,
        metrics: GatewayMetrics,
        models: Mapping[str, Any],
        groups: Mapping[str, tuple[str, ...]],
        region: str,
        usage_of: Callable[[str, date], Awaitable[list[dict[str, Any]]]],
        ready: Callable[[], bool],
        log: logging.Logger,
    ) -> None:
        self.settings = settings
        self.rpc = rpc
        self.keys = keys
        self.usage = usage
        self.metrics = metrics
        self.models = models
        self.groups = groups
        self.region = region
        self._usage_of = usage_of
        self._ready = ready
        self.log = log
        self.sessions: Counter[tuple[str, str]] = Counter()  # (tenant, session) -> requests streaming now
        self._tasks: set[asyncio.Task[Any]] = set()
        self._client: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self.url: str | None = None
        metrics.targets({name: self.ttft_target_s(name) for name in models})

    def ttft_target_s(self, model: str) -> float:
        return self.settings.slo_ttft_ms_by_model.get(model, self.settings.slo_ttft_ms) / 1000

    # -- life ------------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.settings.max_body_bytes)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/models/{model}", self.get_model)
        app.router.add_get("/v1/usage", self.tenant_usage)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        return app

    async def start(self) -> str:
        self._client = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None),
        )
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.settings.host, self.settings.port)
        await site.start()
        port = int(self._runner.addresses[0][1]) if self._runner.addresses else self.settings.port
        host = "127.0.0.1" if self.settings.host in ("0.0.0.0", "") else self.settings.host
        self.url = f"http://{host}:{port}"
        self.log.info("gateway listening", extra={"url": self.url})
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)
        if self._client is not None:
            await self._client.close()

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- small endpoints ---------------------------------------------------------------------------

    async def health(self, _request: web.Request) -> web.Response:
        ok = self._ready() and self.keys.loaded
        return web.json_response({"status": "ok" if ok else "starting"}, status=200 if ok else 503)

    async def prometheus(self, _request: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _key(self, request: web.Request) -> ApiKey:
        key = await self.keys.lookup(request.headers.get("Authorization"))
        if key is None:
            self.metrics.outcome("", "rejected", "unauthorized")
            raise unauthorized()
        return key

    def _visible(self, key: ApiKey) -> list[dict[str, Any]]:
        created = 0
        out = [
            {"id": name, "object": "model", "created": created, "owned_by": "hetsched", "kind": "model"}
            for name in sorted(self.models)
            if key.allows(name)
        ]
        out += [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "hetsched",
                "kind": "group",
                "members": list(members),
            }
            for name, members in sorted(self.groups.items())
            if key.allows(name)
        ]
        return out

    async def list_models(self, request: web.Request) -> web.Response:
        try:
            key = await self._key(request)
        except HttpError as error:
            return error.response()
        return web.json_response({"object": "list", "data": self._visible(key)})

    async def get_model(self, request: web.Request) -> web.Response:
        try:
            key = await self._key(request)
            name = request.match_info["model"]
            found = next((m for m in self._visible(key) if m["id"] == name), None)
            if found is None:
                raise self._no_model(name)
        except HttpError as error:
            return error.response()
        return web.json_response(found)

    async def tenant_usage(self, request: web.Request) -> web.Response:
        """The key's tenant's usage since ``?days=N`` days ago (default 1: today), written and pending."""
        try:
            key = await self._key(request)
            days = int(request.query.get("days", "1"))
            if not 1 <= days <= 366:
                raise ValueError
        except HttpError as error:
            return error.response()
        except ValueError:
            return HttpError(
                400, "days must be 1..366", type="invalid_request_error", code="invalid_request"
            ).response()
        since = datetime.now(UTC).date() - timedelta(days=days - 1)
        rows = await self._usage_of(key.tenant, since)
        totals: dict[tuple[str, str], dict[str, int]] = {}
        for row in rows:
            entry = totals.setdefault((str(row["day"]), row["model"]), dict.fromkeys(_USAGE_FIELDS, 0))
            for name in _USAGE_FIELDS:
                entry[name] += int(row[name])
        for event in list(self.usage.pending):
            if event.tenant != key.tenant or event.started_at.date() < since:
                continue
            entry = totals.setdefault((str(event.started_at.date()), event.model), dict.fromkeys(_USAGE_FIELDS, 0))
            entry["requests"] += 1
            entry["prompt_tokens"] += event.prompt_tokens
            entry["completion_tokens"] += event.completion_tokens
        data = [{"day": day, "model": model, **counts} for (day, model), counts in sorted(totals.items())]
        return web.json_response({"object": "list", "tenant": key.tenant, "data": data})

    def _no_model(self, name: str) -> HttpError:
        return HttpError(
            404,
            f"The model `{name}` does not exist or you do not have access to it.",
            type="invalid_request_error",
            code="model_not_found",
            param="model",
        )

    # -- the request path ------------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat.completions")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completions")

    async def _serve(self, request: web.Request, api: Api) -> web.StreamResponse:
        arrived = time.perf_counter()
        started_at = datetime.now(UTC)
        request_id = f"gw-{secrets.token_hex(12)}"
        model = ""
        try:
            key = await self._key(request)
            try:
                body = json.loads(await request.read())
            except ValueError:
                raise HttpError(
                    400, "the body is not JSON", type="invalid_request_error", code="invalid_request"
                ) from None
            except web.HTTPRequestEntityTooLarge:
                raise HttpError(
                    413, "the body is too large", type="invalid_request_error", code="request_too_large"
                ) from None
            try:
                ask = parse_ask(
                    api,
                    body,
                    {k.lower(): v for k, v in request.headers.items()},
                    chars_per_token=self.settings.chars_per_token,
                    default_output_tokens=self.settings.default_output_tokens,
                )
            except BadRequest as bad:
                raise HttpError(
                    400, str(bad), type="invalid_request_error", code="invalid_request", param=bad.param
                ) from None
            model = ask.model
            if (ask.model not in self.models and ask.model not in self.groups) or not key.allows(ask.model):
                raise self._no_model(ask.model)
            wait = self.keys.quota(key).admit(ask.input_tokens + ask.output_tokens, time.monotonic())
            if wait is not None:
                limit = f"{key.rpm} requests" if key.rpm else ""
                limit += (" and " if limit and key.tpm else "") + (f"{key.tpm} tokens" if key.tpm else "")
                raise HttpError(
                    429,
                    f"Rate limit reached for {key.key_id}: {limit} per minute.",
                    type="requests",
                    code="rate_limit_exceeded",
                    retry_after_s=retry_after(wait if wait != float("inf") else 60.0),
                )
        except HttpError as error:
            if error.code != "invalid_api_key":
                self.metrics.outcome(model, "rejected", error.code)
            return error.response(request_id)
        session = (key.tenant, ask.session_id) if ask.session_id else None
        if session is not None:
            self.sessions[session] += 1
        self.metrics.in_flight.inc()
        try:
            return await self._answer(request, api, body, ask, key, request_id, arrived, started_at)
        finally:
            self.metrics.in_flight.dec()
            if session is not None:
                self.sessions[session] -= 1
                if self.sessions[session] <= 0:
                    del self.sessions[session]

    async def _answer(
        self,
        request: web.Request,
        api: Api,
        body: dict[str, Any],
        ask: Ask,
        key: ApiKey,
        request_id: str,
        arrived: float,
        started_at: datetime,
    ) -> web.StreamResponse:
        try:
            attempt = await self._admit(ask, key, request_id)
        except HttpError as error:
            reason = error.code
            self.metrics.outcome(ask.model, "rejected", reason)
            return error.response(request_id)
        self.metrics.outcome(ask.model, "queued" if attempt.queued else "admitted")
        keeper = self._keep(attempt, key.tenant)
        response: web.StreamResponse | None = None
        outcome: UsageOutcome = "failed"
        try:
            while True:
                try:
                    response = await self._proxy(request, api, body, ask, attempt, request_id, arrived)
                    outcome = "completed" if response.status < 400 and not attempt.broken else "failed"
                    break
                except UpstreamFailed as failure:
                    self.metrics.outcome(ask.model, "failed_over", "upstream_error")
                    self.log.info(
                        "failing over",
                        extra={"request_id": request_id, "replica": attempt.admission.replica_id, "why": str(failure)},
                    )
                    failed = attempt.admission
                    self._spawn(self._release(failed, key.tenant))
                    if attempt.failovers >= self.settings.max_failovers:
                        raise HttpError(
                            502,
                            f"the engines failed this request ({attempt.failovers + 1} replicas tried): {failure}",
                            type="server_error",
                            code="upstream_error",
                        ) from None
                    attempt.failovers += 1
                    attempt.admission = await self._failover(ask, key, request_id, attempt, failed)
        except HttpError as error:
            self.metrics.outcome(ask.model, "failed", error.code)
            response = error.response(request_id)
        except (ConnectionResetError, asyncio.CancelledError):
            outcome = "cancelled"
            raise
        finally:
            keeper.cancel()
            e2e = time.perf_counter() - arrived
            admission = attempt.admission
            self._spawn(self._release(admission, key.tenant))
            if outcome == "completed":
                self.metrics.served(
                    attempt.labels, ttft_s=attempt.ttft_s, e2e_s=e2e, completion_tokens=attempt.completion_tokens
                )
            self.usage.record(
                UsageRecord(
                    request_id=request_id,
                    tenant=key.tenant,
                    key_id=key.key_id,
                    model=ask.model,
                    served_model=admission.model,
                    replica_id=admission.replica_id,
                    node=admission.node,
                    region=admission.region,
                    sku=admission.sku,
                    engine=admission.engine,
                    endpoint=api,
                    stream=ask.stream,
                    outcome=outcome,
                    prompt_tokens=attempt.prompt_tokens,
                    completion_tokens=attempt.completion_tokens,
                    failovers=attempt.failovers,
                    ttft_ms=attempt.ttft_s * 1000 if attempt.ttft_s is not None else None,
                    e2e_ms=e2e * 1000,
                    started_at=started_at,
                )
            )
        return response

    # -- routing and admission ---------------------------------------------------------------------

    def _slo(self, ask: Ask) -> Slo | None:
        if ask.ttft_ms is None and ask.tpot_ms is None:
            return None
        return Slo(ttft_ms=ask.ttft_ms, tpot_ms=ask.tpot_ms)

    async def _admit(self, ask: Ask, key: ApiKey, request_id: str) -> Attempt:
        select = RouteSelectRequest(
            request_id=request_id,
            tenant=key.tenant,
            session_id=ask.session_id,
            origin_region=ask.origin_region or self.region,
            model=ask.model,
            input_tokens=ask.input_tokens,
            output_tokens=ask.output_tokens,
            slo=self._slo(ask),
            in_flight=bool(ask.session_id and self.sessions[(key.tenant, ask.session_id)] > 1),
            hint=ask.hint,
        )
        try:
            reply = await self.rpc.ask(
                Rpc.ROUTE_SELECT, select, RouteSelectReply, timeout_s=self.settings.request_timeout_s
            )
        except RpcError as exc:
            raise HttpError(
                503, f"routing is unavailable: {exc.reason}", type="server_error", code="unavailable", retry_after_s=1
            ) from None
        if isinstance(reply, Rejected):
            raise refusal(reply.error.code, reply.error.message)
        if reply.status != "routed" or reply.admission is None:
            error = reply.error
            raise refusal(error.code if error else "no_capacity", error.message if error else "no region can take it")
        admission = reply.admission
        if admission.status == "rejected":
            error = admission.error
            raise refusal(error.code if error else "no_capacity", error.message if error else "no replica")
        attempt = Attempt(admission=admission)
        if admission.status == "queued":
            attempt.queued = True
            attempt.admission = await self._wait_queued(ask, key, request_id, reply.region)
        return attempt

    def _admit_request(self, ask: Ask, key: ApiKey, request_id: str, region: str | None, **extra: Any) -> AdmitRequest:
        return AdmitRequest(
            request_id=request_id,
            tenant=key.tenant,
            model=ask.model,
            input_tokens=ask.input_tokens,
            output_tokens=ask.output_tokens,
            slo=self._slo(ask),
            region=region,
            hint=ask.hint,
            session_id=ask.session_id,
            lease_s=self.settings.admission_lease_s,
            **extra,
        )

    async def _ask_admission(self, request: AdmitRequest) -> AdmitReply:
        try:
            reply = await self.rpc.ask(
                Rpc.PLACEMENT_ADMIT, request, AdmitReply, timeout_s=self.settings.request_timeout_s
            )
        except RpcError as exc:
            raise HttpError(
                503, f"admission is unavailable: {exc.reason}", type="server_error", code="unavailable", retry_after_s=1
            ) from None
        if isinstance(reply, Rejected):
            raise refusal(reply.error.code, reply.error.message)
        return reply

    async def _wait_queued(self, ask: Ask, key: ApiKey, request_id: str, region: str | None) -> AdmitReply:
        """Ask again with the same request id until admitted (admission answers its state), or give up."""
        deadline = time.monotonic() + self.settings.queue_wait_s
        request = self._admit_request(ask, key, request_id, region)
        while time.monotonic() < deadline:
            await asyncio.sleep(QUEUE_POLL_S)
            reply = await self._ask_admission(request)
            if reply.status == "admitted":
                return reply
            if reply.status == "rejected":
                error = reply.error
                raise refusal(error.code if error else "no_capacity", error.message if error else "no replica")
        raise HttpError(
            503,
            f"no replica of {ask.model} had room within {self.settings.queue_wait_s:g} s",
            type="service_unavailable",
            code="no_capacity",
            retry_after_s=1,
        )

    async def _failover(
        self, ask: Ask, key: ApiKey, request_id: str, attempt: Attempt, failed: AdmitReply
    ) -> AdmitReply:
        """The next replica for a request whose replica failed it (reported as ``failed_replica_id``)."""
        request = self._admit_request(
            ask,
            key,
            f"{request_id}.{attempt.failovers}",
            failed.region,
            failed_replica_id=failed.replica_id,
        )
        reply = await self._ask_admission(request)
        if reply.status == "queued":
            return await self._wait_queued(ask, key, request.request_id, failed.region)
        if reply.status != "admitted":
            error = reply.error
            raise refusal(error.code if error else "no_capacity", error.message if error else "no other replica")
        return reply

    def _keep(self, attempt: Attempt, tenant: str) -> Renewals:
        """Renew the request's admission every half lease while it runs (a long generation keeps its KV
        counted); cancelled when the request ends. A timer, not a task per request."""
        return Renewals(
            asyncio.get_running_loop(),
            min(self.settings.admission_lease_s, ROUTED_LEASE_S) / 2,  # route.select admits with its default
            lambda: self._spawn(self._renew(attempt.admission, tenant)),
        )

    async def _renew(self, admission: AdmitReply, tenant: str) -> None:
        if admission.allocation_id is None:
            return
        try:
            await self.rpc.ask(
                Rpc.PLACEMENT_RENEW,
                RenewRequest(
                    allocation_id=admission.allocation_id, tenant=tenant, lease_s=self.settings.admission_lease_s
                ),
                RenewReply,
                timeout_s=self.settings.request_timeout_s,
            )
        except RpcError as exc:
            self.log.warning(
                "admission not renewed", extra={"allocation": admission.allocation_id, "error": exc.reason}
            )

    async def _release(self, admission: AdmitReply, tenant: str) -> None:
        if admission.allocation_id is None:
            return
        try:
            await self.rpc.ask(
                Rpc.PLACEMENT_RELEASE,
                ReleaseRequest(allocation_id=admission.allocation_id, tenant=tenant),
                ReleaseReply,
                timeout_s=self.settings.request_timeout_s,
            )
        except RpcError as exc:  # the admission's lease ends it anyway
            self.log.warning(
                "admission not released", extra={"allocation": admission.allocation_id, "error": exc.reason}
            )

    # -- the engine ------------------------------------------------------------------------------

    @staticmethod
    def _usage(events: bytes, ask: Ask, attempt: Attempt) -> bytes:
        """Events that name usage: the counts of the usage chunk kept, the chunk itself dropped unless the
        client asked for it."""
        kept: list[bytes] = []
        for event in events.split(b"\n\n"):
            if not event:
                continue
            if b'"usage"' in event and b'"usage": null' not in event and b'"usage":null' not in event:
                chunk = read_line(event.strip())
                if chunk.usage is not None:
                    attempt.prompt_tokens, attempt.completion_tokens = usage_counts(chunk.usage)
                    if chunk.usage_only and not ask.include_usage:
                        continue
            kept.append(event + b"\n\n")
        return b"".join(kept)

    def _headers(self, attempt: Attempt, request_id: str) -> dict[str, str]:
        a = attempt.admission
        headers = {REQUEST_ID_HEADER: request_id}
        for name, value in (
            ("x-hetsched-replica-id", a.replica_id),
            ("x-hetsched-model", a.model),
            ("x-hetsched-engine", a.engine),
            ("x-hetsched-region", a.region),
            ("x-hetsched-sku", a.sku),
            ("x-hetsched-node", a.node),
        ):
            if value:
                headers[name] = value
        if attempt.failovers:
            headers["x-hetsched-failovers"] = str(attempt.failovers)
        return headers

    async def _proxy(
        self,
        request: web.Request,
        api: Api,
        body: dict[str, Any],
        ask: Ask,
        attempt: Attempt,
        request_id: str,
        arrived: float,
    ) -> web.StreamResponse:
        admission = attempt.admission
        if not admission.endpoint:
            raise UpstreamFailed(f"replica {admission.replica_id} has no endpoint")
        assert self._client is not None
        url = (
            f"{admission.endpoint.rstrip('/')}/v1/{'chat/completions' if api == 'chat.completions' else 'completions'}"
        )
        payload = json.dumps(upstream_body(body, model=admission.model or ask.model, stream=ask.stream)).encode()
        timeout = aiohttp.ClientTimeout(
            total=None, connect=self.settings.connect_timeout_s, sock_read=self.settings.idle_timeout_s
        )
        self.metrics.added(time.perf_counter() - arrived)
        try:
            async with asyncio.timeout(self.settings.first_token_timeout_s):
                upstream = await self._client.post(
                    url,
                    data=payload,
                    headers={"Content-Type": "application/json", REQUEST_ID_HEADER: request_id},
                    timeout=timeout,
                )
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise UpstreamFailed(f"{type(exc).__name__}: {exc}") from None
        try:
            if upstream.status >= 500:
                text = (await upstream.read())[:200].decode(errors="replace")
                raise UpstreamFailed(f"the engine answered {upstream.status}: {text}")
            if upstream.status != 200 or not ask.stream:
                return await self._whole(request, upstream, attempt, request_id, arrived)
            return await self._stream(request, upstream, ask, attempt, request_id, arrived)
        finally:
            upstream.release()

    async def _whole(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        attempt: Attempt,
        request_id: str,
        arrived: float,
    ) -> web.Response:
        try:
            async with asyncio.timeout(self.settings.first_token_timeout_s):
                data = await upstream.read()
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise UpstreamFailed(f"{type(exc).__name__}: {exc}") from None
        attempt.ttft_s = time.perf_counter() - arrived
        if upstream.status == 200:
            try:
                reply = json.loads(data)
            except ValueError:
                raise UpstreamFailed("the engine's reply is not JSON") from None
            attempt.prompt_tokens, attempt.completion_tokens = usage_counts(
                reply.get("usage") if isinstance(reply, dict) else None
            )
        headers = self._headers(attempt, request_id)
        headers["Content-Type"] = upstream.headers.get("Content-Type", "application/json")
        return web.Response(body=data, status=upstream.status, headers=headers)

    async def _stream(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        ask: Ask,
        attempt: Attempt,
        request_id: str,
        arrived: float,
    ) -> web.StreamResponse:
        # Up to the first token nothing reaches the client: a failure here fails over.
        held: list[bytes] = []
        try:
            async with asyncio.timeout(self.settings.first_token_timeout_s):
                while True:
                    line = await upstream.content.readline()
                    if not line:
                        raise UpstreamFailed("the engine closed the stream before its first token")
                    held.append(line)
                    if line.startswith(b"data:"):
                        chunk = read_line(line)
                        if chunk.usage is not None:
                            attempt.prompt_tokens, attempt.completion_tokens = usage_counts(chunk.usage)
                            if chunk.usage_only and not ask.include_usage:
                                held.pop()
                        if chunk.token or chunk.done:
                            break
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise UpstreamFailed(f"{type(exc).__name__}: {exc}") from None
        attempt.ttft_s = time.perf_counter() - arrived
        response = web.StreamResponse(status=200, headers={**SSE_HEADERS, **self._headers(attempt, request_id)})
        await response.prepare(request)
        await response.write(b"".join(held))
        try:
            # Then whole events as they come, one write per read: only an event naming usage is looked at.
            tail = b""
            while data := await upstream.content.readany():
                events, tail = split_events(tail + data)
                if events and b'"usage"' in events:
                    events = self._usage(events, ask, attempt)
                if events:
                    await response.write(events)
            if tail:
                await response.write(tail)
        except (aiohttp.ClientError, TimeoutError) as exc:
            # After the first token a request does not move: the client gets an error event and the end.
            attempt.broken = True
            self.log.warning("engine failed mid-stream", extra={"request_id": request_id, "error": str(exc)[:200]})
            error = error_body("the engine failed mid-stream", type="server_error", code="upstream_error")
            await response.write(b"data: " + json.dumps(error).encode() + b"\n\n")
        await response.write_eof()
        return response


_USAGE_FIELDS = ("requests", "prompt_tokens", "completion_tokens")
