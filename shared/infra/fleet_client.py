"""Client side of `fleet.get`: follows `next_cursor` until the whole fleet is read."""

from __future__ import annotations

import json
from typing import Any

from nats.aio.client import Client

from shared.contracts.subjects import Rpc, Subjects


async def fetch_fleet(
    nc: Client, subjects: Subjects, *, region: str | None = None, timeout_s: float = 10.0, limit: int | None = None
) -> dict[str, Any]:
    """Every page of `fleet.get` merged into one reply (a rejection is returned as it came)."""
    merged: dict[str, Any] | None = None
    cursor: str | None = None
    while True:
        body: dict[str, Any] = {k: v for k, v in (("region", region), ("cursor", cursor), ("limit", limit)) if v}
        msg = await nc.request(subjects.rpc(Rpc.FLEET_GET), json.dumps(body).encode(), timeout=timeout_s)
        page: dict[str, Any] = json.loads(msg.data)
        if page.get("status") != "ok":
            return page
        if merged is None:
            merged = page
        else:
            merged["nodes"].extend(page["nodes"])
            known = {d["id"] for d in merged["domains"]}
            merged["domains"].extend(d for d in page["domains"] if d["id"] not in known)
        cursor = page.get("next_cursor")
        if not cursor:
            merged["next_cursor"] = None
            return merged
