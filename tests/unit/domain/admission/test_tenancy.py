"""Tenancy: whose replicas a tenant's requests may use."""

from __future__ import annotations

from shared.domain.admission import Tenancy


def test_own_allows_the_tenants_own_replicas_and_the_shared_owners_only() -> None:
    own = Tenancy()
    assert own.allows("acme", "acme")
    assert not own.allows("acme", "globex") and not own.allows("acme", "platform")
    shared = Tenancy.of("own", ["platform"])
    assert shared.allows("acme", "platform") and shared.allows("globex", "platform")
    assert shared.allows("platform", "platform") and not shared.allows("acme", "globex")
    assert not shared.allows("acme", "Acme")  # names compare exactly


def test_any_allows_every_replica_to_every_tenant() -> None:
    assert Tenancy.of("any").allows("acme", "globex")
