"""TLS for NATS, the documented option (docs/SECURITY.md), tested once with self-signed certificates:
a server that requires TLS and NKeys, a service that connects with the operator's CA (its health
answers over TLS), and clients without TLS or trusting another CA refused."""

from __future__ import annotations

import asyncio
import ssl
import subprocess
from pathlib import Path

import nats
import pytest

from hetsched.embedded import _wait_port, free_port, nats_server_binary, stop_process
from hetsched.stack import service_permission_map, wait_healthy
from services.registry import SERVICES
from shared.contracts.permissions import inbox_prefix, service_identity
from shared.contracts.subjects import Subjects
from shared.infra.identity import Registry, connect_options, ensure_operator, ensure_seeded, write_auth_conf
from shared.infra.settings import Settings
from tests.certs import certificates
from tests.conftest import ServiceProcesses

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_services_and_clients_use_tls_with_the_operators_ca(settings: Settings, tmp_path: Path) -> None:
    ca, cert, key = certificates(tmp_path / "tls", "nats")
    other_ca, _, _ = certificates(tmp_path / "other", "other")
    directory = tmp_path / "identities"
    registry = Registry(subject_prefix=settings.kit.subject_prefix, stream_prefix=settings.kit.stream_prefix)
    operator = ensure_operator(directory, registry)
    rebalancer = SERVICES["rebalancer"]
    seed = ensure_seeded(
        directory, registry, id=service_identity(rebalancer.schema), kind="service", name=rebalancer.name
    )
    write_auth_conf(directory, registry, service_permission_map(settings))
    port = free_port()
    (directory / "server.conf").write_text(
        f"listen: 127.0.0.1:{port}\n"
        f"jetstream {{ store_dir: {str(tmp_path / 'js')!r} }}\n"
        f"tls {{ cert_file: {str(cert)!r}, key_file: {str(key)!r} }}\n"
        "include auth.conf\n"
    )
    server = subprocess.Popen(
        [nats_server_binary(), "-c", str(directory / "server.conf")],
        stdout=open(tmp_path / "nats.log", "ab"),
        stderr=subprocess.STDOUT,
    )
    url = f"tls://127.0.0.1:{port}"
    procs = ServiceProcesses(settings.updated(kit={"nats_url": url}), tmp_path)
    try:
        await asyncio.to_thread(_wait_port, "127.0.0.1", port, proc=server, deadline_s=20, what="nats-server")
        trusted = settings.updated(kit={"nats_nkey_seed_file": operator, "nats_tls_ca_file": ca})
        nc = await nats.connect(url, max_reconnect_attempts=0, **connect_options(trusted))
        assert nc.is_connected and (await nc.jetstream().account_info()) is not None
        await nc.close()
        # Another CA's certificate does not verify; a client without TLS is refused.
        wrong = trusted.updated(kit={"nats_tls_ca_file": other_ca})
        with pytest.raises((ssl.SSLError, OSError, nats.errors.Error)):
            await nats.connect(url, max_reconnect_attempts=0, allow_reconnect=False, **connect_options(wrong))
        with pytest.raises(Exception):  # noqa: B017 - refused however the client reports it
            await nats.connect(
                f"nats://127.0.0.1:{port}", nkeys_seed=str(operator), max_reconnect_attempts=0, allow_reconnect=False
            )
        # A service with the CA setting connects over TLS as its own identity and answers its health.
        procs.start(
            "rebalancer",
            HETSCHED_NATS_NKEY_SEED_FILE=str(seed),
            HETSCHED_NATS_INBOX_PREFIX=inbox_prefix(service_identity(rebalancer.schema)),
            HETSCHED_NATS_TLS_CA_FILE=str(ca),
        )
        health = await wait_healthy(
            nats_url=url,
            subjects=Subjects(settings.kit.subject_prefix),
            deadline_s=60,
            only={"rebalancer"},
            **connect_options(trusted),
        )
        assert health["rebalancer"]["status"] == "ok", (health, procs.log("rebalancer")[-2000:])
    finally:
        procs.stop_all()
        stop_process(server)
