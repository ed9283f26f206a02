"""Who may do what on the bus (shared/contracts/permissions.py), checked as data, and the rendered
authorization block checked by nats-server itself (``-t``: test the configuration and exit)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from hetsched.embedded import nats_server_binary
from hetsched.stack import service_permission_map
from services.registry import SERVICES
from shared.contracts.permissions import (
    EVENT_PUBLISHERS,
    STREAM_OWNERS,
    agent_identity,
    agent_permissions,
    gateway_identity,
    gateway_permissions,
    inbox_prefix,
)
from shared.contracts.subjects import TENANT_SCOPED, Context, Rpc, Subjects, token
from shared.infra.identity import (
    Identity,
    Registry,
    ensure_operator,
    ensure_seeded,
    new_seed,
    public_key,
    write_auth_conf,
)
from shared.infra.settings import Settings

REPO = Path(__file__).resolve().parents[2]
SUBJECTS = Subjects("hetsched")
SETTINGS = Settings(kit={"subject_prefix": "hetsched", "stream_prefix": ""})


def test_a_gateway_reaches_its_tenants_public_subjects_and_nothing_else() -> None:
    perms = gateway_permissions(gateway_identity("gw"), ["acme", "a.b"], SUBJECTS)
    for rpc in TENANT_SCOPED:
        assert SUBJECTS.scoped(rpc, "acme") in perms.publish
        assert SUBJECTS.scoped(rpc, "a.b") in perms.publish
        assert SUBJECTS.rpc(rpc) not in perms.publish  # the unscoped form acts for any tenant
    assert SUBJECTS.rpc(Rpc.FLEET_GET) in perms.publish
    assert not any(
        s.startswith(("hetsched.ledger", "hetsched.events", "$JS", "hetsched.topology")) for s in perms.publish
    )
    assert perms.subscribe == (f"{inbox_prefix(gateway_identity('gw'))}.>",)
    assert not perms.allow_responses
    assert all("*" not in s and ">" not in s for s in perms.publish)


def test_an_agent_publishes_only_its_own_nodes_subjects() -> None:
    perms = agent_permissions("node-1", SUBJECTS)
    assert set(perms.publish) == {
        "hetsched.topology.report.node-1",
        "hetsched.placement.assignments.node-1",
        "hetsched.topology.heartbeat.node-1",
        "hetsched.events.telemetry.gpu.node-1",
        "hetsched.events.telemetry.engine_status.node-1",
        "hetsched.events.telemetry.replica_state.node-1",
    }
    assert f"{inbox_prefix(agent_identity('node-1'))}.>" in perms.subscribe
    assert agent_permissions("a.b", SUBJECTS).publish[0].endswith("." + token("a.b"))


def test_services_publish_only_their_own_events_and_only_callers_reach_the_ledger() -> None:
    perms = service_permission_map(SETTINGS)
    for name, p in perms.items():
        own = {c for c, publisher in EVENT_PUBLISHERS.items() if publisher == name}
        for context in Context:
            assert (SUBJECTS.events_of(context) in p.publish) == (context in own), (name, context)
        assert ">" not in p.publish and ">" not in p.subscribe, name
        # No stream administration beyond its own streams: no purge, no delete, no other's create.
        assert not any(s.startswith(("$JS.API.STREAM.PURGE", "$JS.API.STREAM.DELETE")) for s in p.publish), name
        for context, owner in STREAM_OWNERS.items():
            stream = context.value.upper()
            assert (f"$JS.API.STREAM.UPDATE.{stream}" in p.publish) == (owner == name), (name, stream)
        assert p.subscribe[0] == f"_INBOX_svc_{next(d.schema for d in SERVICES.values() if d.name == name)}.>"
    callers = {name for name, p in perms.items() if any(s.startswith("hetsched.ledger.") for s in p.publish)}
    assert callers == {"placement", "reservation-filler", "rebalancer"}
    # The filler reaches the ledger only to preempt its borrowers; only placement asks it to reclaim.
    assert [s for s in perms["reservation-filler"].publish if s.startswith("hetsched.ledger.")] == [
        "hetsched.ledger.preempt"
    ]
    # The rebalancer reads the ledger's snapshot when it plans; it moves replicas through placement.
    assert [s for s in perms["rebalancer"].publish if s.startswith("hetsched.ledger.")] == ["hetsched.ledger.snapshot"]
    reclaimers = {n for n, p in perms.items() if "hetsched.reservation.reclaim" in p.publish}
    assert reclaimers == {"placement"}
    assert any(s == "hetsched.placement.place.*" for s in perms["placement"].subscribe)
    assert "hetsched.topology.heartbeat.*" in perms["topology-discovery"].subscribe


@pytest.fixture
def registry_dir(tmp_path: Path) -> tuple[Path, Registry]:
    directory = tmp_path / "nats"
    registry = Registry()
    ensure_operator(directory, registry)
    for definition in SERVICES.values():
        ensure_seeded(directory, registry, id=f"svc_{definition.schema}", kind="service", name=definition.name)
    seed = new_seed()
    registry.add(Identity(id=gateway_identity("gw"), kind="gateway", public_key=public_key(seed), tenants=["acme"]))
    seed = new_seed()
    registry.add(Identity(id=agent_identity("n1"), kind="agent", public_key=public_key(seed), node="n1"))
    return directory, registry


def test_the_rendered_authorization_is_a_valid_server_configuration(registry_dir: tuple[Path, Registry]) -> None:
    directory, registry = registry_dir
    auth = write_auth_conf(directory, registry, service_permission_map(SETTINGS))
    assert auth.stat().st_mode & 0o077 == 0
    text = auth.read_text()
    assert text.count("nkey:") == len(registry.identities) and "no_auth_user" not in text
    config = directory / "server.conf"
    config.write_text(
        f"listen: 127.0.0.1:-1\njetstream {{ store_dir: {str(directory / 'js')!r} }}\ninclude auth.conf\n"
    )
    result = subprocess.run([nats_server_binary(), "-t", "-c", str(config)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_cluster_configuration_with_its_authorization_is_valid(
    registry_dir: tuple[Path, Registry], tmp_path: Path
) -> None:
    directory, registry = registry_dir
    write_auth_conf(directory, registry, service_permission_map(SETTINGS))
    shutil.copy(REPO / "infra" / "nats" / "jetstream-cluster.conf", directory / "cluster.conf")
    text = (directory / "cluster.conf").read_text().replace("/data/jetstream", str(tmp_path / "js"))
    (directory / "cluster.conf").write_text(text)
    result = subprocess.run(
        [nats_server_binary(), "-t", "-c", str(directory / "cluster.conf")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_publisher_named_in_the_map_is_a_real_services_source() -> None:
    """``source`` is what consumers check events against: each publisher is a service's own name (the
    unit of work stamps it) or the agent's."""
    from services.topology_discovery.agent import SOURCE as AGENT_SOURCE

    names = {definition.name for definition in SERVICES.values()}
    for context, publisher in EVENT_PUBLISHERS.items():
        assert publisher in names or (context is Context.TELEMETRY and publisher == AGENT_SOURCE), context
