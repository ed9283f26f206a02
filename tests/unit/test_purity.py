"""shared/domain stays pure (STYLE §1): no IO, no clock, no hidden randomness."""

from __future__ import annotations

import ast
from pathlib import Path

BANNED = {
    "asyncio",
    "nats",
    "faststream",
    "sqlalchemy",
    "sqlmodel",
    "asyncpg",
    "pynvml",
    "subprocess",
    "socket",
    "random",
    "time",
    "requests",
    "httpx",
    "psutil",
    "services",
    "shared.infra",
}
DOMAIN = Path(__file__).resolve().parents[2] / "shared" / "domain"


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_domain_imports_nothing_that_does_io() -> None:
    offenders = []
    for path in sorted(DOMAIN.rglob("*.py")):
        for name in _imports(path):
            if any(name == banned or name.startswith(banned + ".") for banned in BANNED):
                offenders.append(f"{path.relative_to(DOMAIN)}: {name}")
    assert not offenders, offenders


def test_the_check_sees_a_banned_import(tmp_path: Path) -> None:
    sample = tmp_path / "bad.py"
    sample.write_text("import asyncio\nfrom sqlalchemy import select\n")
    assert _imports(sample) == {"asyncio", "sqlalchemy"}
