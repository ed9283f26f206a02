"""The gateway as a process (`python -m services.gateway`) on real NATS and Postgres, facing bad input: no
key, a wrong or revoked key (401), not JSON or not a request (400), an unknown or forbidden model (404), a
body over its limit (413), a key over its quota (429 with Retry-After); each in OpenAI's error shape, and
the gateway serves on. What needs engines is in tests/e2e/test_gateway_up.py."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from hetsched.stack import wait_healthy
from services.gateway import keystore
from shared.contracts.subjects import Subjects
from shared.infra.db import make_engine
from shared.infra.settings import Settings
from tests.conftest import ServiceProcesses

BODY_LIMIT = 64 * 1024


class Reply:
    def __init__(self, status_code: int, headers: dict[str, str], text: str) -> None:
        self.status_code, self.headers, self.text = status_code, headers, text

    def json(self) -> Any:
        return json.loads(self.text)


class Http:
    """A small HTTP client on aiohttp (the gateway's own stack) returning whole replies."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))

    async def __aenter__(self) -> Http:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.session.close()

    async def _send(self, method: str, path: str, **kw: Any) -> Reply:
        async with self.session.request(method, self.base_url + path, **kw) as reply:
            headers = {k.lower(): v for k, v in reply.headers.items()}
            return Reply(reply.status, headers, await reply.text())

    async def get(self, path: str, headers: dict[str, str] | None = None) -> Reply:
        return await self._send("GET", path, headers=headers or {})

    async def post(
        self, path: str, *, json: Any = None, content: bytes | None = None, headers: dict[str, str] | None = None
    ) -> Reply:
        if content is not None:
            return await self._send(
                "POST", path, data=content, headers={"Content-Type": "application/json", **(headers or {})}
            )
        return await self._send("POST", path, json=json, headers=headers or {})


class Keys:
    def __init__(self, settings: Settings) -> None:
        self.engine = make_engine(settings.kit.database_url or "", pool_size=1)

    async def issue(self, tenant: str, **limits: Any) -> tuple[str, str]:
        async with self.engine.begin() as conn:
            key, plaintext = await keystore.issue(conn, tenant=tenant, **limits)
        return key.key_id, plaintext

    async def revoke(self, key_id: str) -> None:
        async with self.engine.begin() as conn:
            assert await keystore.revoke(conn, key_id)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def gateway(service_processes: ServiceProcesses, settings: Settings) -> AsyncIterator[str]:
    proc = service_processes.start(
        "gateway",
        name="gateway-bad-input",
        HETSCHED_GATEWAY_PORT="0",
        HETSCHED_GATEWAY_KEYS_REFRESH_S="0.5",
        HETSCHED_GATEWAY_MAX_BODY_BYTES=str(BODY_LIMIT),
        HETSCHED_GATEWAY_QUEUE_WAIT_S="1",
        HETSCHED_METRICS_PORT="0",
    )
    try:
        health = await wait_healthy(
            nats_url=settings.kit.nats_url or "",
            subjects=Subjects(settings.kit.subject_prefix),
            deadline_s=60,
            only={"gateway"},
        )
        assert health["gateway"]["status"] == "ok", (health, service_processes.log("gateway-bad-input"))
        url = health["gateway"]["http_url"]
        assert url and url.startswith("http://127.0.0.1:")
        yield url
    finally:
        service_processes.stop("gateway-bad-input")
        assert proc.returncode == 0, service_processes.log("gateway-bad-input")[-3000:]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def keys(settings: Settings) -> AsyncIterator[Keys]:
    made = Keys(settings)
    yield made
    await made.engine.dispose()


def error_of(reply: Reply) -> dict[str, Any]:
    body = reply.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
    assert reply.status_code == 401 or reply.headers["x-request-id"].startswith("gw-")
    return dict(body["error"])


CHAT = {"model": "llama3-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.asyncio(loop_scope="session")
async def test_a_missing_wrong_or_revoked_key_is_401(gateway: str, keys: Keys) -> None:
    key_id, key = await keys.issue("acme")
    async with Http(gateway) as http:
        for headers in (
            {},
            {"Authorization": "Bearer"},
            {"Authorization": "Basic dXNlcjpwYXNz"},
            {"Authorization": "Bearer hsk-nope"},
            {"Authorization": "Bearer " + key[:-1] + ("A" if key[-1] != "A" else "B")},  # its id, another secret
        ):
            for reply in (
                await http.get("/v1/models", headers=headers),
                await http.post("/v1/chat/completions", json=CHAT, headers=headers),
            ):
                assert reply.status_code == 401, (headers, reply.text)
                assert error_of(reply)["code"] == "invalid_api_key"
        good = {"Authorization": f"Bearer {key}"}
        assert (await http.get("/v1/models", headers=good)).status_code == 200
        await keys.revoke(key_id)
        deadline = time.monotonic() + 5
        while (await http.get("/v1/models", headers=good)).status_code == 200:
            assert time.monotonic() < deadline, "a revoked key still works"
            await asyncio.sleep(0.1)
        assert error_of(await http.get("/v1/models", headers=good))["code"] == "invalid_api_key"


@pytest.mark.asyncio(loop_scope="session")
async def test_not_a_request_is_400_and_an_unknown_or_forbidden_model_404(gateway: str, keys: Keys) -> None:
    _, key = await keys.issue("acme", models=["llama3-8b", "chat-long"])
    auth = {"Authorization": f"Bearer {key}"}
    async with Http(gateway) as http:
        listed = (await http.get("/v1/models", headers=auth)).json()
        assert {m["id"] for m in listed["data"]} == {"llama3-8b", "chat-long"}
        group = next(m for m in listed["data"] if m["id"] == "chat-long")
        assert group["kind"] == "group" and "mamba2-2.7b" in group["members"]
        for body, param in (
            (b"{not json", None),
            (b"[1, 2]", None),
            (b'{"messages": [{"role": "user", "content": "hi"}]}', "model"),
            (b'{"model": "llama3-8b", "messages": "hi"}', "messages"),
            (
                b'{"model": "llama3-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}',
                "max_tokens",
            ),
        ):
            reply = await http.post("/v1/chat/completions", content=body, headers=auth)
            assert reply.status_code == 400, (body, reply.text)
            error = error_of(reply)
            assert error["type"] == "invalid_request_error" and error["param"] == param, error
        bad_prompt = await http.post("/v1/completions", json={"model": "llama3-8b", "prompt": {"x": 1}}, headers=auth)
        assert bad_prompt.status_code == 400 and error_of(bad_prompt)["param"] == "prompt"
        for model in ("no-such-model", "mixtral-8x7b", "mamba2-2.7b"):  # unknown; known but not on this key
            reply = await http.post("/v1/chat/completions", json=CHAT | {"model": model}, headers=auth)
            assert reply.status_code == 404, reply.text
            assert error_of(reply)["code"] == "model_not_found"
        assert (await http.get("/v1/models/mixtral-8x7b", headers=auth)).status_code == 404
        assert (await http.get("/v1/models/chat-long", headers=auth)).json()["id"] == "chat-long"
        big = {"model": "llama3-8b", "prompt": "x" * (BODY_LIMIT + 1)}
        too_large = await http.post("/v1/completions", json=big, headers=auth)
        assert too_large.status_code == 413, too_large.text
        assert error_of(too_large)["code"] == "request_too_large"
        assert (await http.get("/health")).status_code == 200  # served on through all of it


@pytest.mark.asyncio(loop_scope="session")
async def test_a_key_over_its_quota_is_429_with_retry_after(gateway: str, keys: Keys) -> None:
    _, key = await keys.issue("quota-tenant", rpm=2)
    _, roomy = await keys.issue("quota-tenant")
    async with Http(gateway) as http:
        statuses = [
            (await http.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {key}"})).status_code
            for _ in range(2)
        ]
        assert 429 not in statuses  # within its quota: routed (no replica here: 503)
        over = await http.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {key}"})
        assert over.status_code == 429, over.text
        assert error_of(over)["code"] == "rate_limit_exceeded"
        assert 1 <= int(over.headers["retry-after"]) <= 30
        other = await http.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {roomy}"})
        assert other.status_code != 429  # quotas are per key
        too_big = await keys.issue("quota-tenant", tpm=100)
        huge = CHAT | {"max_tokens": 1000}  # more than a whole minute's tokens: never
        refused = await http.post("/v1/chat/completions", json=huge, headers={"Authorization": f"Bearer {too_big[1]}"})
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) == 60


@pytest.mark.asyncio(loop_scope="session")
async def test_with_no_replica_the_request_is_503_and_the_usage_endpoint_shows_nothing_of_others(
    gateway: str, keys: Keys
) -> None:
    _, key = await keys.issue("lonely")
    auth = {"Authorization": f"Bearer {key}"}
    async with Http(gateway) as http:
        reply = await http.post("/v1/chat/completions", json=CHAT, headers=auth)
        assert reply.status_code == 503, reply.text
        assert error_of(reply)["code"] in ("no_capacity", "unavailable")
        assert int(reply.headers["retry-after"]) >= 1
        usage = (await http.get("/v1/usage", headers=auth)).json()
        assert usage["tenant"] == "lonely" and usage["data"] == []
        assert (await http.get("/v1/usage?days=0", headers=auth)).status_code == 400
        metrics = (await http.get("/metrics")).text
        assert 'hetsched_gateway_requests_total{model="llama3-8b",outcome="rejected"' in metrics
        assert 'hetsched_gateway_slo_ttft_seconds{model="llama3-8b"} 0.2' in metrics
