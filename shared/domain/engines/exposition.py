"""A reader for the Prometheus text exposition format (version 0.0.4), the body of an engine's `/metrics`.

Pure: it reads a string and returns samples. It is lenient the way a scraper must be: a line it cannot
read is skipped and counted, never raised; only text with nothing readable in it at all raises
`UnreadableExposition`. Format reference: https://prometheus.io/docs/instrumenting/exposition_formats/
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = ["Exposition", "Sample", "UnreadableExposition", "parse_exposition"]

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
# Decimal numbers, Inf/Infinity and NaN in any case, as Go's ParseFloat (which Prometheus uses) reads
# them; not Python's extras (digits separated by underscores). Go's hexadecimal floats are not read.
_VALUE = re.compile(r"[+-]?(?:inf(?:inity)?|nan|(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?)", re.IGNORECASE)
_TIMESTAMP = re.compile(r"-?\d+")
_TYPES = frozenset({"counter", "gauge", "histogram", "summary", "untyped"})
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


class UnreadableExposition(ValueError):
    """The text is not a Prometheus exposition at all: no line of it is a sample or a HELP/TYPE line."""


Labels = tuple[tuple[str, str], ...]
"""Label pairs sorted by name, so that two spellings of one series compare equal."""


@dataclass(frozen=True, slots=True)
class Sample:
    """One line of the exposition: `name{labels} value [timestamp_ms]`."""

    name: str
    labels: Labels
    value: float
    timestamp_ms: int | None = None

    def label(self, name: str) -> str | None:
        for key, value in self.labels:
            if key == name:
                return value
        return None


@dataclass(frozen=True, slots=True)
class Exposition:
    """The samples of one scrape in the order they came, the declared family types and help texts, and
    how many lines were skipped as unreadable (a duplicate series counts as one)."""

    samples: tuple[Sample, ...]
    types: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    helps: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    skipped_lines: int = 0

    def named(self, name: str) -> Iterator[Sample]:
        return (sample for sample in self.samples if sample.name == name)

    def has(self, name: str) -> bool:
        return any(sample.name == name for sample in self.samples)


def parse_exposition(text: str | bytes) -> Exposition:
    """Read a `/metrics` body. Lines that are not a sample, a HELP, a TYPE or another comment are
    skipped and counted in `skipped_lines`; a second line for a series already read is skipped too.
    An empty body is an empty exposition. Raises `UnreadableExposition` for bytes that are not UTF-8
    and for text of which not one line could be read."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as error:
            raise UnreadableExposition(f"not UTF-8: {error.reason} at byte {error.start}") from None
    samples: list[Sample] = []
    seen: set[tuple[str, Labels]] = set()
    types: dict[str, str] = {}
    helps: dict[str, str] = {}
    skipped = read = 0
    for raw in text.split("\n"):
        line = raw.rstrip("\r")
        if not line.strip():
            continue
        if line.startswith("#"):
            if _read_comment(line, types, helps):
                read += 1
            continue
        sample = _read_sample(line)
        if sample is None or (sample.name, sample.labels) in seen:
            skipped += 1
            continue
        seen.add((sample.name, sample.labels))
        samples.append(sample)
        read += 1
    if skipped and not read:
        raise UnreadableExposition(f"none of its {skipped} lines is a Prometheus sample")
    return Exposition(tuple(samples), MappingProxyType(types), MappingProxyType(helps), skipped)


def _read_comment(line: str, types: dict[str, str], helps: dict[str, str]) -> bool:
    """HELP and TYPE lines fill `types`/`helps` and count as read; any other comment is ignored."""
    parts = line[1:].strip(" \t").split(None, 2)
    if len(parts) < 2 or parts[0] not in ("HELP", "TYPE") or not _NAME.fullmatch(parts[1]):
        return False
    rest = parts[2] if len(parts) == 3 else ""
    if parts[0] == "TYPE":
        if rest.strip() not in _TYPES:
            return False
        types.setdefault(parts[1], rest.strip())
    else:
        helps.setdefault(parts[1], _unescape(rest, quotes=False) or "")
    return True


def _read_sample(line: str) -> Sample | None:
    line = line.strip(" \t")
    name_match = _NAME.match(line)
    if name_match is None:
        return None
    name, position = name_match.group(), name_match.end()
    labels: Labels = ()
    if position < len(line) and line[position] == "{":
        read = _read_labels(line, position + 1)
        if read is None:
            return None
        labels, position = read
    elif position < len(line) and line[position] not in " \t":
        return None
    fields = line[position:].split()
    if not 1 <= len(fields) <= 2 or not _VALUE.fullmatch(fields[0]):
        return None
    value = float(fields[0])
    timestamp = None
    if len(fields) == 2:
        if not _TIMESTAMP.fullmatch(fields[1]):
            return None
        timestamp = int(fields[1])
    return Sample(name, labels, value, timestamp)


def _read_labels(line: str, position: int) -> tuple[Labels, int] | None:
    """Read `a="x",b="y"}` from `position`; return the sorted pairs and the position after `}`."""
    pairs: dict[str, str] = {}
    while True:
        while position < len(line) and line[position] in " \t":
            position += 1
        if position < len(line) and line[position] == "}":
            return tuple(sorted(pairs.items())), position + 1
        name_match = _LABEL_NAME.match(line, position)
        if name_match is None:
            return None
        position = name_match.end()
        while position < len(line) and line[position] in " \t":
            position += 1
        if line[position : position + 2] != '="':
            return None
        value_end = _closing_quote(line, position + 2)
        if value_end is None or name_match.group() in pairs:
            return None
        value = _unescape(line[position + 2 : value_end], quotes=True)
        if value is None:
            return None
        pairs[name_match.group()] = value
        position = value_end + 1
        while position < len(line) and line[position] in " \t":
            position += 1
        if position < len(line) and line[position] == ",":
            position += 1
        elif position >= len(line) or line[position] != "}":
            return None


def _closing_quote(line: str, position: int) -> int | None:
    while position < len(line):
        if line[position] == "\\":
            position += 2
        elif line[position] == '"':
            return position
        else:
            position += 1
    return None


def _unescape(text: str, *, quotes: bool) -> str | None:
    """Undo `\\\\`, `\\n` (and `\\"` in label values); an unknown escape is kept as written, as
    Prometheus does. None for a lone trailing backslash."""
    if "\\" not in text:
        return text
    out: list[str] = []
    position = 0
    while position < len(text):
        char = text[position]
        if char != "\\":
            out.append(char)
            position += 1
            continue
        if position + 1 >= len(text):
            return None
        escaped = text[position + 1]
        if escaped in _ESCAPES and (quotes or escaped != '"'):
            out.append(_ESCAPES[escaped])
        else:
            out.append("\\" + escaped)
        position += 2
    return "".join(out)
