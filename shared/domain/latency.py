"""Latency of one model replica on one SKU at a TP degree: prefill compute-bound, decode bandwidth-bound.

The model, per GPU (or TPU chip) of a TP group of ``tp``, for a SKU with peak bf16 ``flops`` and
memory ``bandwidth`` (datasheet figures from the catalog):

* **Prefill** of ``tokens`` = batch x prompt tokens, needing ``F = 2 x active_params x tokens`` flops::

      prefill_ms = F / (flops x mfu) x (s + (1 - s) / tp) + prefill_overhead_ms

  ``mfu`` is the share of peak the prefill matmuls reach; ``s`` is the share of the work that TP does
  not divide (Amdahl's serial fraction: all-reduces, norms, sampling). The measured prefill speed-up
  from TP 2 to 8 is well below 4x, which a bare ``F / (tp x flops x mfu)`` cannot show.
  Attention's quadratic term is left out: up to 8k tokens the fit does without it.

* **One decode step** for ``batch`` sequences whose context is ``context_tokens`` long::

      decode_step_ms = (weight_bytes + batch x context_tokens x kv_bytes_per_token) / tp / (bandwidth x mbu)
                     + 2 x active_params x batch / tp / (flops x decode_mfu)
                     + step_overhead_ms + tp_comm_ms_per_doubling x log2(tp)

  ``weight_bytes`` is what one step reads: ``min(params, active_params x batch) x bytes_per_param``
  (all of a dense model; for a mixture of experts, each sequence's active experts until every expert
  is touched). The matmul term is added, not max-ed with the memory term: the measured step time
  grows with batch long before the compute roof. The TP term grows with the number of ring hops.

* `estimate` puts them together for a static batch that arrives and is prefilled together, as in the
  measured data: ``ttft = prefill(batch x prompt)``, ``tpot`` = one step at the mean context
  ``prompt + output / 2``, ``e2e = ttft + (output - 1) x tpot``.

**Calibration.** `fit_calibration` fits the seven efficiency numbers of a `Calibration` by weighted
least squares on relative error (each row counts by its error as a share of the measured time), on
measured rows passed in as `PerfRow` records: prefill on ``prompt_time`` with the features
``(F/tp, F, 1)``, decode on ``token_time`` with ``(memory time, matmul time, 1, log2 tp)``. The
coefficients are kept physical by a greedy active set: an inverse efficiency never falls below 1
(mbu and decode_mfu at most 1) and the rest never below 0; a coefficient that wants to cross its
bound is pinned there and the others refitted. Repeated configurations are reduced to their median
first, so a block that appears three times does not weigh three times and single outliers do not pull.

The shipped defaults come from Splitwise's measurements (Patel et al., "Splitwise", ISCA 2024; the
``perf_model.csv`` of Mutinifni/splitwise-sim, MIT): llama2-70b (TP 2/4/8) and bloom-176b (TP 8) on
A100-80GB and H100-80GB, 1-64 prompts of 128-8192 tokens, fitted per SKU family (rounded to three
digits here and in the constants below)::

    family  mfu    s      prefill_overhead  mbu   decode_mfu  step_overhead  tp_comm/doubling
    ampere  0.648  0.073  26.2 ms           1.00  0.326       16.8 ms        5.21 ms
    hopper  0.555  0.107  21.4 ms           1.00  0.130       10.8 ms        4.42 ms

    relative error, median / worst row, over the 415 rows used per SKU (llama2-70b's 310 alone):
    A100  prefill  9.1% / 51%  (llama2-70b 6.6%)   decode 7.0% / 28%  (llama2-70b 4.9%)
    H100  prefill 10.6% / 53%  (llama2-70b 8.5%)   decode 3.0% / 25%  (llama2-70b 2.8%)

The worst rows are llama2-70b at TP 8 with many tokens in flight (a batch of 16-64, or an 8k
prompt): TP 8 scales worse there than one serial fraction says, and the model is 40-50% fast.
``mbu`` sits on its bound of 1 on both families: the measured step times are dominated by fixed
per-step costs, and the bytes read explain less of them than even full datasheet bandwidth would;
the overhead and TP terms carry the rest. The power-capped H100 rows (``h100-80gb-pcap``) are not
used: they describe another operating point, not the datasheet part (their decode rows are the
uncapped ones again; their prefill is ~30% slower).

**Inconsistent rows.** The TP2 batch-64 llama2-70b rows (A100, H100, H100 power-capped) report a
prefill of 64 x 512 tokens in 794 / 361 / 469 ms, a seventh to an eighth of the 6,633 / 2,398 /
3,117 ms their batch-32 rows take for half the work, a token time below batch 32's, and an e2e time
~15x what their prefill and 128 decode steps add up to: most likely not what the other rows
measured (a run that did not hold 64 sequences). `inconsistent_configs` drops by rule, not by
name: in a series that only doubles the work (batch or prompt size), a configuration whose median
prefill is less than half the previous kept one's is excluded, from both fits. On this file it drops
exactly those three configurations.

**Other SKUs.** A calibration holds efficiencies, not speeds, so each SKU's own datasheet flops and
bandwidth scale it; the fixed overheads (ms) are taken as they are. By `Sku.family`:

* ``hopper`` (H100 PCIe, H200, GH200): the H100 fit as is.
* ``ampere`` (A100 40 GB, PCIe): the A100 fit as is.
* ``ada`` (L40S): ASSUMPTION, not measured. The A100 fit (Ada runs Ampere-style mma.sync kernels, with
  no Hopper wgmma/TMA), with the TP term x4: L40S has no NVLink, so TP all-reduces cross PCIe.
* ``tpu-v5e`` / ``tpu-v5p``: ASSUMPTION, not measured. The H100 fit's efficiencies and overheads
  against the TPU's datasheet bf16 and HBM bandwidth, ICI taken to cost what NVLink does.
"""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from shared.domain.hardware import Sku

# ---------------------------------------------------------------------------------------------
# Inputs: what the latency model needs to know about a model.


def transformer_kv_bytes_per_token(*, layers: int, kv_heads: int, head_dim: int, dtype_bytes: float = 2.0) -> float:
    """KV cache bytes one token adds across all layers: 2 (K and V) x layers x kv_heads x head_dim x bytes."""
    return 2.0 * layers * kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What latency depends on: parameter counts, weight dtype size and the KV bytes one token adds."""

    name: str
    params: float
    active_params: float
    kv_bytes_per_token: float
    bytes_per_param: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.active_params <= self.params:
            raise ValueError(f"{self.name}: need 0 < active_params <= params, got {self.active_params}, {self.params}")
        if self.kv_bytes_per_token < 0 or self.bytes_per_param <= 0:
            raise ValueError(f"{self.name}: kv_bytes_per_token must be >= 0 and bytes_per_param > 0")

    def weight_bytes_read(self, batch: int) -> float:
        """Weight bytes one decode step reads: every active expert of every sequence, at most all weights."""
        return min(self.params, self.active_params * batch) * self.bytes_per_param


# The two models the shipped calibration was fitted on (parameter counts from their model cards).
LLAMA2_70B = ModelShape(
    name="llama2-70b",
    params=68_976_648_192,
    active_params=68_976_648_192,
    kv_bytes_per_token=transformer_kv_bytes_per_token(layers=80, kv_heads=8, head_dim=128),  # GQA: 327,680 B
)
BLOOM_176B = ModelShape(
    name="bloom-176b",
    params=176_247_271_424,
    active_params=176_247_271_424,
    kv_bytes_per_token=transformer_kv_bytes_per_token(layers=70, kv_heads=112, head_dim=128),  # MHA: 4,014,080 B
)
SPLITWISE_MODELS: Mapping[str, ModelShape] = {m.name: m for m in (LLAMA2_70B, BLOOM_176B)}
# Splitwise's hardware names and the catalog SKU each one measured.
SPLITWISE_HARDWARE: Mapping[str, str] = {
    "a100-80gb": "A100-SXM-80GB",
    "h100-80gb": "H100-SXM-80GB",
    "h100-80gb-pcap": "H100-SXM-80GB",
}


# ---------------------------------------------------------------------------------------------
# Calibration and the model.


@dataclass(frozen=True, slots=True)
class Calibration:
    """Efficiency factors of one SKU family (see the module docstring for the formulas)."""

    mfu: float  # prefill: share of peak bf16 flops reached, at tp=1
    tp_serial_fraction: float  # prefill: share of the work TP does not divide
    prefill_overhead_ms: float
    mbu: float  # decode: share of datasheet memory bandwidth reached
    decode_mfu: float  # decode: share of peak flops the batch's matmuls reach
    step_overhead_ms: float  # decode: fixed cost of one step (launches, scheduling, sampling)
    tp_comm_ms_per_doubling: float  # decode: all-reduce cost per doubling of tp
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("mfu", "mbu", "decode_mfu"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"Calibration.{name} must be in (0, 1], got {getattr(self, name)}")
        if not 0 <= self.tp_serial_fraction < 1:
            raise ValueError(f"Calibration.tp_serial_fraction must be in [0, 1), got {self.tp_serial_fraction}")
        if min(self.prefill_overhead_ms, self.step_overhead_ms, self.tp_comm_ms_per_doubling) < 0:
            raise ValueError("Calibration overheads must be >= 0")


AMPERE_CALIBRATION = Calibration(
    mfu=0.648,
    tp_serial_fraction=0.0729,
    prefill_overhead_ms=26.2,
    mbu=1.0,
    decode_mfu=0.326,
    step_overhead_ms=16.8,
    tp_comm_ms_per_doubling=5.21,
    source="fit_calibration on Splitwise A100-80GB rows (llama2-70b TP2/4/8, bloom-176b TP8)",
)
HOPPER_CALIBRATION = Calibration(
    mfu=0.555,
    tp_serial_fraction=0.107,
    prefill_overhead_ms=21.4,
    mbu=1.0,
    decode_mfu=0.130,
    step_overhead_ms=10.8,
    tp_comm_ms_per_doubling=4.42,
    source="fit_calibration on Splitwise H100-80GB rows (llama2-70b TP2/4/8, bloom-176b TP8)",
)
ADA_CALIBRATION = replace(
    AMPERE_CALIBRATION,
    tp_comm_ms_per_doubling=4 * AMPERE_CALIBRATION.tp_comm_ms_per_doubling,
    source="ASSUMPTION: the A100 fit, TP term x4 for PCIe-only all-reduces (no L40S measurement)",
)
TPU_CALIBRATION = replace(
    HOPPER_CALIBRATION,
    source="ASSUMPTION: the H100 fit's efficiencies against TPU datasheet figures (no TPU measurement)",
)
DEFAULT_CALIBRATIONS: Mapping[str, Calibration] = {
    "ampere": AMPERE_CALIBRATION,
    "hopper": HOPPER_CALIBRATION,
    "ada": ADA_CALIBRATION,
    "tpu-v5e": TPU_CALIBRATION,
    "tpu-v5p": TPU_CALIBRATION,
}


def calibration_for(sku: Sku, calibrations: Mapping[str, Calibration] = DEFAULT_CALIBRATIONS) -> Calibration:
    """The calibration of ``sku``'s family; ValueError naming the family when there is none."""
    try:
        return calibrations[sku.family]
    except KeyError:
        raise ValueError(f"no latency calibration for SKU {sku.name} (family {sku.family!r})") from None


@dataclass(frozen=True, slots=True)
class LatencyEstimate:
    """Time to first token, time per output token after it, and the whole request, in milliseconds."""

    ttft_ms: float
    tpot_ms: float
    e2e_ms: float


def _peaks(sku: Sku) -> tuple[float, float]:
    flops = sku.bf16_tflops * 1e12
    bandwidth = sku.memory_bandwidth_bytes_per_s
    if flops <= 0 or bandwidth <= 0:
        raise ValueError(f"SKU {sku.name} needs bf16_tflops and memory_bandwidth_bytes_per_s above 0")
    return flops, bandwidth


def _check(tp: int, batch: int) -> None:
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")


def _prefill_features(model: ModelShape, sku: Sku, tp: int, tokens: int) -> tuple[float, float, float]:
    # (F/tp, F, 1) with F the prefill's flops expressed as ms at the SKU's peak.
    flops, _ = _peaks(sku)
    at_peak_ms = 2.0 * model.active_params * tokens / flops * 1e3
    return at_peak_ms / tp, at_peak_ms, 1.0


def _decode_features(
    model: ModelShape, sku: Sku, tp: int, batch: int, context_tokens: float
) -> tuple[float, float, float, float]:
    # (memory time, matmul time, 1, log2 tp), the first two as ms at datasheet speed.
    flops, bandwidth = _peaks(sku)
    bytes_read = model.weight_bytes_read(batch) + batch * context_tokens * model.kv_bytes_per_token
    memory_ms = bytes_read / tp / bandwidth * 1e3
    matmul_ms = 2.0 * model.active_params * batch / tp / flops * 1e3
    return memory_ms, matmul_ms, 1.0, math.log2(tp)


def _prefill_coefficients(c: Calibration) -> tuple[float, float, float]:
    return (1 - c.tp_serial_fraction) / c.mfu, c.tp_serial_fraction / c.mfu, c.prefill_overhead_ms


def _decode_coefficients(c: Calibration) -> tuple[float, float, float, float]:
    return 1 / c.mbu, 1 / c.decode_mfu, c.step_overhead_ms, c.tp_comm_ms_per_doubling


def _dot(a: Iterable[float], b: Iterable[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def prefill_ms(
    model: ModelShape,
    sku: Sku,
    tp: int,
    prompt_tokens: int,
    batch: int = 1,
    *,
    calibration: Calibration | None = None,
) -> float:
    """Milliseconds to prefill ``batch`` prompts of ``prompt_tokens`` together on a TP group of ``tp``."""
    _check(tp, batch)
    if prompt_tokens < 0:
        raise ValueError(f"prompt_tokens must be >= 0, got {prompt_tokens}")
    c = calibration or calibration_for(sku)
    return _dot(_prefill_coefficients(c), _prefill_features(model, sku, tp, prompt_tokens * batch))


def decode_step_ms(
    model: ModelShape,
    sku: Sku,
    tp: int,
    batch: int,
    context_tokens: float,
    *,
    calibration: Calibration | None = None,
) -> float:
    """Milliseconds for one decode step of ``batch`` sequences, each with ``context_tokens`` in its KV cache."""
    _check(tp, batch)
    if context_tokens < 0:
        raise ValueError(f"context_tokens must be >= 0, got {context_tokens}")
    c = calibration or calibration_for(sku)
    return _dot(_decode_coefficients(c), _decode_features(model, sku, tp, batch, context_tokens))


def estimate(
    model: ModelShape,
    sku: Sku,
    tp: int,
    prompt_tokens: int,
    output_tokens: int,
    batch: int = 1,
    *,
    calibration: Calibration | None = None,
) -> LatencyEstimate:
    """TTFT, TPOT and end-to-end time of each request of a static batch (see the module docstring)."""
    if output_tokens < 1:
        raise ValueError(f"output_tokens must be >= 1, got {output_tokens}")
    ttft = prefill_ms(model, sku, tp, prompt_tokens, batch, calibration=calibration)
    tpot = decode_step_ms(model, sku, tp, batch, prompt_tokens + output_tokens / 2, calibration=calibration)
    return LatencyEstimate(ttft_ms=ttft, tpot_ms=tpot, e2e_ms=ttft + (output_tokens - 1) * tpot)


# ---------------------------------------------------------------------------------------------
# Measured rows and the fit.

PerfConfig = tuple[str, str, int, int, int, int]  # (model, hardware, tp, prompt_tokens, batch, output_tokens)


@dataclass(frozen=True, slots=True)
class PerfRow:
    """One measurement: ``prompt_time_ms`` prefills ``batch`` prompts, ``token_time_ms`` is one decode step."""

    model: str
    hardware: str
    tp: int
    prompt_tokens: int
    batch: int
    output_tokens: int
    prompt_time_ms: float
    token_time_ms: float

    @property
    def config(self) -> PerfConfig:
        return (self.model, self.hardware, self.tp, self.prompt_tokens, self.batch, self.output_tokens)


_SPLITWISE_COLUMNS = (
    "model",
    "hardware",
    "tensor_parallel",
    "prompt_size",
    "batch_size",
    "token_size",
    "prompt_time",
    "token_time",
)


def read_splitwise_perf_csv(text: str) -> list[PerfRow]:
    """Rows of a Splitwise ``perf_model.csv`` (times in ms); ValueError naming the line of a bad row."""
    reader = csv.DictReader(text.lstrip("\ufeff").splitlines())
    missing = [name for name in _SPLITWISE_COLUMNS if name not in (reader.fieldnames or [])]
    if missing:
        raise ValueError(f"perf CSV lacks column(s) {', '.join(missing)}")
    rows: list[PerfRow] = []
    for record in reader:
        try:
            rows.append(
                PerfRow(
                    model=record["model"].strip(),
                    hardware=record["hardware"].strip(),
                    tp=int(record["tensor_parallel"]),
                    prompt_tokens=int(record["prompt_size"]),
                    batch=int(record["batch_size"]),
                    output_tokens=int(record["token_size"]),
                    prompt_time_ms=float(record["prompt_time"]),
                    token_time_ms=float(record["token_time"]),
                )
            )
        except (TypeError, ValueError) as bad:
            raise ValueError(f"perf CSV line {reader.line_num}: {bad}") from None
    return rows


def _medians(rows: Iterable[PerfRow]) -> dict[PerfConfig, PerfRow]:
    groups: dict[PerfConfig, list[PerfRow]] = {}
    for row in rows:
        groups.setdefault(row.config, []).append(row)
    return {
        config: replace(
            members[0],
            prompt_time_ms=statistics.median(r.prompt_time_ms for r in members),
            token_time_ms=statistics.median(r.token_time_ms for r in members),
        )
        for config, members in groups.items()
    }


def inconsistent_configs(rows: Iterable[PerfRow]) -> frozenset[PerfConfig]:
    """Configurations whose prefill took less than half the time of the same setup doing half the work.

    Series: same model, hardware, tp and output size, ordered by batch (prompt fixed) or by prompt
    size (batch fixed); each step up a series at least doubles the prefill work, so a median
    ``prompt_time`` under half the previous kept configuration's cannot be the same measurement.
    """
    medians = _medians(rows)
    series: dict[tuple[object, ...], list[PerfRow]] = {}
    for row in medians.values():
        series.setdefault(("batch", row.model, row.hardware, row.tp, row.prompt_tokens, row.output_tokens), []).append(
            row
        )
        series.setdefault(("prompt", row.model, row.hardware, row.tp, row.batch, row.output_tokens), []).append(row)
    bad: set[PerfConfig] = set()
    for key, members in series.items():
        members.sort(key=lambda r: r.batch if key[0] == "batch" else r.prompt_tokens)
        kept: PerfRow | None = None
        for row in members:
            if kept is not None and row.prompt_time_ms < 0.5 * kept.prompt_time_ms:
                bad.add(row.config)
                continue
            kept = row
    return frozenset(bad)


@dataclass(frozen=True, slots=True)
class FitError:
    """Relative errors |model - measured| / measured over the rows compared."""

    rows: int
    prefill_median: float
    prefill_max: float
    decode_median: float
    decode_max: float


@dataclass(frozen=True, slots=True)
class CalibrationFit:
    """A fitted calibration, its error on the rows it was fitted on, and the configurations left out."""

    calibration: Calibration
    error: FitError
    excluded: tuple[PerfConfig, ...]


def _mean_context(row: PerfRow) -> float:
    # token_time is the mean over the generated tokens, whose context grows from prompt to prompt + output.
    return row.prompt_tokens + row.output_tokens / 2


def _model_of(row: PerfRow, models: Mapping[str, ModelShape]) -> ModelShape:
    try:
        return models[row.model]
    except KeyError:
        raise ValueError(f"no ModelShape for model {row.model!r} in the perf rows") from None


def calibration_error(
    rows: Sequence[PerfRow], *, sku: Sku, models: Mapping[str, ModelShape], calibration: Calibration
) -> FitError:
    """How far the model with ``calibration`` is from each measured row (every row counts, none is dropped)."""
    if not rows:
        raise ValueError("no rows to compare")
    prefill_errors: list[float] = []
    decode_errors: list[float] = []
    for row in rows:
        model = _model_of(row, models)
        predicted_prefill = prefill_ms(model, sku, row.tp, row.prompt_tokens, row.batch, calibration=calibration)
        predicted_step = decode_step_ms(model, sku, row.tp, row.batch, _mean_context(row), calibration=calibration)
        prefill_errors.append(abs(predicted_prefill - row.prompt_time_ms) / row.prompt_time_ms)
        decode_errors.append(abs(predicted_step - row.token_time_ms) / row.token_time_ms)
    return FitError(
        rows=len(rows),
        prefill_median=statistics.median(prefill_errors),
        prefill_max=max(prefill_errors),
        decode_median=statistics.median(decode_errors),
        decode_max=max(decode_errors),
    )


def _solve(matrix: list[list[float]], vector: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting; ValueError when the system is singular."""
    n = len(vector)
    a = [[*row, vector[i]] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12:
            raise ValueError("the rows do not determine the calibration (singular least-squares system)")
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(n):
            if r != col:
                factor = a[r][col] / a[col][col]
                a[r] = [x - factor * y for x, y in zip(a[r], a[col], strict=True)]
    return [a[i][n] / a[i][i] for i in range(n)]


def _bounded_fit(features: Sequence[Sequence[float]], targets: Sequence[float], lower: Sequence[float]) -> list[float]:
    """Minimise sum(((features . coef) - target) / target)^2 with coef >= lower, by a greedy active set.

    Solve with the free coefficients; pin the one furthest below its bound to the bound; repeat.
    """
    width = len(lower)
    pinned: dict[int, float] = {}
    while True:
        free = [i for i in range(width) if i not in pinned]
        rows = [[f[i] / t for i in free] for f, t in zip(features, targets, strict=True)]
        rest = [
            (t - sum(f[i] * value for i, value in pinned.items())) / t for f, t in zip(features, targets, strict=True)
        ]
        normal = [
            [_dot((r[i] for r in rows), (r[j] for r in rows)) for j in range(len(free))] for i in range(len(free))
        ]
        solution = _solve(normal, [_dot((r[i] for r in rows), rest) for i in range(len(free))]) if free else []
        coef = dict(pinned)
        coef.update(zip(free, solution, strict=True))
        worst = min(free, key=lambda i: coef[i] - lower[i], default=None)
        if worst is None or coef[worst] >= lower[worst]:
            return [coef[i] for i in range(width)]
        pinned[worst] = lower[worst]


def fit_calibration(
    rows: Sequence[PerfRow],
    *,
    sku: Sku,
    models: Mapping[str, ModelShape],
    source: str = "",
) -> CalibrationFit:
    """Fit a `Calibration` to measured rows of one hardware (the SKU ``sku``); see the module docstring.

    Configurations `inconsistent_configs` flags are left out of both fits; rows with the same
    configuration are reduced to their median first. The error is measured on every row that was used.
    """
    hardware = {row.hardware for row in rows}
    if len(hardware) != 1:
        raise ValueError(f"fit one hardware at a time; the rows hold {sorted(hardware) or 'none'}")
    excluded = inconsistent_configs(rows)
    used = [row for row in rows if row.config not in excluded]
    medians = [row for config, row in sorted(_medians(used).items()) if config not in excluded]
    prefill_x: list[tuple[float, ...]] = []
    decode_x: list[tuple[float, ...]] = []
    for row in medians:
        model = _model_of(row, models)
        prefill_x.append(_prefill_features(model, sku, row.tp, row.prompt_tokens * row.batch))
        decode_x.append(_decode_features(model, sku, row.tp, row.batch, _mean_context(row)))
    if len(medians) < 4:
        raise ValueError(f"need at least 4 distinct configurations to fit, got {len(medians)}")
    per_tp, whole, prefill_overhead = _bounded_fit(prefill_x, [r.prompt_time_ms for r in medians], (0.0, 0.0, 0.0))
    inverse_mbu, inverse_decode_mfu, step_overhead, comm = _bounded_fit(
        decode_x, [r.token_time_ms for r in medians], (1.0, 1.0, 0.0, 0.0)
    )
    if per_tp + whole <= 0:
        raise ValueError("the prefill times do not grow with the work; cannot fit mfu")
    calibration = Calibration(
        mfu=min(1.0, 1 / (per_tp + whole)),
        tp_serial_fraction=whole / (per_tp + whole),
        prefill_overhead_ms=prefill_overhead,
        mbu=1 / inverse_mbu,
        decode_mfu=1 / inverse_decode_mfu,
        step_overhead_ms=step_overhead,
        tp_comm_ms_per_doubling=comm,
        source=source or f"fit_calibration on {len(used)} {next(iter(hardware))} rows",
    )
    return CalibrationFit(
        calibration=calibration,
        error=calibration_error(used, sku=sku, models=models, calibration=calibration),
        excluded=tuple(sorted(excluded)),
    )
