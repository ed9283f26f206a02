"""No service's code or SQL touches another service's schema (DESIGN §4, §6; issue 9).

Every ``.py`` under ``services/<name>/`` is scanned for:

* SQL in string literals (f-strings with module-level string constants resolved) that names another
  service's schema as a qualifier after a SQL keyword — ``FROM``/``JOIN``/``INTO``/``UPDATE``/
  ``TABLE``/``REFERENCES``/``TRUNCATE``/``ONLY`` ``<schema>.``, a further ``, <schema>.`` in a
  ``FROM`` list, ``SCHEMA <schema>`` and ``search_path TO <schema>``; docstrings are prose and skipped;
* SQLAlchemy: ``schema="<other>"`` in any call, ``{"schema": "<other>"}`` (``__table_args__``) and
  ``ForeignKey("<other>.table.column")``;
* imports of another service's ``tables`` or ``store`` module (its SQL and table definitions).

Subjects and event types (``hetsched.ledger.commit``, ``ledger.allocation_committed``) are not SQL and
are not flagged. Migration 0005 makes the same rule fail at run time (tests/integration/test_schema_roles.py).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from shared.infra.db import SCHEMAS

REPO = Path(__file__).resolve().parents[2]
SERVICES = REPO / "services"

# schema -> the service package that owns it
OWNERS: dict[str, str] = {
    "topology": "topology_discovery",
    "ledger": "capacity_ledger",
    "placement": "placement",
    "reservation": "reservation_filler",
    "routing": "cross_region_router",
    "rebalance": "rebalancer",
    "gateway": "gateway",
}
SCHEMA_OF = {package: schema for schema, package in OWNERS.items()}
# a service's modules that hold its SQL and table definitions
DATA_MODULES = ("tables", "store")

_QUALIFIER = r'"?(?P<schema>{names})"?\."?[A-Za-z_{{]'
_KEYWORD = r"\b(?:FROM|JOIN|INTO|UPDATE|TABLE|REFERENCES|TRUNCATE|ONLY)\s+(?:IF\s+(?:NOT\s+)?EXISTS\s+)?(?:ONLY\s+)?"
_SCHEMA_WORD = r'\b(?:SCHEMA|search_path\s*(?:TO|=))\s+"?(?P<schema>{names})"?\b'
_FROM_LIST = r",\s*"  # a further table in a FROM list, only in a string that has FROM or JOIN


@dataclass(frozen=True)
class Finding:
    line: int
    what: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.what}"


def _patterns(schemas: tuple[str, ...]) -> tuple[re.Pattern[str], re.Pattern[str], re.Pattern[str]]:
    names = "|".join(re.escape(s) for s in schemas)
    return (
        re.compile(_KEYWORD + _QUALIFIER.format(names=names), re.IGNORECASE),
        re.compile(_SCHEMA_WORD.format(names=names), re.IGNORECASE),
        re.compile(_FROM_LIST + _QUALIFIER.format(names=names), re.IGNORECASE),
    )


def _skipped(tree: ast.Module) -> set[int]:
    """ids of the string constants not read on their own: docstrings (a statement that is only a
    string; prose) and the pieces of f-strings (read whole, rendered)."""
    skip = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    }
    skip.update(id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values)
    return skip


def _module_constants(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "text"``, so ``f"FROM {SCHEMA}.x"`` reads as the SQL it is."""
    out: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Constant):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if isinstance(node.value.value, str):
                out.update({t.id: node.value.value for t in targets if isinstance(t, ast.Name)})
    return out


def _render(node: ast.JoinedStr, constants: dict[str, str]) -> str:
    parts = []
    for value in node.values:
        if isinstance(value, ast.Constant):
            parts.append(str(value.value))
        elif isinstance(value, ast.FormattedValue) and isinstance(value.value, ast.Name):
            parts.append(constants.get(value.value.id, "{?}"))
        else:
            parts.append("{?}")
    return "".join(parts)


def _imported_services(node: ast.Import | ast.ImportFrom, *, package: str) -> list[tuple[str, str]]:
    """(service, module) for every import of a service's data module; ``package`` resolves relative ones."""
    modules: list[str] = []
    if isinstance(node, ast.Import):
        modules = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*anchor, *([base] if base else [])])
        modules = [base, *(f"{base}.{alias.name}" for alias in node.names)]
    out = []
    for module in modules:
        parts = module.split(".")
        if len(parts) >= 3 and parts[0] == "services" and parts[2] in DATA_MODULES:
            out.append((parts[1], parts[2]))
    return out


def foreign_schema_uses(source: str, *, own: str, package: str = "") -> list[Finding]:
    """Where ``source`` (a module of the service owning schema ``own``) touches another service's schema.

    ``package`` is the module's package (``services.placement``), for relative imports.
    """
    others = tuple(s for s in OWNERS if s != own)
    qualified, schema_word, from_list = _patterns(others)
    tree = ast.parse(source)
    skip = _skipped(tree)
    constants = _module_constants(tree)
    own_package = OWNERS[own]
    found: list[Finding] = []

    def check_sql(text: str, line: int) -> None:
        hits = [m.group("schema") for m in qualified.finditer(text)]
        hits += [m.group("schema") for m in schema_word.finditer(text)]
        if re.search(r"\b(?:FROM|JOIN)\b", text, re.IGNORECASE):
            hits += [m.group("schema") for m in from_list.finditer(text)]
        for schema in sorted(set(hits)):
            found.append(Finding(line, f"SQL names schema {schema!r}: {' '.join(text.split())[:120]!r}"))

    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            check_sql(_render(node, constants), node.lineno)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            check_sql(node.value, node.lineno)
        elif isinstance(node, ast.Call):
            for keyword in node.keywords:
                value = keyword.value
                if keyword.arg == "schema" and isinstance(value, ast.Constant) and value.value in others:
                    found.append(Finding(node.lineno, f"schema={value.value!r}"))
            callee = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            first = node.args[0] if node.args else None
            if callee == "ForeignKey" and isinstance(first, ast.Constant) and isinstance(first.value, str):
                schema = first.value.split(".", 1)[0]
                if schema in others and first.value.count(".") >= 2:
                    found.append(Finding(node.lineno, f"ForeignKey({first.value!r})"))
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if (
                    isinstance(key, ast.Constant)
                    and key.value == "schema"
                    and isinstance(value, ast.Constant)
                    and value.value in others
                ):
                    found.append(Finding(node.lineno, f'{{"schema": {value.value!r}}}'))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for service, module in _imported_services(node, package=package or f"services.{own_package}"):
                if service != own_package and service in SCHEMA_OF:
                    found.append(Finding(node.lineno, f"imports services.{service}.{module}"))
    return sorted(set(found), key=lambda f: (f.line, f.what))


# --- the scanner, on what it must and must not flag -------------------------------------------------

# services/placement/readmodel.py before issue 9 (git 8c3a936): the reads that coupled placement to
# topology's and the ledger's tables. Kept as text so the scanner stays tested after the fix.
OLD_PLACEMENT_READMODEL = '''
"""Placement's view of the fleet: read from their tables. SELECT profile FROM topology.nodes (a docstring)."""
from sqlalchemy import text


class ReadModel:
    async def _load_topology(self) -> None:
        async with self.runtime.sessions() as session:
            rows = (await session.execute(text("SELECT profile FROM topology.nodes WHERE state = 'up'"))).scalars()
            racks = await session.execute(text("SELECT region, cluster, name, power_kw FROM topology.racks"))
            pods = await session.execute(text("SELECT name, region, cluster, type, shape FROM topology.tpu_pods"))

    async def _load_capacity(self) -> None:
        async with self.runtime.sessions() as session:
            rows = await session.execute(
                text("SELECT id, node, sku, hbm_usable, reserved, available FROM ledger.accelerators")
            )
'''

# services/topology_discovery/store.py before issue 9: fleet views read the ledger's reserved bytes.
OLD_TOPOLOGY_STORE = """
async def fleet_page(session, nodes):
    reserved = {
        r.id: r.reserved
        for r in await session.execute(
            text("SELECT id, reserved FROM ledger.accelerators WHERE node = ANY(:nodes)"),
            {"nodes": [n.name for n in nodes]},
        )
    }
"""


def test_the_old_placement_read_model_is_flagged_for_topology_and_ledger() -> None:
    found = foreign_schema_uses(OLD_PLACEMENT_READMODEL, own="placement")
    assert [f.line for f in found] == [9, 10, 11, 16]
    assert sum("'topology'" in f.what for f in found) == 3 and sum("'ledger'" in f.what for f in found) == 1


def test_the_old_topology_store_is_flagged_for_the_ledger() -> None:
    (finding,) = foreign_schema_uses(OLD_TOPOLOGY_STORE, own="topology")
    assert finding.line == 6 and "'ledger'" in finding.what


@pytest.mark.parametrize(
    "source",
    [
        'text("SELECT * FROM ledger.accelerators")',
        'text("select id from  \\"ledger\\".\\"accelerators\\"")',
        'text("SELECT n.name FROM placement.decisions d JOIN topology.nodes n ON n.name = d.node")',
        'text("SELECT a.id FROM placement.decisions d, ledger.accelerators a")',
        'text("INSERT INTO ledger.journal (op) VALUES (1)")',
        'text("UPDATE ledger.allocations SET state = 1")',
        'text("DELETE FROM topology.nodes")',
        'text("TRUNCATE TABLE ledger.outbox")',
        'text("CREATE TABLE IF NOT EXISTS ledger.x (id int)")',
        'text("ALTER TABLE placement.decisions ADD FOREIGN KEY (a) REFERENCES ledger.allocations (id)")',
        'text("GRANT USAGE ON SCHEMA ledger TO me")',
        'text("SET search_path TO ledger, public")',
        'LEDGER = "ledger"\nsql = f"SELECT id FROM {LEDGER}.accelerators WHERE node = :n"',
        'sql = ("SELECT id, reserved "\n       "FROM ledger.accelerators")',
        'Table("accelerators", metadata, Column("id", String), schema="ledger")',
        'class Row(SQLModel, table=True):\n    __table_args__ = {"schema": "topology"}',
        'class Row(SQLModel, table=True):\n    __table_args__ = (UniqueConstraint("a"), {"schema": "ledger"})',
        'Column("allocation_id", ForeignKey("ledger.allocations.id"))',
        "from services.capacity_ledger.tables import AcceleratorRow",
        "from services.capacity_ledger import store",
        "import services.topology_discovery.tables",
        "import services.topology_discovery.store as topology_store",
        "from ..capacity_ledger.tables import AcceleratorRow",
        "from ..topology_discovery import tables",
    ],
)
def test_flagged(source: str) -> None:
    assert foreign_schema_uses(source, own="placement", package="services.placement"), source


@pytest.mark.parametrize(
    "source",
    [
        'subject = "hetsched.ledger.commit"',
        'event_type = "ledger.allocation_committed"',
        'subject = f"{prefix}.events.ledger.capacity_changed"',
        'kind = "topology.node_lost"',
        'log.info("placed from ledger. snapshot at start")',
        'log.info("asked the ledger for its snapshot")',
        'log.info("no view yet", extra={"from": "topology"})',
        'ids = "dgx-1/gpu0, ledger.accelerators are not ours"',  # a comma list, but no FROM/JOIN: prose
        '"""Built from topology and ledger events: never SELECT ... FROM ledger.accelerators."""',
        'def f():\n    """Not FROM topology.nodes: from events."""',
        'text("INSERT INTO placement.decisions (tenant) VALUES (:t)")',  # its own schema
        'text("SELECT * FROM placement.outbox")',
        'SCHEMA = "placement"\nsql = f"SELECT 1 FROM {SCHEMA}.decisions"',
        'class Row(SQLModel, table=True):\n    __table_args__ = {"schema": "placement"}',
        'ServiceDefinition(name="placement", schema="placement")',
        "from services.placement.tables import DecisionRow",
        "from .tables import DecisionRow",
        "from . import store",
        "from shared.contracts.ledger import LedgerEventName",
        "from services.capacity_ledger.app import SERVICE",  # another service's definition, not its data
        'ForeignKey("placement.decisions.id")',
        'text(f"SELECT {cols} FROM {table}")',
    ],
)
def test_not_flagged(source: str) -> None:
    assert foreign_schema_uses(source, own="placement", package="services.placement") == [], source


def test_every_schema_has_an_owner_and_every_service_package_a_schema() -> None:
    assert set(OWNERS) == set(SCHEMAS)
    packages = {p.name for p in SERVICES.iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(SCHEMA_OF), "a new service package needs its schema in OWNERS"


# --- the services as they are -----------------------------------------------------------------------


@pytest.mark.parametrize("schema", sorted(OWNERS))
def test_no_service_touches_another_services_schema(schema: str) -> None:
    package = SERVICES / OWNERS[schema]
    found: list[str] = []
    for path in sorted(package.rglob("*.py")):
        module_package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
        found += [
            f"{path.relative_to(REPO)} {finding}"
            for finding in foreign_schema_uses(path.read_text(encoding="utf-8"), own=schema, package=module_package)
        ]
    assert not found, f"services/{OWNERS[schema]} reaches into another service's schema:\n" + "\n".join(found)
