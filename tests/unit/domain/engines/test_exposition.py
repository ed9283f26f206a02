"""The Prometheus text reader: the format's corners (escapes, NaN/+Inf, timestamps), junk skipped and
counted, and the one error it raises."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.domain.engines import Exposition, UnreadableExposition, parse_exposition


def test_help_type_labels_and_values_are_read() -> None:
    text = (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{model_name="m",engine="0"} 7.0\n'
        'vllm:num_requests_running{engine="1",model_name="m",} 5\n'  # a trailing comma is allowed
    )
    exposition = parse_exposition(text)
    assert exposition.types["vllm:num_requests_running"] == "gauge"
    assert exposition.helps["vllm:num_requests_running"] == "Number of requests in model execution batches."
    assert [(s.label("engine"), s.value) for s in exposition.named("vllm:num_requests_running")] == [
        ("0", 7.0),
        ("1", 5.0),
    ]
    assert exposition.skipped_lines == 0


def test_label_values_keep_escaped_quotes_backslashes_newlines_commas_and_braces() -> None:
    line = r'm{path="C:\\dir",quote="say \"hi\"",text="a\nb",odd="x, y} z"} 1' + "\n"
    (sample,) = parse_exposition(line).samples
    assert sample.label("path") == "C:\\dir"
    assert sample.label("quote") == 'say "hi"'
    assert sample.label("text") == "a\nb"
    assert sample.label("odd") == "x, y} z"


def test_help_text_escapes_are_undone() -> None:
    exposition = parse_exposition("# HELP m one\\ntwo \\\\ three\nm 1\n")
    assert exposition.helps["m"] == "one\ntwo \\ three"


def test_nan_infinities_exponents_and_timestamps() -> None:
    text = "a NaN\nb +Inf\nc -Inf 1700000000000\nd 8.128902e+06\ne 1.5e-3 -12\nf\t2\t5\ng +infinity\n"
    values = {s.name: (s.value, s.timestamp_ms) for s in parse_exposition(text).samples}
    assert math.isnan(values["a"][0])
    assert values["b"] == (math.inf, None)
    assert values["c"] == (-math.inf, 1_700_000_000_000)
    assert values["d"] == (8_128_902.0, None)
    assert values["e"] == (0.0015, -12)
    assert values["f"] == (2.0, 5)
    assert values["g"] == (math.inf, None)


def test_windows_line_ends_and_blank_lines_are_fine() -> None:
    exposition = parse_exposition("a 1\r\n\r\n\nb 2\r\n")
    assert [s.name for s in exposition.samples] == ["a", "b"]
    assert exposition.skipped_lines == 0


@pytest.mark.parametrize(
    "junk",
    [
        "no_value_here",
        'm{a="1" 2',  # label set never closed
        "m{a=1} 2",  # unquoted label value
        'm{a="1",a="2"} 3',  # a label twice
        'm{1a="x"} 3',  # bad label name
        "m 1 2 3",  # too many fields
        "m one",  # not a number
        "m 1_000",  # Python would read it; Prometheus does not
        "m 1 1.5",  # a timestamp is an integer
        "9m 1",  # bad metric name
        "m 1e",  # an exponent with no digits
        "m 0.5.1",  # two decimal points
        'm{a="\\"} 1',  # the closing quote is escaped away
    ],
)
def test_a_bad_line_is_skipped_and_counted_and_the_rest_is_read(junk: str) -> None:
    exposition = parse_exposition(f"good 1\n{junk}\nalso_good 2\n")
    assert [s.name for s in exposition.samples] == ["good", "also_good"]
    assert exposition.skipped_lines == 1


def test_a_repeated_series_keeps_the_first_and_counts_the_repeat() -> None:
    exposition = parse_exposition('m{a="1"} 1\nm{a="1"} 2\nm{a="2"} 3\n')
    assert [s.value for s in exposition.samples] == [1.0, 3.0]
    assert exposition.skipped_lines == 1


def test_other_comments_and_bad_type_lines_are_ignored_not_fatal() -> None:
    exposition = parse_exposition("# just a comment\n# TYPE m sometype\n# EOF\nm 1\n")
    assert "m" not in exposition.types
    assert [s.value for s in exposition.samples] == [1.0]


def test_empty_text_is_an_empty_exposition() -> None:
    assert parse_exposition("") == Exposition(samples=())
    assert parse_exposition("\n  \n").samples == ()


@pytest.mark.parametrize(
    "text", ["<html><body>502 Bad Gateway</body></html>", "{not: prometheus}\n[]\n", b"\xff\xfe\x00"]
)
def test_text_with_nothing_readable_raises_the_typed_error(text: str | bytes) -> None:
    with pytest.raises(UnreadableExposition):
        parse_exposition(text)


def test_bytes_are_read_as_utf8() -> None:
    (sample,) = parse_exposition('m{model_name="modèle"} 1\n'.encode()).samples
    assert sample.label("model_name") == "modèle"


_PROMETHEUS_ALPHABET = st.sampled_from(list('abcmz_:{}=",. \t\n\\#+-0123456789eEInfNaTYPEHELP'))


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.text(), st.text(_PROMETHEUS_ALPHABET), st.binary()))
def test_the_reader_never_raises_anything_but_its_typed_error(text: str | bytes) -> None:
    try:
        exposition = parse_exposition(text)
    except UnreadableExposition:
        return
    assert exposition.skipped_lines >= 0
    for sample in exposition.samples:
        assert isinstance(sample.value, float)
