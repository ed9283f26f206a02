"""The API keys in memory: re-read from the gateway's table every ``keys_refresh_s`` (a revoked key stops
working within that), and when a request names a key id the ring does not know, at most once per
``MISS_REFRESH_S`` (a key issued a moment ago works at its first request, after at most that wait)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from shared.domain.gateway.keys import ApiKey, parse_key, verify
from shared.domain.gateway.quota import Quota

MISS_REFRESH_S = 0.5


class KeyRing:
    def __init__(self, load: Callable[[], Awaitable[list[ApiKey]]], *, every_s: float, log: logging.Logger) -> None:
        self._load = load
        self._every_s = every_s
        self._log = log
        self._keys: dict[str, ApiKey] = {}
        self._quotas: dict[str, Quota] = {}
        self._loaded_at = 0.0
        self._lock = asyncio.Lock()
        self._miss_lock = asyncio.Lock()
        self.loaded = False

    async def refresh(self) -> None:
        async with self._lock:
            keys = await self._load()
            self._keys = {k.key_id: k for k in keys}
            for key in keys:  # a key's buckets survive a refresh unless its limits changed
                quota = self._quotas.get(key.key_id)
                if quota is None or (quota.rpm, quota.tpm) != (key.rpm, key.tpm):
                    self._quotas[key.key_id] = Quota(rpm=key.rpm, tpm=key.tpm)
            for gone in self._quotas.keys() - self._keys.keys():
                del self._quotas[gone]
            self._loaded_at = time.monotonic()
            self.loaded = True

    async def run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as exc:  # Postgres away: keep the keys we have, try again
                self._log.warning("API keys not refreshed", extra={"error": str(exc)[:200]})
            await asyncio.sleep(self._every_s)

    async def lookup(self, authorization: str | None) -> ApiKey | None:
        """The key an ``Authorization: Bearer <key>`` header carries, or None (missing, malformed, unknown,
        revoked, or a secret that does not match)."""
        if not authorization:
            return None
        scheme, _, plaintext = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return None
        parsed = parse_key(plaintext.strip())
        if parsed is None:
            return None
        key_id, secret = parsed
        key = self._keys.get(key_id)
        if key is None:
            await self._refresh_for_miss()
            key = self._keys.get(key_id)
        if key is None or key.revoked or not verify(secret, key.secret_hash):
            return None
        return key

    async def _refresh_for_miss(self) -> None:
        """Read the keys again for a key id not known: at most once per ``MISS_REFRESH_S`` (ids that exist
        nowhere cost Postgres no more than that), waiting for the next allowed read; misses that wait
        together share one read."""
        asked = time.monotonic()
        wait = self._loaded_at + MISS_REFRESH_S - asked
        if wait > 0:
            await asyncio.sleep(wait)
        async with self._miss_lock:
            if self._loaded_at >= asked:  # read since this miss came: that read answers it
                return
            try:
                await self.refresh()
            except Exception as exc:
                self._log.warning("API keys not refreshed", extra={"error": str(exc)[:200]})

    def quota(self, key: ApiKey) -> Quota:
        quota = self._quotas.get(key.key_id)
        if quota is None:
            quota = self._quotas[key.key_id] = Quota(rpm=key.rpm, tpm=key.tpm)
        return quota
