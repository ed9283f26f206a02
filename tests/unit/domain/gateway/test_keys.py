"""API keys, purely: the plaintext form, parsing anything, hashing, verifying, the model allow-list."""

from __future__ import annotations

import base64
import hashlib

import pytest

from shared.domain.gateway.keys import ApiKey, allow_list, hash_secret, new_key, parse_key, verify


def fixed(n: int) -> bytes:
    return bytes(range(n))


def test_a_new_key_has_the_documented_form_and_parses_back() -> None:
    key_id, secret, plaintext = new_key()
    assert key_id.startswith("key-") and len(key_id) == 16 and int(key_id[4:], 16) >= 0
    assert len(secret) == 43  # 32 bytes, URL-safe base64 without padding
    assert plaintext == f"hsk-{key_id[4:]}-{secret}"
    assert parse_key(plaintext) == (key_id, secret)


def test_the_entropy_handed_in_is_the_only_randomness() -> None:
    first, second = new_key(fixed), new_key(fixed)
    assert first == second
    assert first.key_id == "key-000102030405"
    assert first.secret == base64.urlsafe_b64encode(bytes(range(32))).rstrip(b"=").decode()


def test_fresh_keys_differ() -> None:
    made = [new_key() for _ in range(50)]
    assert len({k.key_id for k in made}) == 50 and len({k.secret for k in made}) == 50


def test_a_secret_with_dashes_parses_whole() -> None:
    secret = "-" * 10 + "_" * 10 + "A" * 23
    assert parse_key(f"hsk-0123456789ab-{secret}") == ("key-0123456789ab", secret)


@pytest.mark.parametrize(
    "garbage",
    [
        None,
        42,
        b"hsk-0123456789ab-" + b"A" * 43,
        "",
        "hsk-",
        "hsk--",
        "Bearer hsk-0123456789ab-" + "A" * 43,
        "hsk-0123456789ab-" + "A" * 42,  # a character short
        "hsk-0123456789ab-" + "A" * 44,  # one too many
        "hsk-0123456789AB-" + "A" * 43,  # the id is lower-case hex
        "hsk-0123456789a-" + "A" * 44,
        "hsk-0123456789abc-" + "A" * 42,
        "hsk-0123456789ab-" + "A" * 42 + "=",
        "hsk-0123456789ab-" + "A" * 42 + "\n",
        "sk-0123456789ab-" + "A" * 43,  # OpenAI's prefix, not ours
        "key-0123456789ab",
        "hsk-0123456789ab-" + "é" * 43,
        "hsk-0123456789ab-" + "A" * 10_000,
        "\x00" * 60,
    ],
)
def test_anything_else_is_not_a_key_and_never_raises(garbage: object) -> None:
    assert parse_key(garbage) is None


def test_the_hash_is_sha256_hex_of_the_secret() -> None:
    _, secret, _ = new_key()
    assert hash_secret(secret) == hashlib.sha256(secret.encode()).hexdigest()
    assert len(hash_secret(secret)) == 64


def test_verify_takes_the_right_secret_only() -> None:
    _, secret, _ = new_key()
    stored = hash_secret(secret)
    assert verify(secret, stored)
    assert not verify(secret[:-1] + ("A" if secret[-1] != "A" else "B"), stored)
    assert not verify(new_key().secret, stored)
    assert not verify(secret, stored.upper())
    assert not verify(secret, "")
    assert not verify(secret, "é" * 64)  # a corrupt stored value is a mismatch, not an error


def key(**fields: object) -> ApiKey:
    return ApiKey(**{"key_id": "key-0123456789ab", "tenant": "acme", "secret_hash": "0" * 64, **fields})  # type: ignore[arg-type]


def test_without_an_allow_list_every_model_is_allowed() -> None:
    assert key().allows("llama3.1-8b") and key().allows("chat-large")


def test_an_allow_list_admits_only_its_names() -> None:
    limited = key(models=allow_list(["llama3.1-8b", "chat-large"]))
    assert limited.allows("llama3.1-8b") and limited.allows("chat-large")
    assert not limited.allows("llama3.1-70b")
    assert not limited.allows("LLAMA3.1-8B")
    assert not key(models=allow_list([])).allows("llama3.1-8b")


def test_a_revoked_key_allows_nothing() -> None:
    assert not key(revoked=True).allows("llama3.1-8b")
    assert not key(revoked=True, models=frozenset({"llama3.1-8b"})).allows("llama3.1-8b")


def test_a_key_is_frozen() -> None:
    with pytest.raises(AttributeError):
        key().tenant = "other"  # type: ignore[misc]
