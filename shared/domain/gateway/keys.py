"""API keys of the gateway: their form, their hash and what a key lets its holder call. No IO.

A key is ``hsk-<id>-<secret>``: ``<id>`` is 12 hex digits (the stored ``key_id`` is ``key-<id>``, what
lists, logs and revocation name), ``<secret>`` 256 random bits, URL-safe base64 (43 characters). Only
``sha256(secret)`` is stored: a secret that random cannot be guessed from its hash, so a fast unsalted
hash is enough (as GitHub's tokens are kept), and checking one costs a microsecond, not a KDF's 100 ms.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

KEY_PREFIX = "hsk-"
"""What every plaintext key starts with (secret scanners can look for it)."""
ID_PREFIX = "key-"
"""What every ``key_id`` starts with: ``hetsched credentials revoke key-...`` is an API key."""
ID_BYTES = 6  # 12 hex digits
SECRET_BYTES = 32  # 256 bits
MAX_PLAINTEXT = 256
"""Longer input is not a key (nothing is hashed for it)."""

_PLAINTEXT = re.compile(r"hsk-(?P<id>[0-9a-f]{12})-(?P<secret>[A-Za-z0-9_-]{43})")

Entropy = Callable[[int], bytes]


class NewKey(NamedTuple):
    """A key just made: ``plaintext`` is shown once, to whoever asked for it; only ``key_id`` and the
    secret's hash are kept."""

    key_id: str
    secret: str
    plaintext: str


def new_key(entropy: Entropy = secrets.token_bytes) -> NewKey:
    """A fresh key. ``entropy(n)`` gives n random bytes: the OS's CSPRNG unless a test hands in its own."""
    key_hex = entropy(ID_BYTES).hex()
    secret = base64.urlsafe_b64encode(entropy(SECRET_BYTES)).rstrip(b"=").decode("ascii")
    return NewKey(key_id=ID_PREFIX + key_hex, secret=secret, plaintext=f"{KEY_PREFIX}{key_hex}-{secret}")


def parse_key(plaintext: object) -> tuple[str, str] | None:
    """``(key_id, secret)`` of a key in its plaintext form (an ``Authorization: Bearer`` value, stripped);
    None for anything else, whatever it is. Never raises."""
    if not isinstance(plaintext, str) or len(plaintext) > MAX_PLAINTEXT:
        return None
    found = _PLAINTEXT.fullmatch(plaintext)
    if found is None:
        return None
    return ID_PREFIX + found["id"], found["secret"]


def hash_secret(secret: str) -> str:
    """What is stored for a secret: its SHA-256, 64 hex digits."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def verify(secret: str, stored_hash: str) -> bool:
    """Whether ``secret`` is the one ``stored_hash`` was made from, in time that does not depend on where
    they differ."""
    return hmac.compare_digest(hash_secret(secret).encode("ascii"), stored_hash.encode("utf-8"))


@dataclass(frozen=True, slots=True)
class ApiKey:
    """A stored key: whose it is (``tenant``), its admission ``priority``, its quotas per minute (``rpm``
    requests, ``tpm`` tokens; None: unlimited) and the models it may call (``models``: model or
    model-group names; None: every model and group of the catalog)."""

    key_id: str
    tenant: str
    secret_hash: str
    name: str | None = None
    priority: int = 0
    rpm: int | None = None
    tpm: int | None = None
    models: frozenset[str] | None = None
    revoked: bool = False

    def allows(self, model_name: str) -> bool:
        """Whether a request for ``model_name`` (a model or a model group, as the client named it) may go
        through with this key: never once revoked; any name without an allow-list."""
        if self.revoked:
            return False
        return self.models is None or model_name in self.models


def allow_list(models: Iterable[str] | None) -> frozenset[str] | None:
    """The allow-list as stored: None (every model) when none is given; an empty list is no model at all."""
    return None if models is None else frozenset(models)
