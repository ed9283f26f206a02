"""README.md's configuration table, generated from the settings models (``shared.infra.settings``).

``python -m shared.infra.settings_doc`` prints it; ``--write`` replaces the table in README.md (between its
two markers). ``tests/unit/test_readme.py`` fails when README's table differs from this one.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from enum import Enum
from pathlib import Path

from pydantic import SecretStr
from pydantic.fields import FieldInfo

from shared.infra.settings import SECTIONS, Section, Settings, env_var

BEGIN = (
    "<!-- settings table: generated from shared/infra/settings.py by `python -m shared.infra.settings_doc --write` -->"
)
END = "<!-- end of the settings table -->"
README = Path(__file__).resolve().parents[2] / "README.md"


def _default(field: FieldInfo) -> str:
    extra = field.json_schema_extra
    if isinstance(extra, dict) and isinstance(extra.get("doc_default"), str):
        return str(extra["doc_default"])
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if value == "":
        return "empty"
    if isinstance(value, SecretStr):
        return "set"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float) and value.is_integer():
        return f"`{int(value)}`"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        plain = {str(k.value if isinstance(k, Enum) else k): v for k, v in value.items()}
        return f"`{json.dumps(plain)}`"
    return f"`{value}`"


def _rows(section: type[Section]) -> list[str]:
    rows = []
    for name, field in section.model_fields.items():
        meaning = (field.description or "").replace("|", "\\|")
        rows.append(f"| `{env_var(section, name)}` | {_default(field)} | {meaning} |")
    return rows


def table() -> str:
    """The generated Markdown: one table per section, under a line naming it, between the two markers."""
    parts = [BEGIN]
    for name in SECTIONS:
        section = Settings.model_fields[name].annotation
        assert isinstance(section, type) and issubclass(section, Section), name
        parts += ["", f"**{section.title}**", "", "| variable | default | meaning |", "|---|---|---|", *_rows(section)]
    parts += ["", END]
    return "\n".join(parts)


def readme_table(readme: str) -> str:
    """The table as README.md has it (empty when the markers are missing)."""
    start, end = readme.find(BEGIN), readme.find(END)
    return readme[start : end + len(END)] if 0 <= start < end else ""


def write(path: Path = README) -> bool:
    """Replace README's table with the generated one; whether anything changed."""
    readme = path.read_text()
    current = readme_table(readme)
    if not current:
        raise SystemExit(f"{path}: no settings table markers ({BEGIN!r} ... {END!r})")
    updated = readme.replace(current, table())
    path.write_text(updated)
    return updated != readme


def main(argv: list[str]) -> int:
    if "--write" in argv:
        print("README.md updated" if write() else "README.md already current")
    else:
        print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
