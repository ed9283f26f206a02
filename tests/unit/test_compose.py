"""docker-compose.yml is checked without a Docker engine: every command names a real module or tool,
every HETSCHED_ variable is a real setting, and the services wait for healthy servers and migrate."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import yaml

from services.registry import SERVICES
from shared.infra.settings import env_vars

REPO = Path(__file__).resolve().parents[2]
ROLE_PASSWORD = "HETSCHED_DATABASE_ROLE_PASSWORD"


def _compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    return data


def test_six_services_each_run_a_real_module() -> None:
    services = _compose()["services"]
    modules = set()
    for name, spec in services.items():
        command = spec.get("command", [])
        if command[:2] == ["python", "-m"]:
            module = command[2]
            assert importlib.util.find_spec(module) is not None, f"{name}: no module {module}"
            assert importlib.util.find_spec(f"{module}.__main__") is not None, f"{name}: {module} is not runnable"
            modules.add(module)
    assert modules == {f"services.{p}" for p in SERVICES}


def test_every_hetsched_variable_is_a_real_setting() -> None:
    fields = set(env_vars())
    for name, spec in _compose()["services"].items():
        for key in spec.get("environment") or {}:
            if key.startswith("HETSCHED_"):
                assert key in fields, f"{name} sets {key}, which no setting reads"


def test_services_wait_for_healthy_servers_and_a_completed_migration() -> None:
    services = _compose()["services"]
    assert services["nats"]["healthcheck"] and services["nats"]["command"] == ["-c", "/creds/nats/server.conf"]
    assert "pg_isready" in " ".join(services["postgres"]["healthcheck"]["test"])
    assert services["migrate"]["command"] == ["alembic", "upgrade", "head"]
    for name, spec in services.items():
        if spec.get("command", [])[:2] == ["python", "-m"]:
            deps = spec["depends_on"]
            assert deps["nats"]["condition"] == "service_healthy", name
            assert deps["postgres"]["condition"] == "service_healthy", name
            assert deps["migrate"]["condition"] == "service_completed_successfully", name
    assert (REPO / "Dockerfile").exists()


def test_migration_and_services_share_the_service_roles_password() -> None:
    """Compose's Postgres uses password auth: the migration sets the per-service roles' password and
    every service connects as its role with the same one."""
    services = _compose()["services"]
    runners = {"migrate", *(n for n, s in services.items() if s.get("command", [])[:2] == ["python", "-m"])}
    passwords = {name: (services[name].get("environment") or {}).get(ROLE_PASSWORD) for name in runners}
    assert all(passwords.values()), passwords
    assert len(set(passwords.values())) == 1, passwords


def test_kubernetes_manifests_run_real_modules_with_real_settings() -> None:
    docs = [d for d in yaml.safe_load_all((REPO / "infra" / "k8s" / "hetsched.yaml").read_text()) if d]
    fields = set(env_vars())
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    modules = {d["spec"]["template"]["spec"]["containers"][0]["command"][2] for d in deployments}
    assert modules == {f"services.{p}" for p in SERVICES}
    assert all(importlib.util.find_spec(m) is not None for m in modules)
    config = next(d for d in docs if d["kind"] == "ConfigMap")
    assert set(config["data"]) <= fields
    job = next(d for d in docs if d["kind"] == "Job")
    assert job["spec"]["template"]["spec"]["containers"][0]["command"] == ["alembic", "upgrade", "head"]
    # The migration and every service read the roles' password from the same Secret key.
    for doc in [job, *deployments]:
        container = doc["spec"]["template"]["spec"]["containers"][0]
        refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container.get("env", []) if "valueFrom" in e}
        assert refs.get(ROLE_PASSWORD) == {"name": "hetsched-db", "key": ROLE_PASSWORD}, doc["metadata"]["name"]


def test_nats_admits_only_nkeys_and_each_service_connects_with_its_own() -> None:
    """The server's configuration comes from `hetsched credentials init` (auth.conf included); only its
    client port is published (monitoring stays inside); each service gets its own seed and inbox, and
    sees the services' seeds only, never the operator's."""
    services = _compose()["services"]
    init = services["nats-credentials"]["command"]
    assert init[:3] == ["hetsched", "credentials", "init"] and "--server-config" in init
    assert services["nats"]["depends_on"]["nats-credentials"]["condition"] == "service_completed_successfully"
    assert services["nats"]["ports"] == ["4222:4222"]
    for definition in SERVICES.values():
        name = definition.name
        env = services[name]["environment"]
        assert env["HETSCHED_NATS_NKEY_SEED_FILE"] == f"/creds/nats/identities/svc_{definition.schema}.nk", name
        assert env["HETSCHED_NATS_INBOX_PREFIX"] == f"_INBOX_svc_{definition.schema}", name
        (mount,) = services[name]["volumes"]
        assert mount["volume"]["subpath"] == "nats/identities" and mount["read_only"], name


def test_no_server_port_is_published_without_authentication() -> None:
    # NATS admits NKeys only; the gateway answers only requests with an API key, on the host's loopback.
    for name, spec in _compose()["services"].items():
        for port in spec.get("ports") or []:
            if name == "gateway":
                assert str(port) == "127.0.0.1:8080:8080", f"the gateway publishes {port}"
                continue
            assert str(port).split(":")[-1] in {"4222"}, f"{name} publishes {port}"


def test_each_kubernetes_service_connects_with_its_own_nats_identity() -> None:
    docs = [d for d in yaml.safe_load_all((REPO / "infra" / "k8s" / "hetsched.yaml").read_text()) if d]
    schemas = {f"services.{p}": d.schema for p, d in SERVICES.items()}
    for deployment in (d for d in docs if d["kind"] == "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        container = pod["containers"][0]
        schema = schemas[container["command"][2]]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["HETSCHED_NATS_INBOX_PREFIX"] == f"_INBOX_svc_{schema}"
        (mount,) = container["volumeMounts"]
        assert env["HETSCHED_NATS_NKEY_SEED_FILE"].startswith(mount["mountPath"]) and mount["readOnly"]
        (volume,) = pod["volumes"]
        assert volume["secret"]["secretName"] == f"hetsched-nats-{schema}"
