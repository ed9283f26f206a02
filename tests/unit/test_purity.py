"""shared/domain stays pure (STYLE §1): no IO, no clock, no hidden randomness.

The banned modules are listed once, in shared/domain/ruff.toml (ruff's banned-api, TID251); this
test reads that list and walks every import itself, so the rule holds even where ruff does not run.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

DOMAIN = Path(__file__).resolve().parents[2] / "shared" / "domain"


def banned_modules() -> set[str]:
    config = tomllib.loads((DOMAIN / "ruff.toml").read_text())
    banned: dict[str, object] = config["lint"]["flake8-tidy-imports"]["banned-api"]
    return set(banned)


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _offends(name: str, banned: set[str]) -> bool:
    return any(name == b or name.startswith(b + ".") for b in banned)


def test_domain_imports_nothing_that_does_io() -> None:
    banned = banned_modules()
    offenders = [
        f"{path.relative_to(DOMAIN)}: {name}"
        for path in sorted(DOMAIN.rglob("*.py"))
        for name in sorted(_imports(path))
        if _offends(name, banned)
    ]
    assert not offenders, offenders


def test_the_list_covers_io_clock_randomness_and_the_outer_layers() -> None:
    assert {"asyncio", "nats", "sqlalchemy", "asyncpg", "subprocess", "socket", "random", "time"} <= banned_modules()
    assert {"services", "shared.infra", "hetsched"} <= banned_modules()


def test_the_check_sees_a_banned_import(tmp_path: Path) -> None:
    sample = tmp_path / "bad.py"
    sample.write_text("import asyncio\nfrom sqlalchemy import select\nfrom shared import infra\n")
    assert [n for n in sorted(_imports(sample)) if _offends(n, banned_modules())] == [
        "asyncio",
        "shared.infra",
        "sqlalchemy",
        "sqlalchemy.select",
    ]
