"""Trace readers (Azure CSV, Mooncake JSONL, plain CSV), bad-row handling, and the seeded workload mix."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.domain.traces import (
    FORMATS,
    OnError,
    Trace,
    TraceError,
    TraceRequest,
    _splitmix64,
    assign_workload,
    comment_header,
    detect_format,
    parse_timestamp_ns,
    read_azure_csv,
    read_mooncake_jsonl,
    read_plain_csv,
    read_trace,
    seeded_uniform,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "traces"
SHARED_DATA = Path(__file__).resolve().parents[3].parent / "shared" / "data"
AZURE_CONV_2023 = SHARED_DATA / "traces" / "AzureLLMInferenceTrace_conv_2023.csv"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def shape(trace: Trace) -> list[tuple[float, int, int, int]]:
    return [(round(r.arrival_ms, 6), r.input_tokens, r.output_tokens, r.row) for r in trace.requests]


# --- each format parses ---------------------------------------------------------------------------


def test_azure_fixture_parses_seven_fractional_digits_relative_to_the_first_row() -> None:
    trace = read_azure_csv(fixture("azure_small.csv"))
    assert trace.format == "azure" and trace.skipped == {}
    assert shape(trace) == [
        (0.0, 374, 44, 1),
        (4314.579, 396, 109, 2),  # 50.9951690 - 46.6805900 s = 4.3145790 s
        (4541.877, 879, 55, 3),  # 51.2224670 - 46.6805900 s
        (4541.877, 91, 16, 4),  # the same instant again: ties are in order
        (13319.4101, 2048, 1, 5),  # 18:16:00.0000001 - 18:15:46.6805900 = 13.3194101 s: 100 ns kept
    ]


@pytest.mark.parametrize(
    ("first", "second", "expected_ms"),
    [
        # across midnight and a month end: 0.0000001 s + 0.0000001 s
        ("2023-11-30 23:59:59.9999999", "2023-12-01 00:00:00.0000001", 0.0002),
        # across a leap day: 2024-02-28 12:00 -> 2024-03-01 12:00 is two days
        ("2024-02-28 12:00:00", "2024-03-01 12:00:00", 2 * 86_400_000.0),
        # a 'T' separator, fewer digits, and offsets: 10:00+02:00 is 08:00Z, 30 min after 07:30Z
        ("2024-05-10T07:30:00.5Z", "2024-05-10 10:00:00.500000+02:00", 30 * 60_000.0),
    ],
)
def test_azure_timestamps_are_parsed_by_hand(first: str, second: str, expected_ms: float) -> None:
    text = f"TIMESTAMP,ContextTokens,GeneratedTokens\n{first},10,1\n{second},10,1\n"
    assert read_azure_csv(text).requests[1].arrival_ms == pytest.approx(expected_ms, abs=1e-9)


def test_parse_timestamp_rejects_impossible_dates() -> None:
    for text in ("2023-02-30 00:00:00", "2023-11-16 24:00:00", "2023-11-16", "16/11/2023 18:15:46"):
        with pytest.raises(ValueError):
            parse_timestamp_ns(text)
    assert parse_timestamp_ns("0001-01-01 00:00:00.000000001") - parse_timestamp_ns("0001-01-01 00:00:00") == 1


def test_mooncake_fixture_parses_ignoring_other_keys_and_blank_lines() -> None:
    trace = read_mooncake_jsonl(fixture("mooncake_small.jsonl"))
    assert trace.format == "mooncake"
    # the blank line 3 is not a row: the third record is row 3 on line 4
    assert shape(trace) == [(0.0, 6955, 52, 1), (27.0, 6472, 26, 2), (1250.5, 512, 128, 3)]


def test_plain_fixture_reads_columns_in_any_order_and_case() -> None:
    trace = read_plain_csv(fixture("plain_small.csv"))
    assert trace.format == "plain"
    assert shape(trace) == [(0.0, 1000, 100, 1), (250.0, 300, 20, 2), (2000.0, 64, 1, 3)]


@pytest.mark.parametrize(
    ("column", "values"),
    [("arrival_s", ("5", "5.25", "7")), ("arrival_ms", ("5000", "5250", "7000")), ("timestamp", ("5", "5.25", "7"))],
)
def test_plain_time_columns_are_seconds_or_ms(column: str, values: tuple[str, str, str]) -> None:
    text = f"{column},input_tokens,output_tokens\n" + "".join(f"{v},8,2\n" for v in values)
    assert [r.arrival_ms for r in read_plain_csv(text).requests] == [0.0, 250.0, 2000.0]


def test_crlf_bom_and_blank_lines_are_tolerated() -> None:
    text = "\ufeffarrival_ms,input_tokens,output_tokens\r\n\r\n0,10,5\r\n,,\r\n7,11,6\r\n"
    assert shape(read_plain_csv(text)) == [(0.0, 10, 5, 1), (7.0, 11, 6, 2)]


@pytest.mark.parametrize(
    ("text", "filename", "fmt"),
    [
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "x.csv", "azure"),
        (" timestamp , contexttokens , generatedtokens\n", "", "azure"),
        ('\n{"timestamp": 0, "input_length": 1, "output_length": 1}\n', "trace.txt", "mooncake"),
        ("arrival_s,input_tokens,output_tokens\n", "x.csv", "plain"),
        ("", "mooncake_trace.jsonl", "mooncake"),
        ("# Source: x\n#\n\n# Licence: y\nTIMESTAMP,ContextTokens,GeneratedTokens\n", "x.csv", "azure"),
        ("\ufeff# a comment\narrival_ms,input_tokens,output_tokens\n", "x.txt", "plain"),
    ],
)
def test_detect_format(text: str, filename: str, fmt: str) -> None:
    assert detect_format(text, filename) == fmt


# --- '#' comment lines before a CSV header (where a shipped sample names its source and licence) ----------

COMMENTED_AZURE = (
    "# Source: https://example.org/trace.csv\n"
    "#   continued, indented\n"
    "\n"
    "#Licence: CC-BY 4.0\n"
    "TIMESTAMP,ContextTokens,GeneratedTokens\n"  # line 5
    "2023-11-16 18:15:46.6805900,374,44\n"
    "2023-11-16 18:15:50.9951690,396,109\n"
)


def test_comment_lines_before_the_header_are_skipped() -> None:
    # 18:15:50.9951690 - 18:15:46.6805900 = 4.3145790 s
    assert shape(read_azure_csv(COMMENTED_AZURE)) == [(0.0, 374, 44, 1), (4314.579, 396, 109, 2)]
    plain = "# made by hand\r\n# second\r\narrival_s,input_tokens,output_tokens\r\n0,10,5\r\n1,11,6\r\n"
    assert shape(read_plain_csv(plain)) == [(0.0, 10, 5, 1), (1000.0, 11, 6, 2)]
    assert (
        read_trace(COMMENTED_AZURE, detect_format(COMMENTED_AZURE)).requests == read_azure_csv(COMMENTED_AZURE).requests
    )


def test_comment_lines_keep_the_files_line_numbers_in_errors() -> None:
    bad = COMMENTED_AZURE + "2023-11-16 18:15:51.0,zero,1\n"  # data row 3, physical line 8
    with pytest.raises(TraceError, match=r"row 3 \(line 8\)"):
        read_azure_csv(bad)


def test_a_hash_line_after_the_header_is_a_row_not_a_comment() -> None:
    text = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,44\n# late note\n"
    with pytest.raises(TraceError, match=r"row 2 \(line 3\)") as caught:
        read_azure_csv(text)
    assert caught.value.reason == "not_a_number"
    assert read_azure_csv(text, on_error="skip").skipped == {"not_a_number": 1}


def test_comment_header_returns_the_leading_comments_without_the_hash() -> None:
    assert comment_header(COMMENTED_AZURE) == (
        "Source: https://example.org/trace.csv",
        "  continued, indented",
        "Licence: CC-BY 4.0",
    )
    assert comment_header("TIMESTAMP,ContextTokens,GeneratedTokens\n# not a header comment\n") == ()
    assert comment_header("") == ()


def test_detect_format_refuses_what_it_cannot_tell() -> None:
    with pytest.raises(ValueError, match="unknown trace format"):
        detect_format("a,b,c\n1,2,3\n", "x.csv")
    with pytest.raises(ValueError, match="empty"):
        detect_format("", "x.csv")


@pytest.mark.parametrize("name", ["azure_small.csv", "mooncake_small.jsonl", "plain_small.csv"])
def test_read_trace_dispatches_on_the_detected_format(name: str) -> None:
    text = fixture(name)
    fmt = detect_format(text, name)
    assert fmt in FORMATS
    trace = read_trace(text, fmt)
    assert trace.format == fmt and len(trace.requests) >= 3


def test_read_trace_rejects_an_unknown_format() -> None:
    with pytest.raises(ValueError, match="unknown trace format 'csv'"):
        read_trace("", "csv")


# --- bad rows: rejected with the row, or skipped and counted ----------------------------------------

PLAIN = "arrival_ms,input_tokens,output_tokens\n"
AZURE = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
MOON = '{"timestamp": 0, "input_length": 5, "output_length": 5}\n'


@pytest.mark.parametrize(
    ("fmt", "text", "row", "line", "reason"),
    [
        # plain: the header is line 1, so data row n is line n + 1 (blank lines aside)
        ("plain", PLAIN + "0,10,5\n5,,5\n", 2, 3, "missing_field"),
        ("plain", PLAIN + "0,10\n", 1, 2, "missing_field"),
        ("plain", PLAIN + "soon,10,5\n", 1, 2, "not_a_number"),
        ("plain", PLAIN + "nan,10,5\n", 1, 2, "not_a_number"),
        ("plain", PLAIN + "0,10,2.5\n", 1, 2, "not_a_number"),
        ("plain", PLAIN + "0,0,5\n", 1, 2, "non_positive_tokens"),
        ("plain", PLAIN + "0,10,-3\n", 1, 2, "non_positive_tokens"),
        ("plain", PLAIN + "-1,10,5\n", 1, 2, "negative_time"),
        ("plain", PLAIN + "0,10,5\n10,10,5\n\n5,10,5\n", 3, 5, "unsorted"),
        ("azure", AZURE + "2023-13-01 00:00:00,10,5\n", 2, 3, "not_a_number"),
        ("azure", AZURE + "yesterday,10,5\n", 2, 3, "not_a_number"),
        ("azure", AZURE + "2023-11-16 18:15:40.0,10,5\n", 2, 3, "unsorted"),
        ("azure", AZURE + "2023-11-16 18:15:50.0,ten,5\n", 2, 3, "not_a_number"),
        ("mooncake", MOON + "{not json}\n", 2, 2, "malformed"),
        ("mooncake", MOON + "[1, 2, 3]\n", 2, 2, "malformed"),
        ("mooncake", MOON + '{"timestamp": 1, "input_length": 5}\n', 2, 2, "missing_field"),
        ("mooncake", MOON + '{"timestamp": 1, "input_length": "5", "output_length": 5}\n', 2, 2, "not_a_number"),
        ("mooncake", MOON + '{"timestamp": true, "input_length": 5, "output_length": 5}\n', 2, 2, "not_a_number"),
        ("mooncake", MOON + '\n\n{"timestamp": 1, "input_length": 5, "output_length": 0}', 2, 4, "non_positive_tokens"),
    ],
)
def test_reject_names_the_row_and_line(fmt: str, text: str, row: int, line: int, reason: str) -> None:
    with pytest.raises(TraceError, match=rf"^row {row} \(line {line}\): ") as caught:
        read_trace(text, fmt)
    assert (caught.value.row, caught.value.line, caught.value.reason) == (row, line, reason)


def test_skip_drops_bad_rows_and_counts_them_per_reason() -> None:
    text = PLAIN + "\n".join(
        [
            "100,10,5",  # row 1: the origin
            "110,,5",  # row 2: missing_field
            "x,10,5",  # row 3: not_a_number
            "120,0,5",  # row 4: non_positive_tokens
            "130,10,-1",  # row 5: non_positive_tokens
            "90,10,5",  # row 6: unsorted (before row 1)
            "140,10,5",  # row 7: kept
            "135,10,5",  # row 8: unsorted (before row 7, the last accepted)
            "140,12,6",  # row 9: kept (a tie with row 7)
        ]
    )
    trace = read_plain_csv(text, on_error="skip")
    assert shape(trace) == [(0.0, 10, 5, 1), (40.0, 10, 5, 7), (40.0, 12, 6, 9)]
    assert trace.skipped == {"missing_field": 1, "not_a_number": 1, "non_positive_tokens": 2, "unsorted": 2}
    assert trace.skipped_total == 6


def test_skip_takes_the_first_accepted_row_as_the_origin() -> None:
    text = MOON.replace('"timestamp": 0', '"timestamp": 50').replace('"input_length": 5', '"input_length": 0')
    text += '{"timestamp": 60, "input_length": 5, "output_length": 5}\n'
    trace = read_mooncake_jsonl(text, on_error="skip")
    assert shape(trace) == [(0.0, 5, 5, 2)] and trace.skipped == {"non_positive_tokens": 1}


@pytest.mark.parametrize("on_error", ["reject", "skip"])
def test_a_header_without_its_columns_is_an_error_in_both_modes(on_error: OnError) -> None:
    with pytest.raises(TraceError, match=r"^row 0 \(line 1\): azure header lacks column\(s\) GeneratedTokens"):
        read_trace("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46,5\n", "azure", on_error=on_error)
    with pytest.raises(
        TraceError, match=r"exactly one of arrival_s, arrival_ms, timestamp; found arrival_s, arrival_ms$"
    ):
        read_trace("arrival_s,arrival_ms,input_tokens,output_tokens\n", "plain", on_error=on_error)
    with pytest.raises(TraceError, match="no header"):
        read_trace("\n\n", "plain", on_error=on_error)


def test_on_error_must_be_reject_or_skip() -> None:
    with pytest.raises(ValueError, match="on_error"):
        read_plain_csv(PLAIN + "0,1,1\n", on_error="ignore")  # type: ignore[arg-type]


@given(
    st.lists(
        st.tuples(st.integers(0, 10_000), st.integers(1, 200_000), st.integers(1, 10_000)),
        min_size=1,
        max_size=50,
    )
)
def test_plain_round_trip(rows: list[tuple[int, int, int]]) -> None:
    # gaps in ms, written as cumulative arrivals; the reader gives them back relative to row 1
    arrivals, at = [], 0
    for gap, _, _ in rows:
        at += gap
        arrivals.append(at)
    text = PLAIN + "".join(f"{a},{i},{o}\n" for a, (_, i, o) in zip(arrivals, rows, strict=True))
    trace = read_plain_csv(text)
    assert [(r.arrival_ms, r.input_tokens, r.output_tokens) for r in trace.requests] == [
        (float(a - arrivals[0]), i, o) for a, (_, i, o) in zip(arrivals, rows, strict=True)
    ]


# --- the seeded model / tenant mix ----------------------------------------------------------------


def requests(n: int) -> list[TraceRequest]:
    return [TraceRequest(arrival_ms=float(i), input_tokens=100, output_tokens=10, row=i + 1) for i in range(n)]


MODELS = {"llama3-70b": 0.6, "llama3-8b": 0.3, "mixtral-8x7b": 0.1}
TENANTS = {"acme": 3.0, "globex": 1.0}  # weights need not sum to 1: 0.75 / 0.25


def test_assignment_is_deterministic_for_a_seed() -> None:
    first = assign_workload(requests(1000), models=MODELS, tenants=TENANTS, seed=42)
    again = assign_workload(requests(1000), models=MODELS, tenants=TENANTS, seed=42)
    other = assign_workload(requests(1000), models=MODELS, tenants=TENANTS, seed=43)
    assert first == again
    assert [a.model for a in first] != [a.model for a in other]
    assert [(a.arrival_ms, a.input_tokens, a.output_tokens, a.row) for a in first] == [
        (r.arrival_ms, r.input_tokens, r.output_tokens, r.row) for r in requests(1000)
    ]


def test_assignment_follows_the_mix_over_10k_requests() -> None:
    assigned = assign_workload(requests(10_000), models=MODELS, tenants=TENANTS, seed=7)
    models = Counter(a.model for a in assigned)
    tenants = Counter(a.tenant for a in assigned)
    # binomial sd for p=0.5, n=10k is 0.005: 0.02 is four of them
    for name, share in MODELS.items():
        assert models[name] / 10_000 == pytest.approx(share, abs=0.02), models
    assert tenants["acme"] / 10_000 == pytest.approx(0.75, abs=0.02), tenants
    # the two draws are independent: the tenant split holds inside each model
    big = [a.tenant for a in assigned if a.model == "llama3-70b"]
    assert big.count("acme") / len(big) == pytest.approx(0.75, abs=0.03)


def test_assignment_depends_on_the_row_not_the_position_nor_the_dict_order() -> None:
    everything = assign_workload(requests(200), models=MODELS, tenants=TENANTS, seed=1)
    every_third = assign_workload(requests(200)[::3], models=MODELS, tenants=TENANTS, seed=1)
    assert every_third == everything[::3]
    reordered = dict(reversed(list(MODELS.items())))
    assert assign_workload(requests(200), models=reordered, tenants=TENANTS, seed=1) == everything


def test_zero_weights_are_never_chosen_and_bad_mixes_are_refused() -> None:
    assigned = assign_workload(requests(2000), models={"a": 1.0, "b": 0.0}, tenants={"t": 1}, seed=3)
    assert {a.model for a in assigned} == {"a"} and {a.tenant for a in assigned} == {"t"}
    for bad in ({}, {"a": 0.0}, {"a": -1.0}, {"a": float("nan")}):
        with pytest.raises(ValueError):
            assign_workload(requests(1), models=bad, tenants={"t": 1.0}, seed=0)


def test_seeded_uniform_is_in_unit_interval_and_fixed() -> None:
    draws = [seeded_uniform(2024, row, 0) for row in range(10_000)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert sum(draws) / len(draws) == pytest.approx(0.5, abs=0.01)
    # pinned: the rule is part of the contract, a change here changes every simulation
    assert seeded_uniform(0, 1, 0) == seeded_uniform(0, 1, 0)
    assert seeded_uniform(0, 1, 0) != seeded_uniform(0, 1, 1) != seeded_uniform(1, 1, 0)
    assert round(seeded_uniform(42, 1, 0), 12) == 0.577125795356


def test_the_mixer_is_splitmix64() -> None:
    # SplitMix64's published reference sequence from state 0: each call adds the golden gamma first
    assert _splitmix64(0) == 0xE220A8397B1DCDAF
    assert _splitmix64(0x9E3779B97F4A7C15) == 0x6E789E6AA1B965F4


# --- a whole Azure conversation trace: the real one where present, the project's own sample always ---------

# azure_conv_sample.csv (written for these tests, not sampled from the real trace): 40 requests in pairs
# 1155 +/- 25k input and 211 -/+ 5k output tokens (k = 0..19), so the means are exactly 1155 and 211, as
# the real trace's are to the token; 3.0000001 s between arrivals except 5 ties (rows 8, 15, 22, 29, 36):
# 34 x 3.0000001 s = 102.0000034 s.
AZURE_CONV_SAMPLE = FIXTURES / "azure_conv_sample.csv"


@pytest.mark.parametrize(
    ("path", "requests", "span_ms"),
    [
        pytest.param(AZURE_CONV_SAMPLE, 40, (102_000.00339, 102_000.00341), id="project-sample"),
        pytest.param(AZURE_CONV_2023, 19_366, (57 * 60_000, 59 * 60_000), id="azure-conv-2023"),
    ],
)
def test_a_whole_azure_conversation_trace(path: Path, requests: int, span_ms: tuple[float, float]) -> None:
    if not path.exists():
        pytest.skip(f"reference data not present at {path} (only on the development machine)")
    text = path.read_text()
    assert detect_format(text, path.name) == "azure"
    trace = read_azure_csv(text)
    n = len(trace.requests)
    mean_in = sum(r.input_tokens for r in trace.requests) / n
    mean_out = sum(r.output_tokens for r in trace.requests) / n
    span = trace.requests[-1].arrival_ms
    print(f"\n{path.name}: {n} requests over {span / 60_000:.1f} min, mean in {mean_in:.1f}, mean out {mean_out:.1f}")
    assert n == requests and trace.skipped == {}
    assert mean_in == pytest.approx(1155, abs=1)
    assert mean_out == pytest.approx(211, abs=1)
    assert span_ms[0] < span < span_ms[1]
    arrivals = [r.arrival_ms for r in trace.requests]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
