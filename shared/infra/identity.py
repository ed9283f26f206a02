"""NATS identities on disk: NKey seeds, the registry of issued credentials, the server's
``authorization`` block, and how a process connects with its own (docs/SECURITY.md).

Layout under ``<data-dir>/nats/``::

    admin.nk            the operator's seed (0600): every subject, every tenant
    identities/*.nk     one seed per service and per agent that ``hetsched up`` runs (0600)
    identities.json     every identity issued: kind, name, public key, tenants or node (no seeds)
    auth.conf           the server's authorization block, rendered from identities.json
    nats.conf           the embedded server's configuration (listen, JetStream, include auth.conf)

A gateway's seed is written only where ``hetsched credentials issue --out`` says; the registry keeps its
public key, so revoking it (``hetsched credentials revoke``) is removing that entry and reloading.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import ssl
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import nkeys

from shared.contracts.permissions import (
    Permissions,
    agent_identity,
    agent_permissions,
    gateway_identity,
    gateway_permissions,
    operator_permissions,
    service_identity,
)
from shared.contracts.subjects import Subjects
from shared.infra.settings import Settings

OPERATOR_SEED = "admin.nk"
REGISTRY = "identities.json"
AUTH_CONF = "auth.conf"


def nats_dir(data_dir: Path) -> Path:
    return data_dir / "nats"


def operator_seed_path(data_dir: Path) -> Path:
    """Where the operator's seed lives (API.md "Operations"): ``<data-dir>/nats/admin.nk``."""
    return nats_dir(data_dir) / OPERATOR_SEED


def new_seed() -> bytes:
    """A fresh user NKey seed (``SU...``)."""
    seed: bytes = nkeys.encode_seed(secrets.token_bytes(32), nkeys.PREFIX_BYTE_USER)
    return seed


def public_key(seed: bytes) -> str:
    key: bytes = nkeys.from_seed(bytearray(seed)).public_key
    return key.decode()


def write_secret(path: Path, data: bytes) -> None:
    """Write ``data`` readable by its owner only, atomically (a reader never sees half a seed)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data + b"\n")
    tmp.replace(path)


def read_seed(path: Path) -> bytes:
    return path.read_bytes().strip()


@dataclass
class Identity:
    """One issued credential: what it may do is computed from its kind and these fields."""

    id: str
    kind: str  # operator | service | agent | gateway
    public_key: str
    name: str = ""
    tenants: list[str] = field(default_factory=list)
    node: str = ""
    issued_at: float = field(default_factory=time.time)
    seed_file: str = ""  # services and agents that `up` runs: where their seed is


@dataclass
class Registry:
    """``identities.json``: the identities the server admits and the prefixes their subjects use."""

    subject_prefix: str = "hetsched"
    stream_prefix: str = ""
    identities: dict[str, Identity] = field(default_factory=dict)

    @classmethod
    def load(cls, directory: Path) -> Registry:
        path = directory / REGISTRY
        if not path.exists():
            return cls()
        data = json.loads(path.read_text())
        return cls(
            subject_prefix=data.get("subject_prefix", "hetsched"),
            stream_prefix=data.get("stream_prefix", ""),
            identities={i["id"]: Identity(**i) for i in data.get("identities", [])},
        )

    def save(self, directory: Path) -> None:
        data = {
            "subject_prefix": self.subject_prefix,
            "stream_prefix": self.stream_prefix,
            "identities": [asdict(i) for i in self.identities.values()],
        }
        write_secret(directory / REGISTRY, json.dumps(data, indent=2).encode())

    def add(self, identity: Identity) -> None:
        self.identities[identity.id] = identity


def ensure_operator(directory: Path, registry: Registry) -> Path:
    """The operator's seed (made once) and its registry entry."""
    path = directory / OPERATOR_SEED
    if not path.exists():
        write_secret(path, new_seed())
    registry.add(Identity(id="operator", kind="operator", public_key=public_key(read_seed(path)), name="operator"))
    return path


def ensure_seeded(directory: Path, registry: Registry, *, id: str, kind: str, **fields: Any) -> Path:
    """A service's or agent's seed under ``identities/`` (made once, kept across restarts) and its entry."""
    path = directory / "identities" / f"{id}.nk"
    if not path.exists():
        write_secret(path, new_seed())
    registry.add(Identity(id=id, kind=kind, public_key=public_key(read_seed(path)), seed_file=str(path), **fields))
    return path


def issue(registry: Registry, *, kind: str, name: str, out: Path, tenants: Iterable[str] = ()) -> Identity:
    """A new gateway (``tenants``) or agent (``name`` is its node) credential: its seed written to ``out``
    (nothing else keeps it), its public key in ``registry`` (replacing an earlier key of that name)."""
    seed = new_seed()
    public = public_key(seed)
    if kind == "agent":
        identity = Identity(id=agent_identity(name), kind="agent", public_key=public, name=name, node=name)
    elif kind == "gateway":
        identity = Identity(
            id=gateway_identity(name), kind="gateway", public_key=public, name=name, tenants=sorted(set(tenants))
        )
    else:
        raise ValueError(f"credentials are issued to gateways and agents, not {kind}")
    write_secret(out, seed)
    registry.add(identity)
    return identity


def _no_access() -> Permissions:
    return Permissions(publish=(), subscribe=())


def _quoted(items: Iterable[str]) -> str:
    return "[" + ", ".join(json.dumps(item) for item in items) + "]"


def render_authorization(users: Iterable[tuple[Identity, Permissions]]) -> str:
    """The nats-server ``authorization`` block admitting exactly these NKeys with these permissions;
    no anonymous user (a connection without a listed NKey is refused)."""
    lines = [
        "# Generated by hetsched from identities.json; change that (hetsched credentials), not this.",
        "authorization {",
        "  users = [",
    ]
    for identity, perms in users:
        lines.append(f"    # {identity.kind} {identity.id}")
        lines.append("    {")
        lines.append(f"      nkey: {json.dumps(identity.public_key)}")
        if not perms.everything:
            lines.append("      permissions: {")
            deny = f", deny: {_quoted(perms.deny_publish)}" if perms.deny_publish else ""
            lines.append(f"        publish: {{ allow: {_quoted(perms.publish) if perms.publish else '[]'}{deny} }}")
            lines.append(f"        subscribe: {{ allow: {_quoted(perms.subscribe) if perms.subscribe else '[]'} }}")
            if perms.allow_responses:
                lines.append("        allow_responses: true")
            lines.append("      }")
        lines.append("    }")
    lines += ["  ]", "}", ""]
    return "\n".join(lines)


def write_auth_conf(
    directory: Path, registry: Registry, service_permissions_by_name: Mapping[str, Permissions]
) -> Path:
    """Render ``auth.conf`` from the registry (atomically: a reload never reads half of it)."""
    subjects = Subjects(registry.subject_prefix)
    users = []
    for identity in registry.identities.values():
        if identity.kind == "service":
            perms = service_permissions_by_name.get(identity.name, _no_access())
        elif identity.kind == "operator":
            perms = operator_permissions()
        elif identity.kind == "agent":
            perms = agent_permissions(identity.node, subjects)
        elif identity.kind == "gateway":
            perms = gateway_permissions(identity.id, identity.tenants, subjects)
        else:
            perms = _no_access()
        users.append((identity, perms))
    path = directory / AUTH_CONF
    write_secret(path, render_authorization(users).encode())
    return path


def reload_server(pid: int | None) -> bool:
    """Ask a running nats-server to re-read its configuration (SIGHUP); False when none runs."""
    if not pid:
        return False
    try:
        os.kill(pid, signal.SIGHUP)
    except ProcessLookupError:
        return False
    return True


# -- connecting -------------------------------------------------------------------------------------


def connect_options(settings: Settings, *, operator_fallback: bool = False) -> dict[str, Any]:
    """Keyword arguments for ``nats.connect`` (and FastStream's broker): this process's NKey seed, its
    reply-subject prefix and TLS. ``operator_fallback`` (the CLI): with no seed configured, use the
    operator's seed from the data directory when it exists, with the operator's own inbox."""
    options: dict[str, Any] = {}
    seed = settings.kit.nats_nkey_seed_file
    inbox = settings.kit.nats_inbox_prefix
    if seed is None and operator_fallback:
        candidate = operator_seed_path(settings.kit.data_dir)
        with contextlib.suppress(OSError):
            if candidate.is_file() and os.access(candidate, os.R_OK):
                seed = candidate
    if seed is not None:
        options["nkeys_seed"] = str(seed)
    options["inbox_prefix"] = inbox
    tls = tls_context(settings)
    if tls is not None:
        options["tls"] = tls
    return options


def tls_context(settings: Settings) -> ssl.SSLContext | None:
    """A client TLS context when ``HETSCHED_NATS_TLS_CA_FILE`` is set (with a client certificate for
    mutual TLS when one is configured)."""
    if settings.kit.nats_tls_ca_file is None:
        return None
    context = ssl.create_default_context(cafile=str(settings.kit.nats_tls_ca_file))
    if settings.kit.nats_tls_cert_file is not None:
        context.load_cert_chain(str(settings.kit.nats_tls_cert_file), keyfile=_str(settings.kit.nats_tls_key_file))
    return context


def _str(path: Path | None) -> str | None:
    return str(path) if path is not None else None


__all__ = [
    "Identity",
    "Registry",
    "agent_identity",
    "connect_options",
    "ensure_operator",
    "ensure_seeded",
    "issue",
    "operator_seed_path",
    "reload_server",
    "service_identity",
    "write_auth_conf",
]
