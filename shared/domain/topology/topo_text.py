"""Parsers for the text `nvidia-smi` prints: the `topo -m` matrix and `--query-gpu` CSV.

Both take the whole output as a string (a provider runs the command; this module never does)
and either return an immutable value or raise `TopologyParseError` saying which input line
was wrong and what was expected there.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from shared.domain.topology.links import Link, LinkKind, LinkMatrix, UnknownLinkCodeError, parse_link


class TopologyParseError(ValueError):
    """The text is not a well-formed `nvidia-smi` output.

    `line` is the 1-based input line at fault (None when no single line is: "no header line
    with GPU0 found"); `reason` says what was expected there. `str(error)` is
    "line 5: expected 8 link cells for GPU3, found 6".
    """

    def __init__(self, reason: str, line: int | None = None) -> None:
        super().__init__(f"line {line}: {reason}" if line is not None else reason)
        self.reason = reason
        self.line = line


CPU_AFFINITY = "CPU Affinity"
NUMA_AFFINITY = "NUMA Affinity"
GPU_NUMA_ID = "GPU NUMA ID"
KNOWN_TRAILING_COLUMNS = (CPU_AFFINITY, NUMA_AFFINITY, GPU_NUMA_ID)

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# Multi-word column names first, so space-separated headers keep them whole.
_HEADER_TOKEN = re.compile(r"CPU Affinity|NUMA Affinity|GPU NUMA ID|\S+", re.IGNORECASE)
_ROW_TOKEN = re.compile(r"\S+")
_GPU_COLUMN = re.compile(r"GPU(\d+)")
_NIC_COLUMN = re.compile(r"NIC\d+")
# Device columns: NIC0, mlx5_0, mlx5_bond_0, hfi1_0 ... a name ending in a digit.
_DEVICE_COLUMN = re.compile(r"[A-Za-z][\w.:-]*\d")
# What a trailing (affinity) cell looks like: a list/range of integers or N/A.
_VALUE_CELL = re.compile(r"(?:\[?N/A\]?|[\d,\-]+)", re.IGNORECASE)
_NOT_AVAILABLE = frozenset({"", "N/A", "[N/A]"})
_NIC_LEGEND = re.compile(r"NIC Legend\s*:?", re.IGNORECASE)
_NIC_LEGEND_ENTRY = re.compile(r"(NIC\d+)\s*:\s*(\S+)")
_TAB = 8
_MAX_LIST_INTEGERS = 1 << 16  # a CPU list longer than this is garbage, not a machine


class _Cell(NamedTuple):
    text: str  # "" for an empty tab-separated cell
    col: int  # display column with tabs expanded to 8, for aligning with the header


@dataclass(frozen=True, slots=True)
class TopoGpu:
    """One GPU row's facts besides its links.

    `cpu_affinity` / `numa_affinity` are the cells as printed, None when empty (cgroup-limited)
    or N/A; `cpus` / `numa_nodes` are those cells expanded to sorted integers, () where the
    cell is None or not a list of integers. `gpu_numa_id` is the GPU's own NUMA node
    (Grace-Hopper/Blackwell), None when absent or N/A. `nvlinks` sums NV<n> to the other GPUs.
    `cells` keeps every trailing cell as printed, keyed by header name, spacers removed.
    """

    index: int
    cpu_affinity: str | None
    cpus: tuple[int, ...]
    numa_affinity: str | None
    numa_nodes: tuple[int, ...]
    gpu_numa_id: int | None
    nvlinks: int
    cells: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class TopoNic:
    """A device column after the GPUs: `column` as in the header (`NIC0`, or `mlx5_0` in older
    output); `device` is the NIC Legend name (`mlx5_2`), the column itself for old-style
    columns, or None for a `NICn` the legend does not name."""

    column: str
    device: str | None


@dataclass(frozen=True, slots=True)
class ParsedTopology:
    """A parsed `nvidia-smi topo -m`: GPUs, NICs, the GPU link matrix and GPU->NIC links.

    `matrix` carries each GPU's NUMA node (the NUMA affinity when it names exactly one node).
    `nic_links[g][k]` is the link between GPU g and `nics[k]`. `columns` are the trailing
    header columns present, in order (e.g. CPU Affinity, NUMA Affinity, GPU NUMA ID).
    """

    gpus: tuple[TopoGpu, ...]
    nics: tuple[TopoNic, ...]
    matrix: LinkMatrix
    nic_links: tuple[tuple[Link, ...], ...]
    columns: tuple[str, ...]

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)

    def link(self, i: int, j: int) -> Link:
        return self.matrix.link(i, j)

    def nic_link(self, gpu: int, nic: str) -> Link:
        """The link from a GPU to a NIC named by column (`NIC0`) or device (`mlx5_2`)."""
        for k, candidate in enumerate(self.nics):
            if nic in (candidate.column, candidate.device):
                return self.nic_links[gpu][k]
        raise KeyError(nic)

    def closest_nics(self, gpu: int) -> tuple[TopoNic, ...]:
        """The NICs on the nearest PCIe class from this GPU (PIX before PXB ... SYS), in column
        order; () when the node has no NICs."""
        if not self.nics:
            return ()
        ranks = [_pcie_rank(link) for link in self.nic_links[gpu]]
        best = max(ranks)
        return tuple(nic for nic, rank in zip(self.nics, ranks, strict=True) if rank == best)


def _pcie_rank(link: Link) -> int:
    order = (LinkKind.SYS, LinkKind.NODE, LinkKind.PHB, LinkKind.PXB, LinkKind.PIX, LinkKind.NVLINK)
    return order.index(link.kind) if link.kind in order else -1


def parse_int_list(text: str) -> tuple[int, ...] | None:
    """Expand "0-47,96-143" / "0,3-9" / "5" to sorted distinct integers; None when the text is
    not such a list (including "", "N/A" and descending ranges)."""
    text = text.strip()
    if not text:
        return None
    values: set[int] = set()
    for part in text.split(","):
        low, sep, high = part.strip().partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            return None
        start, stop = int(low), int(high) if sep else int(low)
        if stop < start or len(values) + stop - start >= _MAX_LIST_INTEGERS:
            return None
        values.update(range(start, stop + 1))
    return tuple(sorted(values))


def _clean_lines(text: str) -> list[str]:
    return [_ANSI.sub("", line).rstrip() for line in text.splitlines()]


def _split_cells(line: str, *, header: bool) -> list[_Cell]:
    """Cells of a line with their display columns.

    With tabs, each tab-separated piece is a cell and an empty piece is an empty cell (it may
    be a cgroup-emptied affinity or alignment padding). Without tabs (output pasted through a
    terminal), whitespace runs separate cells and empty cells are simply gone. Header pieces
    keep the multi-word column names whole.
    """
    pattern = _HEADER_TOKEN if header else _ROW_TOKEN
    if "\t" not in line:
        return [_Cell(m.group(), m.start()) for m in pattern.finditer(line)]
    cells: list[_Cell] = []
    col = 0
    for piece in line.split("\t"):
        found = [_Cell(m.group(), col + m.start()) for m in pattern.finditer(piece)]
        cells.extend(found or [_Cell("", col)])
        col = (col + len(piece)) // _TAB * _TAB + _TAB
    while cells and cells[0].text == "":  # indentation, not a cell
        cells.pop(0)
    return cells


class _Header(NamedTuple):
    gpu_cols: list[_Cell]
    devices: list[_Cell]
    trailing: list[_Cell]


def _canonical_trailing(name: str) -> str:
    for known in KNOWN_TRAILING_COLUMNS:
        if name.lower() == known.lower():
            return known
    return name


def _parse_header(line: str) -> _Header | None:
    """The header if this line is one: GPU0..GPUn-1, then device columns, then trailing columns."""
    cells = [cell for cell in _split_cells(line, header=True) if cell.text]
    if not cells or cells[0].text != "GPU0":
        return None
    position = 0
    while position < len(cells):
        match = _GPU_COLUMN.fullmatch(cells[position].text)
        if match is None or int(match.group(1)) != position:
            break
        position += 1
    gpu_cols = cells[:position]
    devices: list[_Cell] = []
    trailing: list[_Cell] = []
    for cell in cells[position:]:
        name = _canonical_trailing(cell.text)
        if trailing or name in KNOWN_TRAILING_COLUMNS:
            trailing.append(_Cell(name, cell.col))
        elif _DEVICE_COLUMN.fullmatch(cell.text) and not _GPU_COLUMN.fullmatch(cell.text):
            devices.append(cell)
        else:  # "GPU0 is busy": prose, not a header
            return None
    return _Header(gpu_cols, devices, trailing)


def _find_header(lines: Sequence[str]) -> tuple[int, _Header]:
    for index, line in enumerate(lines):
        header = _parse_header(line)
        if header is not None:
            return index, header
    raise TopologyParseError("no header line with GPU0 found")


def _next_nonblank(lines: Sequence[str], start: int) -> int:
    index = start
    while index < len(lines) and not lines[index].strip():
        index += 1
    return index


def _looks_like_value(text: str) -> bool:
    return bool(_VALUE_CELL.fullmatch(text))


def _parse_link_cells(
    cells: list[_Cell], expected: int, label: str, columns: Sequence[str], line_no: int
) -> tuple[list[Link], list[_Cell]]:
    """The first `expected` non-empty cells after the label as links; the rest is trailing."""
    links: list[Link] = []
    position = 1
    while len(links) < expected:
        while position < len(cells) and cells[position].text == "":
            position += 1  # stray alignment tabs inside the link area carry nothing
        if position >= len(cells) or _looks_like_value(cells[position].text):
            raise TopologyParseError(f"expected {expected} link cells for {label}, found {len(links)}", line_no)
        text = cells[position].text
        try:
            links.append(parse_link(text))
        except UnknownLinkCodeError as error:
            raise TopologyParseError(
                f"unknown link code {error.code!r} ({label}, column {columns[len(links)]})", line_no
            ) from None
        position += 1
    trailing = cells[position:]
    surplus = 0
    for cell in trailing:
        if not cell.text:
            continue
        if _looks_like_value(cell.text):
            break
        try:
            parse_link(cell.text)
        except UnknownLinkCodeError:
            break
        surplus += 1
    if surplus:
        found = expected + surplus
        raise TopologyParseError(f"expected {expected} link cells for {label}, found {found}", line_no)
    return links, trailing


def _assign_trailing(cells: list[_Cell], columns: Sequence[_Cell], shift: int, label: str, line_no: int) -> list[str]:
    """Map a row's trailing cells onto the header's trailing columns ("" where a cell is empty).

    Tab output pads with empty cells (before `GPU NUMA ID`, and after a short `CPU Affinity`
    in old drivers): surplus empty cells are dropped right to left, never the last one.
    Space-separated output loses empty cells instead: the missing columns are taken to be
    CPU Affinity first (the only cell a cgroup empties), then by alignment with the header.
    """
    want = len(columns)
    values = list(cells)
    index = len(values) - 2
    while len(values) > want and index >= 0:
        if values[index].text == "":
            del values[index]
        index -= 1
    while len(values) > want and values and values[-1].text == "":
        values.pop()
    if len(values) > want:
        names = ", ".join(column.text for column in columns) or "none"
        found = sum(1 for cell in cells if cell.text)
        raise TopologyParseError(
            f"expected at most {want} values ({names}) after the links of {label}, found {found}", line_no
        )
    if len(values) == want:
        return [cell.text for cell in values]

    def cost(chosen: tuple[int, ...]) -> tuple[int, int]:
        missing_not_cpu = sum(1 for k, column in enumerate(columns) if k not in chosen and column.text != CPU_AFFINITY)
        misalignment = sum(abs(cell.col - shift - columns[k].col) for cell, k in zip(values, chosen, strict=True))
        return missing_not_cpu, misalignment

    best = min(itertools.combinations(range(want), len(values)), key=cost)
    out = [""] * want
    for cell, k in zip(values, best, strict=True):
        out[k] = cell.text
    return out


def _affinity(raw: str) -> tuple[str | None, tuple[int, ...]]:
    if raw.strip().upper() in _NOT_AVAILABLE:
        return None, ()
    return raw, parse_int_list(raw) or ()


def _gpu_numa_id(raw: str, label: str, line_no: int) -> int | None:
    if raw.strip().upper() in _NOT_AVAILABLE:
        return None
    if raw.isdigit():
        return int(raw)
    raise TopologyParseError(f"expected an integer or N/A for {GPU_NUMA_ID} of {label}, found {raw!r}", line_no)


def _nic_legend(lines: Sequence[str], start: int) -> dict[str, str]:
    legend: dict[str, str] = {}
    index = start
    while index < len(lines) and not _NIC_LEGEND.fullmatch(lines[index].strip()):
        if _parse_header(lines[index]) is not None:  # a second output: its legend is not ours
            return legend
        index += 1
    for line in lines[index + 1 :]:
        text = line.strip()
        if not text:
            continue
        match = _NIC_LEGEND_ENTRY.fullmatch(text)
        if match is None:
            break
        legend[match.group(1)] = match.group(2)
    return legend


def parse_topo_matrix(text: str) -> ParsedTopology:
    """Parse the output of `nvidia-smi topo -m`.

    Accepts tab- or space-separated cells, CRLF, trailing whitespace, ANSI colour codes, shell
    prompts and prose before the header, and legends after the matrix. NIC columns may be
    `NICn` (named by a trailing "NIC Legend:" block) or device names (`mlx5_0`). Trailing
    columns are matched by name: CPU Affinity, NUMA Affinity, GPU NUMA ID, each optional.
    NIC rows are recognised and skipped: GPU->NIC links are read from the GPU rows.

    Raises `TopologyParseError` for: no header; a missing or misnamed GPU row ("expected a
    row for GPU7 (truncated?)"); a row with too few or too many link cells; an unknown code;
    anything but `X` on the diagonal or `X` off it; an asymmetric GPU matrix; a bad GPU NUMA ID.
    """
    lines = _clean_lines(text)
    header_index, header = _find_header(lines)
    gpu_count = len(header.gpu_cols)
    column_names = [cell.text for cell in header.gpu_cols + header.devices]
    expected = len(column_names)

    rows: list[list[Link]] = []
    gpus: list[TopoGpu] = []
    cursor = header_index + 1
    for g in range(gpu_count):
        label = f"GPU{g}"
        cursor = _next_nonblank(lines, cursor)
        line_no = cursor + 1
        if cursor >= len(lines):
            raise TopologyParseError(f"expected a row for {label} (truncated?), found end of input", line_no)
        cells = _split_cells(lines[cursor], header=False)
        if cells[0].text != label:
            raise TopologyParseError(f"expected a row for {label} (truncated?), found {cells[0].text!r}", line_no)
        links, trailing = _parse_link_cells(cells, expected, label, column_names, line_no)
        for j, link in enumerate(links[:gpu_count]):
            if (j == g) != (link.kind is LinkKind.SELF):
                if j == g:
                    problem = f"expected X on the diagonal for {label}"
                else:
                    problem = f"unexpected X for {label}-GPU{j}"
                raise TopologyParseError(f"{problem}, found {link.code}", line_no)
            if j < g and rows[j][g] != link:
                raise TopologyParseError(
                    f"matrix is not symmetric: GPU{j}-{label} {rows[j][g].code} vs {label}-GPU{j} {link.code}",
                    line_no,
                )
        rows.append(links)
        # Header and row may be indented differently when pasted; align on the first link cell.
        first_link = next(cell for cell in cells[1:] if cell.text)
        shift = first_link.col - header.gpu_cols[0].col
        values = _assign_trailing(trailing, header.trailing, shift, label, line_no)
        by_name = dict(zip((column.text for column in header.trailing), values, strict=True))
        cpu_affinity, cpus = _affinity(by_name.get(CPU_AFFINITY, ""))
        numa_affinity, numa_nodes = _affinity(by_name.get(NUMA_AFFINITY, ""))
        gpus.append(
            TopoGpu(
                index=g,
                cpu_affinity=cpu_affinity,
                cpus=cpus,
                numa_affinity=numa_affinity,
                numa_nodes=numa_nodes,
                gpu_numa_id=_gpu_numa_id(by_name.get(GPU_NUMA_ID, ""), label, line_no),
                nvlinks=sum(link.nv_links for link in links[:gpu_count]),
                cells=tuple(by_name.items()),
            )
        )
        cursor += 1

    device_names = {cell.text for cell in header.devices}
    while True:  # NIC rows: recognised so the legend search starts after them
        following = _next_nonblank(lines, cursor)
        if following >= len(lines):
            break
        first = _split_cells(lines[following], header=False)
        if not first or first[0].text not in device_names:
            break
        cursor = following + 1

    legend = _nic_legend(lines, cursor)
    nics = tuple(
        TopoNic(cell.text, legend.get(cell.text) if _NIC_COLUMN.fullmatch(cell.text) else cell.text)
        for cell in header.devices
    )
    numa = tuple(gpu.numa_nodes[0] if len(gpu.numa_nodes) == 1 else None for gpu in gpus)
    matrix = LinkMatrix(tuple(tuple(row[:gpu_count]) for row in rows), numa)
    return ParsedTopology(
        gpus=tuple(gpus),
        nics=nics,
        matrix=matrix,
        nic_links=tuple(tuple(row[gpu_count:]) for row in rows),
        columns=tuple(cell.text for cell in header.trailing),
    )


# --- nvidia-smi --query-gpu=... --format=csv ---------------------------------------------

QUERY_GPU_FIELDS = (
    "index",
    "name",
    "uuid",
    "pci.bus_id",
    "memory.total",
    "memory.used",
    "pcie.link.gen.max",
    "pcie.link.width.max",
    "power.limit",
)
"""The `--query-gpu` fields this parser reads, in the order assumed for `noheader` output."""

_FIELD_ALIASES = {
    **{name: name for name in QUERY_GPU_FIELDS},
    "gpu_name": "name",
    "gpu_uuid": "uuid",
    "gpu_bus_id": "pci.bus_id",
}
_HEADER_FIELD = re.compile(r"\s*([\w.]+)\s*(?:\[([^\]]*)\])?\s*")
_QUANTITY = re.compile(r"(\d+(?:\.\d+)?)\s*([A-Za-z]+)?")
_BYTES_PER_UNIT = {"b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_WATTS_PER_UNIT = {"w": 1.0, "mw": 1e-3, "kw": 1e3}


@dataclass(frozen=True, slots=True)
class QueriedGpu:
    """One row of `nvidia-smi --query-gpu=index,name,uuid,pci.bus_id,memory.total,memory.used,
    pcie.link.gen.max,pcie.link.width.max,power.limit --format=csv`. Fields the output lacks,
    or prints as `[N/A]` / `[Not Supported]`, are None; memory is in bytes (MiB x 2^20)."""

    index: int
    name: str | None
    uuid: str | None
    pci_bus_id: str | None
    memory_total_bytes: int | None
    memory_used_bytes: int | None
    pcie_link_gen_max: int | None
    pcie_link_width_max: int | None
    power_limit_w: float | None


class _Column(NamedTuple):
    field: str | None  # None: a queried field this parser does not read
    unit: str | None  # from "memory.total [MiB]"; applies to values printed without a unit


def _missing(value: str) -> bool:
    # nvidia-smi brackets every non-value: [N/A], [Not Supported], [Unknown Error], ...
    return not value or value.upper() == "N/A" or (value.startswith("[") and value.endswith("]"))


def _quantity(value: str, unit: str | None, scale: dict[str, float] | dict[str, int]) -> float | None:
    match = _QUANTITY.fullmatch(value)
    if match is None:
        return None
    factor = scale.get((match.group(2) or unit or "").lower())
    return None if factor is None else float(match.group(1)) * factor


def _header_columns(fields: Sequence[str]) -> list[_Column] | None:
    columns: list[_Column] = []
    for text in fields:
        match = _HEADER_FIELD.fullmatch(text)
        if match is None:
            return None
        columns.append(_Column(_FIELD_ALIASES.get(match.group(1).lower()), match.group(2)))
    known = [column.field for column in columns if column.field is not None]
    return columns if known and len(known) == len(set(known)) else None


def _query_rows(lines: Sequence[str]) -> Iterator[tuple[int, list[str]]]:
    for number, line in enumerate(lines, start=1):
        if line.strip():
            yield number, [field.strip() for field in line.split(",")]


def parse_query_gpu_csv(text: str) -> tuple[QueriedGpu, ...]:
    """Parse `nvidia-smi --query-gpu=... --format=csv[,noheader][,nounits]` output.

    With a header, columns are matched by name (`memory.total [MiB]`), in any order, unknown
    ones ignored, and a unit in the header applies to unit-less values (`nounits`). Without a
    header, the columns must be `QUERY_GPU_FIELDS` in order; unit-less memory is MiB and power
    is W. Lines before the header or first row (a shell prompt) are skipped, and the table ends
    at the first line without a comma. Rows without an index column are numbered in order.
    Raises `TopologyParseError` with the line for a wrong field count or an unreadable value.
    """
    lines = _clean_lines(text)
    columns: list[_Column] | None = None
    out: list[QueriedGpu] = []
    started = False
    for line_no, fields in _query_rows(lines):
        if len(fields) < 2:
            if started:
                break
            continue
        if not started:
            columns = _header_columns(fields)
            if columns is not None:
                started = True
                continue
            if not fields[0].isdigit():
                continue  # prose or a prompt before the output
            columns = [_Column(name, None) for name in QUERY_GPU_FIELDS]
            started = True
        assert columns is not None
        if len(fields) != len(columns):
            raise TopologyParseError(f"expected {len(columns)} comma-separated fields, found {len(fields)}", line_no)
        out.append(_query_row(fields, columns, len(out), line_no))
    if not started:
        raise TopologyParseError("no --query-gpu header or data row found")
    return tuple(out)


def _query_row(fields: Sequence[str], columns: Sequence[_Column], ordinal: int, line_no: int) -> QueriedGpu:
    values: dict[str, str | None] = {}
    units: dict[str, str | None] = {}
    for raw, column in zip(fields, columns, strict=True):
        if column.field is not None:
            values[column.field] = None if _missing(raw) else raw
            units[column.field] = column.unit

    def integer(name: str) -> int | None:
        raw = values.get(name)
        if raw is None:
            return None
        if not raw.isdigit():
            raise TopologyParseError(f"expected an integer for {name}, found {raw!r}", line_no)
        return int(raw)

    def memory(name: str) -> int | None:
        raw = values.get(name)
        if raw is None:
            return None
        amount = _quantity(raw, units.get(name) or "MiB", _BYTES_PER_UNIT)
        if amount is None:
            raise TopologyParseError(f"expected a memory size like '81559 MiB' for {name}, found {raw!r}", line_no)
        return round(amount)

    def watts(name: str) -> float | None:
        raw = values.get(name)
        if raw is None:
            return None
        amount = _quantity(raw, units.get(name) or "W", _WATTS_PER_UNIT)
        if amount is None:
            raise TopologyParseError(f"expected a power like '700.00 W' for {name}, found {raw!r}", line_no)
        return amount

    index = integer("index")
    return QueriedGpu(
        index=ordinal if index is None else index,
        name=values.get("name"),
        uuid=values.get("uuid"),
        pci_bus_id=values.get("pci.bus_id"),
        memory_total_bytes=memory("memory.total"),
        memory_used_bytes=memory("memory.used"),
        pcie_link_gen_max=integer("pcie.link.gen.max"),
        pcie_link_width_max=integer("pcie.link.width.max"),
        power_limit_w=watts("power.limit"),
    )
