"""The docs are written for a platform engineer who has never seen this project: no page under docs/ and
not the README points at documents that reader does not have ("the brief", its section codes) or at
this repository's internal issue numbers. Public references such as ``vllm-project/vllm#17944`` stay."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]

# Each pattern with what a writer should say instead.
INSIDER = (
    (re.compile(r"\bthe\s+brief\b|\bbrief's", re.IGNORECASE), "say where the number comes from instead"),
    (re.compile(r"\bissues?\s+#?\d+\b", re.IGNORECASE), "describe the work or the finding instead"),
    # "#12" in prose; "owner/repo#12" (a public GitHub reference) is preceded by a name and is allowed.
    (re.compile(r"(?<![\w/.-])#\d+\b"), "describe the work instead of an issue number"),
    (re.compile(r"\b(?:DESIGN|S\d+)\s*§"), "an internal document's section code"),
)


def insider_lines(text: str) -> list[tuple[int, str, str]]:
    """(line number, line, why) for every line of ``text`` an outsider could not follow."""
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        for pattern, why in INSIDER:
            if pattern.search(line):
                found.append((number, line.strip(), why))
    return found


def test_the_patterns_catch_each_kind_of_insider_reference_and_spare_plain_english() -> None:
    caught = [
        "as the brief says",
        "The Brief (S1 §8) asks",
        "the brief's 256 GB/s",
        "issue 23 row 8",
        "(issue 14)",
        "Issue 23's probe",
        "issues 10 and 11",
        "see #12 for why",
        "memory model (DESIGN §3)",
    ]
    spared = [
        "a brief window of optimistic admission",
        "briefly, the ledger",
        "vllm-project/vllm#17944",
        "[API.md](API.md#rebalancing)",
        "tests/unit/placement/test_brief_rules.py",
        "a known issue with the driver",
        "## 7. The request path",
    ]
    assert [line for line in caught if not insider_lines(line)] == []
    assert [line for line in spared if insider_lines(line)] == []


def test_there_are_pages_to_check() -> None:
    names = {page.name for page in PAGES}
    assert {"README.md", "PLACEMENT.md", "SECURITY.md", "PERFORMANCE.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_no_page_cites_the_brief_or_an_internal_issue(page: Path) -> None:
    found = insider_lines(page.read_text(encoding="utf-8"))
    assert not found, "\n".join(f"{page.relative_to(REPO)}:{n}: {line}  ({why})" for n, line, why in found)
