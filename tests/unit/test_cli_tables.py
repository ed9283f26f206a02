"""The CLI's tables never lose a character: on a narrow terminal long cells fold; `--wide` (and a pipe)
prints each row whole on one line."""

from __future__ import annotations

import io
from collections import Counter

import pytest
from rich.console import Console

from hetsched.cli import common

KEY = "UAB3C5TQXAPL5Y2WWV6L5KQ7CN4JZ5H5CZFJQ4JY6ZB5T3ZCQWXYZ7AB"  # 56 characters, like an NKey
HEADERS = ["id", "kind", "public key", "tenants / node"]
ROWS = [["acme-gateway", "gateway", KEY, "acme, globex, initech, umbrella"], ["op", "operator", KEY[::-1], "-"]]


def _printed(monkeypatch: pytest.MonkeyPatch, *, terminal: bool, wide: bool) -> str:
    out = io.StringIO()
    monkeypatch.setattr(common, "console", Console(file=out, width=80, force_terminal=terminal, color_system=None))
    common.table(HEADERS, ROWS, wide=wide)
    return out.getvalue()


def test_a_narrow_terminal_folds_long_cells_and_cuts_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    text = _printed(monkeypatch, terminal=True, wide=False)
    assert all(len(line) <= 80 for line in text.splitlines())
    assert "…" not in text
    # Folding spreads a key over lines, beside the other cells' parts: every character is still printed.
    printed = Counter("".join(text.split()))
    wanted = Counter("".join("".join(cell.split()) for cell in [*HEADERS, *(c for row in ROWS for c in row)]))
    assert not wanted - printed
    assert KEY not in text  # it did fold (the test would prove nothing if the row fitted)


@pytest.mark.parametrize("terminal", [True, False])
def test_wide_and_pipes_print_each_row_whole_on_one_line(monkeypatch: pytest.MonkeyPatch, terminal: bool) -> None:
    text = _printed(monkeypatch, terminal=terminal, wide=True)
    lines = text.splitlines()
    assert len(lines) == 1 + len(ROWS)
    assert KEY in lines[1] and "acme, globex, initech, umbrella" in lines[1]
    assert max(len(line) for line in lines) > 80


def test_a_pipe_gets_whole_rows_without_wide(monkeypatch: pytest.MonkeyPatch) -> None:
    lines = _printed(monkeypatch, terminal=False, wide=False).splitlines()
    assert len(lines) == 1 + len(ROWS) and KEY in lines[1]
