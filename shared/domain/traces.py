"""Workload traces: request arrivals read from text, and a seeded model/tenant mix laid over them.

Pure: every reader takes the file's *text* (the caller does the IO) and returns a `Trace`. Three
formats are understood (`TraceFormat`):

* ``azure`` - the Azure LLM inference traces (AzurePublicDataset): CSV with the columns
  ``TIMESTAMP, ContextTokens, GeneratedTokens``. ``TIMESTAMP`` is ``YYYY-MM-DD HH:MM:SS[.fraction]``
  with any number of fractional digits (the 2023 traces print seven, 100 ns ticks), a space or ``T``
  between date and time, and an optional ``Z`` / ``+HH:MM`` offset that is applied when present.
  It is parsed here by hand into integer nanoseconds, so no precision is lost to floats.
* ``mooncake`` - the Mooncake traces: JSON lines with ``timestamp`` (ms), ``input_length`` and
  ``output_length``; other keys (``hash_ids``, ...) are ignored. Values must be JSON numbers.
* ``plain`` - our own CSV: one arrival column, ``arrival_s`` (seconds), ``arrival_ms``
  (milliseconds) or ``timestamp`` (seconds, as a Unix timestamp is), plus ``input_tokens`` and
  ``output_tokens``. Other columns are ignored; exactly one arrival column must be present.

Common rules, for all formats:

* Header names are matched case-insensitively after trimming blanks; columns may come in any order.
* Blank lines are ignored and do not count as rows. In the CSV formats, lines starting with ``#`` before
  the header are comments (a shipped sample names its source and licence there; `comment_header`
  returns them); a ``#`` line after the header is a row like any other. Rows are numbered from 1 over the data rows
  (the CSV header is not a row); errors also give the physical line number.
* ``arrival_ms`` is relative to the first *accepted* request, which therefore arrives at 0.0.
* Token counts must be whole numbers greater than zero (``12`` or ``12.0``, not ``12.5``).
* Timestamps must not go backwards: a row earlier than the last accepted row is ``unsorted``; equal
  timestamps are fine. A trace out of order usually means a broken or concatenated file, so it is
  not re-sorted here: the request order stays the file order.
* ``on_error="reject"`` (the default) raises `TraceError` at the first bad row, naming its row and
  line. ``on_error="skip"`` drops bad rows and counts them per `SkipReason` in `Trace.skipped`;
  an unsorted row is dropped (the rows after it are compared with the last *accepted* timestamp).
* A CSV header that lacks a required column raises `TraceError` (row 0) in both modes.

`assign_workload` then gives each request a model and a tenant from a weighted mix, deterministically
for a seed and without any random module (see its docstring for the rule).
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import date
from functools import partial
from typing import Literal, Protocol, get_args

TraceFormat = Literal["azure", "mooncake", "plain"]
OnError = Literal["reject", "skip"]
SkipReason = Literal[
    "malformed",  # not a record at all: invalid JSON, a JSON value that is not an object
    "missing_field",  # a required field absent or empty
    "not_a_number",  # a field that does not parse as its type (number, whole number, timestamp)
    "non_positive_tokens",  # a token count of zero or less
    "negative_time",  # a numeric arrival time below zero
    "unsorted",  # earlier than the last accepted row
]
FORMATS: tuple[TraceFormat, ...] = get_args(TraceFormat)
SKIP_REASONS: tuple[SkipReason, ...] = get_args(SkipReason)


class TraceError(ValueError):
    """A trace row (or the header, row 0) that cannot be read; names the data row and the line."""

    def __init__(self, row: int, message: str, *, line: int | None = None, reason: SkipReason | None = None) -> None:
        where = f"row {row}" if line is None else f"row {row} (line {line})"
        super().__init__(f"{where}: {message}")
        self.row = row
        self.line = line
        self.message = message
        self.reason = reason


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request: when it arrives (ms after the trace's first request) and its token counts."""

    arrival_ms: float
    input_tokens: int
    output_tokens: int
    row: int  # 1-based data row in the source text


@dataclass(frozen=True, slots=True)
class Trace:
    """The accepted requests in file order, the skipped rows counted per reason, and the format read."""

    requests: tuple[TraceRequest, ...]
    skipped: dict[str, int]
    format: TraceFormat

    @property
    def skipped_total(self) -> int:
        return sum(self.skipped.values())


@dataclass(frozen=True, slots=True)
class AssignedRequest:
    """A trace request with the model and tenant `assign_workload` chose for it."""

    arrival_ms: float
    input_tokens: int
    output_tokens: int
    row: int
    model: str
    tenant: str


# ---------------------------------------------------------------------------------------------
# Field parsing. Each parser returns a value or raises _RowError with its reason.


class _HeaderError(Exception):
    """A CSV header without the columns its format needs."""


class _RowError(Exception):
    def __init__(self, reason: SkipReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


_NANOS_PER_MS = 1_000_000
_NANOS_PER_S = 1_000_000_000
_TIMESTAMP = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,12}))?"
    r"\s*(Z|[+-]\d{2}:?\d{2})?"
)


def parse_timestamp_ns(text: str) -> int:
    """Nanoseconds since 0001-01-01 UTC for ``YYYY-MM-DD HH:MM:SS[.fff...][Z|+HH:MM]``.

    Raises ValueError for anything else (including impossible dates such as 2023-02-30).
    """
    match = _TIMESTAMP.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"expected YYYY-MM-DD HH:MM:SS[.fraction], got {text!r}")
    year, month, day, hour, minute, second = (int(g) for g in match.groups()[:6])
    fraction, offset = match.group(7) or "", match.group(8)
    if hour > 23 or minute > 59 or second > 60:  # 60: a leap second, counted as the next second's start
        raise ValueError(f"time of day out of range in {text!r}")
    days = date(year, month, day).toordinal()  # raises ValueError on an impossible date
    seconds = days * 86_400 + hour * 3600 + minute * 60 + second
    if offset and offset != "Z":
        sign = -1 if offset[0] == "-" else 1
        digits = offset[1:].replace(":", "")
        seconds -= sign * (int(digits[:2]) * 3600 + int(digits[2:]) * 60)
    nanos = int((fraction + "000000000")[:9])  # digits past nanoseconds are truncated
    return seconds * _NANOS_PER_S + nanos


def _require(value: object, name: str) -> object:
    if value is None or (isinstance(value, str) and not value.strip()):
        raise _RowError("missing_field", f"missing {name}")
    return value


def _number(value: object, name: str) -> float:
    value = _require(value, name)
    if isinstance(value, bool):
        raise _RowError("not_a_number", f"{name}: expected a number, got {value!r}")
    if isinstance(value, int | float):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            raise _RowError("not_a_number", f"{name}: expected a number, got {value!r}") from None
    else:
        raise _RowError("not_a_number", f"{name}: expected a number, got {value!r}")
    if not math.isfinite(number):
        raise _RowError("not_a_number", f"{name}: expected a finite number, got {value!r}")
    return number


def _tokens(value: object, name: str) -> int:
    number = _number(value, name)
    if not number.is_integer():
        raise _RowError("not_a_number", f"{name}: expected a whole number of tokens, got {value!r}")
    if number <= 0:
        raise _RowError("non_positive_tokens", f"{name}: expected more than 0 tokens, got {value!r}")
    return int(number)


def _time_ns(value: object, name: str, nanos_per_unit: int) -> int:
    number = _number(value, name)
    if number < 0:
        raise _RowError("negative_time", f"{name}: expected a time >= 0, got {value!r}")
    return round(number * nanos_per_unit)


# ---------------------------------------------------------------------------------------------
# The shared row loop: parse each record, check order, reject or count.

# (row, line, the record's parser): the parser returns (arrival in ns, input tokens, output tokens).
_Record = tuple[int, int, Callable[[], tuple[int, int, int]]]


def _collect(records: Iterator[_Record], fmt: TraceFormat, on_error: OnError) -> Trace:
    if on_error not in ("reject", "skip"):
        raise ValueError(f"on_error must be 'reject' or 'skip', got {on_error!r}")
    requests: list[TraceRequest] = []
    skipped: dict[str, int] = {}
    first_ns: int | None = None
    last_ns: int | None = None
    for row, line, parse in records:
        try:
            arrival_ns, input_tokens, output_tokens = parse()
            if last_ns is not None and arrival_ns < last_ns:
                raise _RowError("unsorted", "timestamp is earlier than the previous row's")
        except _RowError as bad:
            if on_error == "reject":
                raise TraceError(row, bad.message, line=line, reason=bad.reason) from None
            skipped[bad.reason] = skipped.get(bad.reason, 0) + 1
            continue
        if first_ns is None:
            first_ns = arrival_ns
        last_ns = arrival_ns
        requests.append(TraceRequest((arrival_ns - first_ns) / _NANOS_PER_MS, input_tokens, output_tokens, row))
    return Trace(requests=tuple(requests), skipped=skipped, format=fmt)


def _leading_comments(lines: Sequence[str]) -> int:
    """How many of ``lines`` are ``#`` comments or blank before the first other line."""
    count = 0
    for line in lines:
        if line.strip() and not line.lstrip().startswith("#"):
            break
        count += 1
    return count


def comment_header(text: str) -> tuple[str, ...]:
    """The ``#`` comment lines before a CSV trace's header, without the ``#`` and one following blank."""
    lines = text.lstrip("\ufeff").splitlines()
    comments = (line.lstrip()[1:] for line in lines[: _leading_comments(lines)] if line.strip())
    return tuple(c[1:] if c.startswith(" ") else c for c in comments)


def _csv_rows(text: str) -> Iterator[tuple[int, list[str]]]:
    """(physical line, cells) for each non-blank CSV record, header first; leading comments skipped."""
    lines = text.lstrip("\ufeff").splitlines()
    skip = _leading_comments(lines)
    # Blank in place of the comments, so the reader's line numbers stay the file's.
    reader = csv.reader([""] * skip + lines[skip:])
    for cells in reader:
        if not cells or all(not cell.strip() for cell in cells):
            continue
        yield reader.line_num, cells


def _csv_records(
    text: str, columns: Callable[[dict[str, int]], Callable[[list[str]], tuple[int, int, int]]]
) -> Iterator[_Record]:
    rows = _csv_rows(text)
    first = next(rows, None)
    if first is None:
        raise TraceError(0, "empty trace: no header line")
    line, header = first
    index = {name.strip().lower(): i for i, name in enumerate(header)}
    try:
        parse_cells = columns(index)
    except _HeaderError as bad:
        raise TraceError(0, str(bad), line=line) from None
    for row, (line, cells) in enumerate(rows, start=1):
        yield row, line, partial(parse_cells, cells)


def _cell(cells: list[str], index: int) -> str | None:
    return cells[index] if index < len(cells) else None


def _need(index: dict[str, int], names: Sequence[str], fmt: str) -> list[int]:
    missing = [name for name in names if name.lower() not in index]
    if missing:
        raise _HeaderError(f"{fmt} header lacks column(s) {', '.join(missing)}; found {', '.join(index) or 'none'}")
    return [index[name.lower()] for name in names]


# ---------------------------------------------------------------------------------------------
# Readers.


def read_azure_csv(text: str, *, on_error: OnError = "reject") -> Trace:
    """Requests from an Azure LLM inference trace (``TIMESTAMP, ContextTokens, GeneratedTokens``)."""

    def columns(index: dict[str, int]) -> Callable[[list[str]], tuple[int, int, int]]:
        at, context, generated = _need(index, ("TIMESTAMP", "ContextTokens", "GeneratedTokens"), "azure")

        def parse(cells: list[str]) -> tuple[int, int, int]:
            stamp = str(_require(_cell(cells, at), "TIMESTAMP"))
            try:
                arrival_ns = parse_timestamp_ns(stamp)
            except ValueError as bad:
                raise _RowError("not_a_number", f"TIMESTAMP: {bad}") from None
            return (
                arrival_ns,
                _tokens(_cell(cells, context), "ContextTokens"),
                _tokens(_cell(cells, generated), "GeneratedTokens"),
            )

        return parse

    return _collect(_csv_records(text, columns), "azure", on_error)


_PLAIN_TIME_COLUMNS = {"arrival_s": _NANOS_PER_S, "arrival_ms": _NANOS_PER_MS, "timestamp": _NANOS_PER_S}


def read_plain_csv(text: str, *, on_error: OnError = "reject") -> Trace:
    """Requests from our plain CSV: one of ``arrival_s`` / ``arrival_ms`` / ``timestamp`` (seconds),
    plus ``input_tokens`` and ``output_tokens``."""

    def columns(index: dict[str, int]) -> Callable[[list[str]], tuple[int, int, int]]:
        times = [name for name in _PLAIN_TIME_COLUMNS if name in index]
        if len(times) != 1:
            found = "none" if not times else ", ".join(times)
            raise _HeaderError(f"plain header needs exactly one of arrival_s, arrival_ms, timestamp; found {found}")
        time_name = times[0]
        at, given, wanted = _need(index, (time_name, "input_tokens", "output_tokens"), "plain")
        unit = _PLAIN_TIME_COLUMNS[time_name]

        def parse(cells: list[str]) -> tuple[int, int, int]:
            return (
                _time_ns(_cell(cells, at), time_name, unit),
                _tokens(_cell(cells, given), "input_tokens"),
                _tokens(_cell(cells, wanted), "output_tokens"),
            )

        return parse

    return _collect(_csv_records(text, columns), "plain", on_error)


def _mooncake_record(raw: str) -> tuple[int, int, int]:
    try:
        record = json.loads(raw)
    except json.JSONDecodeError as bad:
        raise _RowError("malformed", f"invalid JSON: {bad.msg} at column {bad.colno}") from None
    if not isinstance(record, dict):
        raise _RowError("malformed", f"expected a JSON object, got {type(record).__name__}")
    return (
        _time_ns(_json_number(record, "timestamp"), "timestamp", _NANOS_PER_MS),
        _tokens(_json_number(record, "input_length"), "input_length"),
        _tokens(_json_number(record, "output_length"), "output_length"),
    )


def _json_number(record: Mapping[str, object], name: str) -> object:
    value = record.get(name)
    if isinstance(value, str) and value.strip():  # JSON numbers only: a quoted number is a producer bug
        raise _RowError("not_a_number", f"{name}: expected a JSON number, got {value!r}")
    return value


def read_mooncake_jsonl(text: str, *, on_error: OnError = "reject") -> Trace:
    """Requests from a Mooncake JSON-lines trace (``timestamp`` ms, ``input_length``, ``output_length``)."""

    def records() -> Iterator[_Record]:
        row = 0
        for line, raw in enumerate(text.lstrip("\ufeff").splitlines(), start=1):
            if not raw.strip():
                continue
            row += 1
            yield row, line, partial(_mooncake_record, raw)

    return _collect(records(), "mooncake", on_error)


class _Reader(Protocol):
    def __call__(self, text: str, *, on_error: OnError = "reject") -> Trace: ...


_READERS: dict[str, _Reader] = {
    "azure": read_azure_csv,
    "mooncake": read_mooncake_jsonl,
    "plain": read_plain_csv,
}


def read_trace(text: str, fmt: str, *, on_error: OnError = "reject") -> Trace:
    """Requests from ``text`` in format ``fmt`` (one of `FORMATS`); ValueError for an unknown format."""
    if fmt not in _READERS:
        raise ValueError(f"unknown trace format {fmt!r}; expected one of {', '.join(FORMATS)}")
    return _READERS[fmt](text, on_error=on_error)


def detect_format(text: str, filename: str = "") -> TraceFormat:
    """The format of a trace, from its first non-blank line (past ``#`` comment lines); the file name
    decides only when that is silent.

    A line starting with ``{`` is ``mooncake``; a CSV header with ``ContextTokens`` and
    ``GeneratedTokens`` is ``azure``; one with ``input_tokens`` and ``output_tokens`` is ``plain``.
    An empty text is ``mooncake`` for a ``.jsonl`` / ``.json`` name. Raises ValueError otherwise.
    """
    lines = text.lstrip("\ufeff").splitlines()
    first = next((line.strip() for line in lines if line.strip()), "")
    if first.startswith("{"):
        return "mooncake"
    if first.startswith("#"):  # a CSV's comment lines: its header is the first line after them
        first = next((line.strip() for line in lines[_leading_comments(lines) :] if line.strip()), "")
    if first:
        header = {cell.strip().lower() for cell in next(csv.reader([first]))}
        if {"contexttokens", "generatedtokens"} <= header:
            return "azure"
        if {"input_tokens", "output_tokens"} <= header:
            return "plain"
        raise ValueError(f"{filename or 'trace'}: unknown trace format; first line is {first[:80]!r}")
    if filename.lower().endswith((".jsonl", ".json")):
        return "mooncake"
    raise ValueError(f"{filename or 'trace'}: empty trace, format cannot be told")


# ---------------------------------------------------------------------------------------------
# Seeded model / tenant assignment.

_MASK64 = (1 << 64) - 1
_MODEL_STREAM = 0
_TENANT_STREAM = 1


def _splitmix64(x: int) -> int:
    # Steele, Lea & Flood's SplitMix64 finaliser: a bijection on 64-bit words with good avalanche.
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, *keys: int) -> float:
    """A uniform number in [0, 1) that depends only on ``seed`` and ``keys``.

    The seed and then each key (taken modulo 2**64) are folded in with SplitMix64; the top 53 bits of
    the last word are the fraction. The same arguments give the same number on every platform.
    """
    word = _splitmix64(seed & _MASK64)
    for key in keys:
        word = _splitmix64(word ^ (key & _MASK64))
    return (word >> 11) / float(1 << 53)


def _cumulative(mix: Mapping[str, float], what: str) -> list[tuple[str, float]]:
    if not mix:
        raise ValueError(f"{what}: the mix is empty")
    for name, weight in mix.items():
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight) or weight < 0:
            raise ValueError(f"{what}[{name!r}]: expected a finite weight >= 0, got {weight!r}")
    total = float(sum(mix.values()))
    if total <= 0:
        raise ValueError(f"{what}: the weights sum to 0")
    running = 0.0
    steps: list[tuple[str, float]] = []
    for name in sorted(mix):  # sorted: the caller's dict order must not change the outcome
        if mix[name] > 0:
            running += mix[name] / total
            steps.append((name, running))
    return steps


def _pick(steps: list[tuple[str, float]], roll: float) -> str:
    for name, upper in steps:
        if roll < upper:
            return name
    return steps[-1][0]  # roll within rounding of 1.0


def assign_workload(
    requests: Sequence[TraceRequest],
    *,
    models: Mapping[str, float],
    tenants: Mapping[str, float],
    seed: int,
) -> list[AssignedRequest]:
    """Give each request a model and a tenant drawn from weighted mixes, deterministically for ``seed``.

    Rule: weights are normalised to sum 1 and laid out in the sorted order of the names (zero-weight
    names are never chosen). For a request with data row ``r`` the model is the name whose cumulative
    interval holds ``seeded_uniform(seed, r, 0)``, the tenant the one holding
    ``seeded_uniform(seed, r, 1)``. The two draws are independent, and a request's draw depends only on
    ``(seed, row)``: dropping bad rows or slicing the trace does not change the others' assignment.
    """
    model_steps = _cumulative(models, "models")
    tenant_steps = _cumulative(tenants, "tenants")
    return [
        AssignedRequest(
            arrival_ms=request.arrival_ms,
            input_tokens=request.input_tokens,
            output_tokens=request.output_tokens,
            row=request.row,
            model=_pick(model_steps, seeded_uniform(seed, request.row, _MODEL_STREAM)),
            tenant=_pick(tenant_steps, seeded_uniform(seed, request.row, _TENANT_STREAM)),
        )
        for request in requests
    ]
