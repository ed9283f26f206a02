"""Model groups: the shipped file parses against the shipped catalog; bad documents name the field."""

from __future__ import annotations

from typing import Any

import pytest

from shared.domain.admission import Engine, engine_of, members, parse_model_groups
from shared.domain.hardware import CatalogError
from tests.unit.domain.admission.builders import groups_doc, models


def shipped() -> dict[str, tuple[str, ...]]:
    return parse_model_groups(groups_doc(), models())


def test_the_shipped_groups_parse_in_the_order_written() -> None:
    assert shipped() == {
        "chat-long": ("llama3.1-8b", "jamba-v0.1", "mamba2-2.7b"),
        "chat-large": ("mixtral-8x7b", "llama3-70b", "mamba2-2.7b"),
    }


def test_the_long_context_group_mixes_a_transformer_with_engines_whose_memory_stays_flat() -> None:
    long = shipped()["chat-long"]
    engines = {engine_of(models()[m]) for m in long}
    assert Engine.TRANSFORMER in engines and engines & {Engine.SSM, Engine.HYBRID}
    # Every member holds a context well past the 32K long-context threshold.
    assert min(models()[m].max_context for m in long) >= 128 * 1024


def test_the_large_group_has_moe_transformer_and_ssm() -> None:
    assert {engine_of(models()[m]) for m in shipped()["chat-large"]} == {Engine.MOE, Engine.TRANSFORMER, Engine.SSM}


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ([], "a mapping at the top level"),
        ({"groups": []}, "a mapping under `groups`"),
        ({"groups": {"g": ["llama3-8b"]}}, "groups.g: expected a mapping"),
        ({"groups": {"g": {"models": []}}}, "groups.g.models: expected a non-empty list"),
        ({"groups": {"g": {"models": "llama3-8b"}}}, "groups.g.models: expected a non-empty list"),
        ({"groups": {"g": {"models": ["llama3-8b", "gpt-9"]}}}, "groups.g.models: unknown model gpt-9"),
        ({"groups": {"g": {"models": ["llama3-8b", "llama3-8b"]}}}, "listed twice: llama3-8b"),
        ({"groups": {"g": {"models": ["llama3-8b"], "weight": 2}}}, "groups.g.weight: unknown field"),
        ({"groups": {"g": {"models": ["llama3-8b"], "description": 3}}}, "groups.g.description"),
        ({"groups": {"llama3-8b": {"models": ["llama3-70b"]}}}, "the name of a catalog model"),
        ({"groups": {"": {"models": ["llama3-8b"]}}}, "non-empty name"),
    ],
)
def test_bad_documents_name_the_field(doc: Any, message: str) -> None:
    with pytest.raises(CatalogError, match=message):
        parse_model_groups(doc, models())


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("chat-long", ("llama3.1-8b", "jamba-v0.1", "mamba2-2.7b")),  # a group: its members
        ("llama3-8b", ("llama3-8b",)),  # a catalog model: itself
        ("gpt-9", None),  # neither
    ],
)
def test_members(name: str, expected: tuple[str, ...] | None) -> None:
    assert members(name, shipped(), models()) == expected
