"""The simulator's shipped sample trace: it installs with the package, names its source, licence and
citation in its own '#' lines, and reads as the first 4,000 requests of the Azure conversation trace."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from hetsched.cli.sim.run import SAMPLE_TRACE, sample_trace_path, trace_notes
from shared.domain.traces import comment_header, detect_format, read_trace

ROOT = Path(__file__).resolve().parents[3]
AZURE_CONV_2023 = ROOT.parent / "shared" / "data" / "traces" / "AzureLLMInferenceTrace_conv_2023.csv"


def test_the_sample_is_package_data_beside_the_demo_fleet() -> None:
    path = sample_trace_path()
    assert path.is_file() and path.name == SAMPLE_TRACE
    assert (path.parent / "demo_fleet.yaml").is_file()
    # shared.catalog is a package (pip installs its data files); the CSV pattern covers this file
    assert (path.parent / "__init__.py").is_file()
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "*.csv" in config["tool"]["setuptools"]["package-data"]["*"]


def test_the_data_file_names_its_source_licence_and_citation() -> None:
    notes = trace_notes(sample_trace_path())
    assert "github.com/Azure/AzurePublicDataset" in notes["Source"]
    assert "AzureLLMInferenceTrace_conv.csv" in notes["Source"]
    assert notes["Licence"].startswith("CC-BY 4.0")
    assert "creativecommons.org/licenses/by/4.0" in notes["Licence"]
    assert "Patel" in notes["Citation"] and "Splitwise" in notes["Citation"] and "ISCA 2024" in notes["Citation"]
    assert "first 4,000 requests" in notes["Sample"]
    assert "Changes" in notes  # CC-BY asks that changes be indicated


def test_the_sample_reads_as_4000_azure_requests_with_no_bad_row() -> None:
    text = sample_trace_path().read_text(encoding="utf-8")
    assert text.isascii()  # reads the same under any locale's default encoding
    assert len(comment_header(text)) >= 4
    assert detect_format(text, SAMPLE_TRACE) == "azure"
    trace = read_trace(text, "azure", on_error="reject")
    requests = trace.requests
    assert len(requests) == 4000 and trace.skipped == {}
    assert [r.row for r in requests] == list(range(1, 4001))
    arrivals = [r.arrival_ms for r in requests]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    # 18:29:21.7598180 - 18:15:46.6805900 = 815.079228 s: the span its '#' lines state (13.6 minutes)
    assert arrivals[-1] == pytest.approx(815_079.228)
    mean_in = sum(r.input_tokens for r in requests) / 4000
    mean_out = sum(r.output_tokens for r in requests) / 4000
    assert round(mean_in) == 1183 and round(mean_out) == 254  # as its '#' lines state


def test_the_sample_is_the_first_4000_rows_of_the_published_trace() -> None:
    if not AZURE_CONV_2023.exists():
        pytest.skip(f"reference data not present at {AZURE_CONV_2023} (only on the development machine)")
    published = AZURE_CONV_2023.read_text().replace("\r\n", "\n").splitlines()
    shipped = [line for line in sample_trace_path().read_text().splitlines() if not line.startswith("#")]
    assert shipped == published[:4001]  # the header and the first 4,000 rows, unchanged
