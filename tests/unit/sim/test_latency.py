"""The latency model: hand-computed vectors, orderings, the fit, and its error against Splitwise's measurements."""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import pytest

from shared.domain.hardware import Sku
from shared.domain.latency import (
    AMPERE_CALIBRATION,
    BLOOM_176B,
    DEFAULT_CALIBRATIONS,
    HOPPER_CALIBRATION,
    LLAMA2_70B,
    SPLITWISE_HARDWARE,
    SPLITWISE_MODELS,
    Calibration,
    ModelShape,
    PerfRow,
    calibration_error,
    calibration_for,
    decode_step_ms,
    estimate,
    fit_calibration,
    inconsistent_configs,
    prefill_ms,
    read_splitwise_perf_csv,
    transformer_kv_bytes_per_token,
)
from shared.infra.catalog import load_skus
from tests.fixtures.perf.generate import NOISE
from tests.fixtures.perf.generate import render as render_fixture

SHARED_DATA = Path(__file__).resolve().parents[3].parent / "shared" / "data"
SPLITWISE_CSV = SHARED_DATA / "perf" / "splitwise_perf_model.csv"
# The project's own rows in the same format (synthetic; see tests/fixtures/perf/generate.py).
FIXTURE_CSV = Path(__file__).resolve().parents[2] / "fixtures" / "perf" / "splitwise_synthetic.csv"
SKUS = load_skus()


def sku(name: str = "toy", *, tflops: float = 100, bandwidth: float = 1e12, family: str = "toy") -> Sku:
    return Sku(
        name=name,
        vendor="nvidia",
        family=family,
        hbm_bytes=80 * 1024**3,
        memory_bandwidth_bytes_per_s=bandwidth,
        tdp_w=700,
        pcie_gen=5,
        pcie_lanes=16,
        nvlink_links=18,
        bf16_tflops=tflops,
        price_usd_per_hour=1.0,
        source="test",
    )


TOY_MODEL = ModelShape(name="toy-1b", params=1e9, active_params=1e9, kv_bytes_per_token=1e5)
TOY = Calibration(
    mfu=0.5,
    tp_serial_fraction=0.2,
    prefill_overhead_ms=10.0,
    mbu=0.8,
    decode_mfu=0.25,
    step_overhead_ms=3.0,
    tp_comm_ms_per_doubling=2.0,
)


# --- hand-computed vectors ------------------------------------------------------------------------


def test_prefill_by_hand() -> None:
    # F = 2 x 1e9 params x (2 x 1000 tokens) = 4e12 flops; at 1e14 flop/s: 40 ms; / mfu 0.5: 80 ms
    # TP 4 with serial share 0.2: x (0.2 + 0.8 / 4) = x 0.4 -> 32 ms; + 10 ms overhead = 42 ms
    assert prefill_ms(TOY_MODEL, sku(), 4, 1000, 2, calibration=TOY) == pytest.approx(42.0)


def test_decode_step_by_hand() -> None:
    # bytes: weights 2e9 + KV 8 x 500 x 1e5 = 4e8 -> 2.4e9; / TP 4 = 6e8; / (1e12 x 0.8) = 0.75 ms
    # matmuls: 2 x 1e9 x 8 = 1.6e10 flops; / TP 4 = 4e9; / (1e14 x 0.25) = 0.16 ms
    # + 3 ms step overhead + 2 ms x log2(4) = 4 ms  ->  0.75 + 0.16 + 3 + 4 = 7.91 ms
    assert decode_step_ms(TOY_MODEL, sku(), 4, 8, 500, calibration=TOY) == pytest.approx(7.91)


def test_estimate_by_hand() -> None:
    # ttft = the prefill above = 42 ms. tpot at the mean context 1000 + 101 / 2 = 1050.5, batch 2:
    # bytes 2e9 + 2 x 1050.5 x 1e5 = 2.2101e9; / 4 / 8e11 = 0.69065625 ms; matmuls 4e9 / 4 / 2.5e13 = 0.04 ms
    # + 3 + 4 -> tpot 7.73065625 ms; e2e = 42 + 100 x 7.73065625 = 815.065625 ms
    got = estimate(TOY_MODEL, sku(), 4, 1000, 101, 2, calibration=TOY)
    assert (got.ttft_ms, got.tpot_ms, got.e2e_ms) == pytest.approx((42.0, 7.73065625, 815.065625))
    one = estimate(TOY_MODEL, sku(), 4, 1000, 1, 2, calibration=TOY)
    assert one.e2e_ms == one.ttft_ms  # the first token is the prefill's


def test_kv_bytes_and_moe_weight_reads() -> None:
    # llama2-70b: 2 x 80 layers x 8 kv heads x 128 x 2 bytes = 327,680 bytes per token
    assert LLAMA2_70B.kv_bytes_per_token == transformer_kv_bytes_per_token(layers=80, kv_heads=8, head_dim=128)
    assert LLAMA2_70B.kv_bytes_per_token == 327_680
    moe = ModelShape(name="moe", params=8e9, active_params=1e9, kv_bytes_per_token=0.0)
    # each sequence reads its own active experts (2 bytes each) until all 8e9 params are read
    assert [moe.weight_bytes_read(b) for b in (1, 4, 16)] == [2e9, 8e9, 16e9]
    assert LLAMA2_70B.weight_bytes_read(64) == LLAMA2_70B.params * 2


@pytest.mark.parametrize(
    "call",
    [
        lambda: prefill_ms(TOY_MODEL, sku(), 0, 10, calibration=TOY),
        lambda: prefill_ms(TOY_MODEL, sku(), 1, -1, calibration=TOY),
        lambda: decode_step_ms(TOY_MODEL, sku(), 1, 0, 10, calibration=TOY),
        lambda: estimate(TOY_MODEL, sku(), 1, 10, 0, calibration=TOY),
        lambda: prefill_ms(TOY_MODEL, sku(tflops=0), 1, 10, calibration=TOY),
        lambda: ModelShape(name="x", params=1e9, active_params=2e9, kv_bytes_per_token=1),
        lambda: replace(TOY, mbu=1.2),
        lambda: replace(TOY, tp_serial_fraction=1.0),
        lambda: calibration_for(sku(family="unknown")),
    ],
)
def test_bad_inputs_are_refused(call: object) -> None:
    with pytest.raises(ValueError):
        call()  # type: ignore[operator]


# --- orderings ------------------------------------------------------------------------------------


def test_every_catalog_sku_has_a_calibration() -> None:
    for s in SKUS.values():
        assert calibration_for(s) is DEFAULT_CALIBRATIONS[s.family]
    assert calibration_for(SKUS["H200-SXM-141GB"]) is HOPPER_CALIBRATION
    assert calibration_for(SKUS["A100-SXM-40GB"]) is AMPERE_CALIBRATION


@pytest.mark.parametrize(("tp", "batch"), itertools.product((2, 4, 8), (1, 8, 32)))
def test_h100_decodes_and_prefills_faster_than_a100(tp: int, batch: int) -> None:
    h100, a100 = SKUS["H100-SXM-80GB"], SKUS["A100-SXM-80GB"]
    assert decode_step_ms(LLAMA2_70B, h100, tp, batch, 1024) < decode_step_ms(LLAMA2_70B, a100, tp, batch, 1024)
    assert prefill_ms(LLAMA2_70B, h100, tp, 2048, batch) < prefill_ms(LLAMA2_70B, a100, tp, 2048, batch)


def test_more_bandwidth_decodes_faster_within_a_family() -> None:
    steps = {name: decode_step_ms(LLAMA2_70B, SKUS[name], 4, 8, 2048) for name in SKUS}
    assert steps["H200-SXM-141GB"] < steps["H100-SXM-80GB"] < steps["H100-PCIE-80GB"]
    assert steps["A100-SXM-80GB"] < steps["A100-SXM-40GB"]
    assert steps["A100-SXM-80GB"] < steps["L40S-48GB"]


@pytest.mark.parametrize("sku_name", sorted(SKUS))
def test_higher_tp_lowers_decode_step_and_ttft_for_a_big_model(sku_name: str) -> None:
    s = SKUS[sku_name]
    steps = [decode_step_ms(BLOOM_176B, s, tp, 4, 2048) for tp in (1, 2, 4, 8)]
    ttfts = [prefill_ms(BLOOM_176B, s, tp, 2048) for tp in (1, 2, 4, 8)]
    assert steps == sorted(steps, reverse=True) and len(set(steps)) == 4, steps
    assert ttfts == sorted(ttfts, reverse=True) and len(set(ttfts)) == 4, ttfts


@pytest.mark.parametrize("sku_name", sorted(SKUS))
def test_longer_prompts_raise_ttft(sku_name: str) -> None:
    ttfts = [estimate(LLAMA2_70B, SKUS[sku_name], 4, prompt, 128).ttft_ms for prompt in (1, 128, 1024, 8192, 32768)]
    assert ttfts == sorted(ttfts) and len(set(ttfts)) == len(ttfts), ttfts


def test_larger_batches_and_longer_contexts_slow_each_step() -> None:
    h100 = SKUS["H100-SXM-80GB"]
    by_batch = [decode_step_ms(LLAMA2_70B, h100, 4, b, 1024) for b in (1, 8, 64)]
    by_context = [decode_step_ms(LLAMA2_70B, h100, 4, 8, c) for c in (128, 4096, 32768)]
    assert by_batch == sorted(by_batch) and by_context == sorted(by_context)


# --- the fit, on rows made by a known calibration ---------------------------------------------------


def synthetic_rows(truth: Calibration, s: Sku) -> list[PerfRow]:
    rows = []
    for tp, prompt, batch in itertools.product((1, 2, 4, 8), (128, 512, 2048, 8192), (1, 4, 16)):
        rows.append(
            PerfRow(
                model=TOY_MODEL.name,
                hardware=s.name,
                tp=tp,
                prompt_tokens=prompt,
                batch=batch,
                output_tokens=128,
                prompt_time_ms=prefill_ms(TOY_MODEL, s, tp, prompt, batch, calibration=truth),
                token_time_ms=decode_step_ms(TOY_MODEL, s, tp, batch, prompt + 64, calibration=truth),
            )
        )
    return rows


def test_fit_recovers_the_calibration_that_made_the_rows() -> None:
    s = sku()
    fit = fit_calibration(synthetic_rows(TOY, s), sku=s, models={TOY_MODEL.name: TOY_MODEL})
    got = fit.calibration
    for name in ("mfu", "tp_serial_fraction", "prefill_overhead_ms", "mbu", "decode_mfu", "step_overhead_ms"):
        assert getattr(got, name) == pytest.approx(getattr(TOY, name), rel=1e-6), name
    assert got.tp_comm_ms_per_doubling == pytest.approx(TOY.tp_comm_ms_per_doubling, rel=1e-6)
    assert fit.error.prefill_max < 1e-9 and fit.error.decode_max < 1e-9 and fit.excluded == ()


def test_fit_pins_an_impossible_bandwidth_share_at_one() -> None:
    # rows made at mbu 0.8 of 1e12 B/s, fitted against a datasheet of 0.64e12 B/s: the data say mbu 1.25,
    # more than the part can move, so the fit pins mbu at 1 and lets the other terms take the rest
    rows = synthetic_rows(TOY, sku())
    fit = fit_calibration(rows, sku=sku(bandwidth=0.64e12), models={TOY_MODEL.name: TOY_MODEL})
    assert fit.calibration.mbu == 1.0
    assert fit.calibration.step_overhead_ms >= 0 and fit.calibration.tp_comm_ms_per_doubling >= 0


def test_a_prefill_faster_than_half_the_work_is_excluded() -> None:
    s = sku()
    rows = synthetic_rows(TOY, s)
    planted = replace(rows[-1], batch=32, prompt_time_ms=rows[-1].prompt_time_ms / 8)  # 2x the work in 1/8 time
    assert inconsistent_configs([*rows, planted]) == {planted.config}
    fit = fit_calibration([*rows, planted], sku=s, models={TOY_MODEL.name: TOY_MODEL})
    assert fit.excluded == (planted.config,) and fit.calibration.mfu == pytest.approx(TOY.mfu)


def test_fit_wants_one_hardware_and_known_models() -> None:
    s = sku()
    rows = synthetic_rows(TOY, s)
    with pytest.raises(ValueError, match="one hardware"):
        fit_calibration([*rows, replace(rows[0], hardware="other")], sku=s, models={TOY_MODEL.name: TOY_MODEL})
    with pytest.raises(ValueError, match="no ModelShape"):
        fit_calibration(rows, sku=s, models={})


def test_read_splitwise_perf_csv() -> None:
    text = (
        "model,hardware,prompt_size,batch_size,token_size,peak_power,average_power,prompt_time,token_time,"
        "e2e_time,tensor_parallel\n"
        "llama2-70b,a100-80gb,512,1,128,1.0,0.7,196.25,54.88,7168.98,2\n"
    )
    (row,) = read_splitwise_perf_csv(text)
    assert row == PerfRow("llama2-70b", "a100-80gb", 2, 512, 1, 128, 196.25, 54.88)
    with pytest.raises(ValueError, match="line 3"):
        read_splitwise_perf_csv(text + "llama2-70b,a100-80gb,512,one,128,1.0,0.7,1,1,1,2\n")
    with pytest.raises(ValueError, match="lacks column"):
        read_splitwise_perf_csv("model,hardware\n")


# --- the calibration, on the project's own fixture (runs on a clean clone) ------------------------------


@pytest.fixture(scope="module")
def fixture_rows() -> list[PerfRow]:
    return read_splitwise_perf_csv(FIXTURE_CSV.read_text())


def test_the_fixture_is_what_its_generator_writes() -> None:
    # Changing the SKU catalog, the model or the shipped constants changes the rows:
    # regenerate with `python -m tests.fixtures.perf.generate`.
    assert FIXTURE_CSV.read_text() == render_fixture()


@pytest.mark.parametrize(
    ("hardware", "shipped"), [("a100-80gb", AMPERE_CALIBRATION), ("h100-80gb", HOPPER_CALIBRATION)]
)
def test_fit_on_the_fixture_sees_through_its_noise_and_drops_the_planted_row(
    fixture_rows: list[PerfRow], hardware: str, shipped: Calibration
) -> None:
    s = SKUS[SPLITWISE_HARDWARE[hardware]]
    rows = [r for r in fixture_rows if r.hardware == hardware]
    assert len(rows) == 23
    fit = fit_calibration(rows, sku=s, models=SPLITWISE_MODELS)
    print(f"\n{hardware} (fixture): {fit.calibration}\n  {fit.error}")
    # the planted TP2 batch-64 configuration, and only it, is inconsistent
    assert fit.excluded == (("llama2-70b", hardware, 2, 512, 64, 128),)
    used = [r for r in rows if r.config not in fit.excluded]
    # every time is the shipped model's x (1 +/- 6%): |model - measured| / measured <= 0.06 / 0.94
    bound = NOISE / (1 - NOISE)
    error = calibration_error(used, sku=s, models=SPLITWISE_MODELS, calibration=calibration_for(s))
    assert error.rows == 22 and error.prefill_max <= bound and error.decode_max <= bound
    # the fit explains the rows at least about as well as the calibration that made them
    assert fit.error.prefill_median < 0.04 and fit.error.decode_median < 0.04
    assert fit.error.prefill_max <= bound and fit.error.decode_max < 0.07
    # and predicts what the shipped constants predict, within the noise
    for r in used:
        model = SPLITWISE_MODELS[r.model]
        for fn, args in ((prefill_ms, (r.prompt_tokens, r.batch)), (decode_step_ms, (r.batch, r.prompt_tokens + 64))):
            got = fn(model, s, r.tp, *args, calibration=fit.calibration)
            want = fn(model, s, r.tp, *args, calibration=shipped)
            assert got == pytest.approx(want, rel=NOISE), (r.config, fn.__name__)
    # the prefill terms are well determined by these rows: within 10% of the shipped constants
    for name in ("mfu", "tp_serial_fraction", "prefill_overhead_ms"):
        assert getattr(fit.calibration, name) == pytest.approx(getattr(shipped, name), rel=0.1), name


# --- against the measured Splitwise figures ---------------------------------------------------------


@pytest.fixture(scope="module")
def splitwise_rows() -> list[PerfRow]:
    if not SPLITWISE_CSV.exists():
        pytest.skip(f"reference data not present at {SPLITWISE_CSV} (only on the development machine)")
    return read_splitwise_perf_csv(SPLITWISE_CSV.read_text())


@pytest.mark.parametrize("hardware", ["a100-80gb", "h100-80gb"])
def test_error_against_measured_llama2_70b(splitwise_rows: list[PerfRow], hardware: str) -> None:
    s = SKUS[SPLITWISE_HARDWARE[hardware]]
    rows = [r for r in splitwise_rows if r.hardware == hardware]
    excluded = inconsistent_configs(rows)
    llama = [r for r in rows if r.model == "llama2-70b" and r.config not in excluded]
    error = calibration_error(llama, sku=s, models=SPLITWISE_MODELS, calibration=calibration_for(s))
    print(
        f"\nllama2-70b on {hardware} ({s.name}), {error.rows} rows, {len(excluded)} config(s) excluded:"
        f" prompt_time median {error.prefill_median:.1%} worst {error.prefill_max:.1%};"
        f" token_time median {error.decode_median:.1%} worst {error.decode_max:.1%}"
    )
    for tp in (2, 4, 8):
        e = estimate(LLAMA2_70B, s, tp, 512, 128)
        measured = [r for r in llama if (r.tp, r.prompt_tokens, r.batch, r.output_tokens) == (tp, 512, 1, 128)]
        print(
            f"  TP{tp} 512 in / 128 out: model ttft {e.ttft_ms:.0f} ms tpot {e.tpot_ms:.1f} ms;"
            f" measured {sorted(r.prompt_time_ms for r in measured)[len(measured) // 2]:.0f} ms"
            f" / {sorted(r.token_time_ms for r in measured)[len(measured) // 2]:.1f} ms"
        )
    assert error.rows >= 300
    assert error.prefill_median < 0.35 and error.decode_median < 0.35


@pytest.mark.parametrize(
    ("hardware", "shipped"), [("a100-80gb", AMPERE_CALIBRATION), ("h100-80gb", HOPPER_CALIBRATION)]
)
def test_shipped_constants_are_what_the_fit_gives(
    splitwise_rows: list[PerfRow], hardware: str, shipped: Calibration
) -> None:
    s = SKUS[SPLITWISE_HARDWARE[hardware]]
    fit = fit_calibration([r for r in splitwise_rows if r.hardware == hardware], sku=s, models=SPLITWISE_MODELS)
    print(f"\n{hardware}: {fit.calibration}\n  {fit.error}\n  excluded {fit.excluded}")
    # the TP2 batch-64 rows, and only they, are inconsistent (see the latency module docstring)
    assert fit.excluded == (("llama2-70b", hardware, 2, 512, 64, 128),)
    for name in Calibration.__slots__:
        if name != "source":
            assert getattr(fit.calibration, name) == pytest.approx(getattr(shipped, name), rel=5e-3), name
