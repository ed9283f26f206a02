"""The rebalancer's sustained-threshold detectors (issue 16), on a fake clock (datetimes built here).

For every default rule: it fires only after its window, never on a spike shorter than the window;
hysteresis keeps a value flapping around the threshold from clearing or firing again; it clears only
after the clear window past the clear level. Then: a window of 0, stale targets, out-of-order and NaN
samples, ``forget``, the aggregate views, and a property over random sample sequences.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.domain.rebalance.detect import (
    COLD,
    DRIFT,
    FRAGMENTATION,
    HOT,
    PCIE,
    Phase,
    Rule,
    SustainedDetector,
    TargetState,
    Transition,
)

T0 = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)
STEP_S = 10  # the brief's drift check runs every 10 s; the other signals are sampled at least as often


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def phase(detector: SustainedDetector) -> Phase:
    # A call, not the property: mypy would narrow a property's Literal across the asserts of a test.
    return detector.state


def feed(detector: SustainedDetector, samples: list[tuple[float, float]], key: str = "gpu0") -> list[Transition]:
    """Observe ``(seconds, value)`` samples of one key in order; the transitions they caused."""
    out: list[Transition] = []
    for seconds, value in samples:
        transition = detector.observe(key, value, at(seconds))
        if transition is not None:
            out.append(transition)
    return out


def every(start: float, stop: float, value: float, step: float = STEP_S) -> list[tuple[float, float]]:
    """``value`` sampled every ``step`` seconds from ``start`` up to and excluding ``stop``."""
    n = math.ceil((stop - start) / step)
    return [(start + i * step, value) for i in range(n)]


@dataclass(frozen=True)
class Case:
    """A default rule with values on each side of its levels. ``hit``: well past the threshold;
    ``near``: just past it; ``band``: between the threshold and the clear level (not the condition,
    not clear); ``clear``: past the clear level."""

    rule: Rule
    hit: float
    near: float
    band: float
    clear: float


CASES = [
    # hot: fires > 0.85, clear level 0.85 - 0.05 = 0.80
    Case(HOT, hit=0.95, near=0.86, band=0.84, clear=0.70),
    # cold: fires < 0.30, clear level 0.30 + 0.05 = 0.35
    Case(COLD, hit=0.10, near=0.29, band=0.31, clear=0.50),
    # fragmentation: fires > 0.3, clear level 0.3 - 0.05 = 0.25
    Case(FRAGMENTATION, hit=0.45, near=0.31, band=0.29, clear=0.10),
    # PCIe: fires > 0.7, clear level 0.7 - 0.05 = 0.65
    Case(PCIE, hit=0.90, near=0.71, band=0.69, clear=0.40),
    # drift: fires > 0.10, clear level 0.10 - 0.02 = 0.08
    Case(DRIFT, hit=0.25, near=0.11, band=0.09, clear=0.02),
]
ids = [c.rule.name for c in CASES]


def fired_detector(case: Case) -> tuple[SustainedDetector, float]:
    """A detector whose target ``gpu0`` fired on ``case.hit``; the time it fired (its window)."""
    detector = SustainedDetector(case.rule)
    window = case.rule.window_s
    transitions = feed(detector, [*every(0, window, case.hit), (window, case.hit)])
    assert [t.fired for t in transitions] == [True]
    return detector, window


def test_the_defaults_are_the_briefs() -> None:
    assert (HOT.threshold, HOT.window_s, HOT.above) == (0.85, 60, True)
    assert (COLD.threshold, COLD.window_s, COLD.above) == (0.30, 300, False)
    assert (FRAGMENTATION.threshold, FRAGMENTATION.above) == (0.3, True)
    assert (PCIE.threshold, PCIE.window_s, PCIE.above) == (0.7, 60, True)
    assert (DRIFT.threshold, DRIFT.hysteresis, DRIFT.above) == (0.10, 0.02, True)
    assert len({c.rule.name for c in CASES}) == 5


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_the_values_of_each_case_sit_where_their_names_say(case: Case) -> None:
    """Guards the table: a mistyped value would make the tests below test something else."""
    rule = case.rule
    sign = 1 if rule.above else -1  # an above-rule's values are past a level when larger
    level = rule.threshold - sign * rule.hysteresis
    assert sign * case.hit > sign * case.near > sign * rule.threshold
    assert sign * rule.threshold >= sign * case.band > sign * level
    assert sign * level >= sign * case.clear


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_fires_only_once_the_window_has_passed(case: Case) -> None:
    detector = SustainedDetector(case.rule)
    window = case.rule.window_s
    # Every 10 s from 0, then 1 s short of the window: pending all along, since the first sample.
    assert feed(detector, [*every(0, window, case.hit), (window - 1, case.hit)]) == []
    assert phase(detector) == "pending"
    assert detector.targets() == [
        TargetState(key="gpu0", phase="pending", since=T0, value=case.hit, seen_at=at(window - 1))
    ]
    fired = detector.observe("gpu0", case.near, at(window))
    assert fired == Transition(rule=case.rule.name, key="gpu0", fired=True, at=at(window), value=case.near)
    assert phase(detector) == "firing" and detector.firing() == ["gpu0"]
    assert detector.targets()[0].since == at(window)


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_a_spike_shorter_than_the_window_never_fires(case: Case) -> None:
    """Ten spikes of window - 1 s, each followed by one sample back under the threshold."""
    detector = SustainedDetector(case.rule)
    window = case.rule.window_s
    samples: list[tuple[float, float]] = []
    start = 0.0
    for _ in range(10):
        samples += [*every(start, start + window, case.hit), (start + window - 1, case.hit)]
        samples.append((start + window, case.band))  # the dip resets the pending timer
        start += window + 1
    assert feed(detector, samples) == []
    assert phase(detector) == "ok" and detector.targets() == []
    # The condition from the last dip on, held for the full window, does fire.
    assert [t.fired for t in feed(detector, [(start, case.hit), (start + window, case.hit)])] == [True]


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_hysteresis_keeps_a_flapping_value_firing_without_refiring(case: Case) -> None:
    """After firing, the value alternates just past the threshold and just short of it (0.86/0.84
    for hot) for ten windows: exactly one transition in all, the first firing."""
    detector, fired_at = fired_detector(case)
    window = case.rule.window_s
    flapping = [
        (fired_at + STEP_S * (i + 1), case.near if i % 2 else case.band) for i in range(int(10 * window / STEP_S))
    ]
    assert feed(detector, flapping) == []
    assert phase(detector) == "firing" and detector.firing() == ["gpu0"]
    assert detector.targets()[0].since == at(fired_at)


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_clears_after_the_clear_window_past_the_clear_level(case: Case) -> None:
    detector, fired_at = fired_detector(case)
    clear_window = case.rule.window_s  # clear_window_s is None: the same window
    start = fired_at + STEP_S
    assert (
        feed(detector, [*every(start, start + clear_window, case.clear), (start + clear_window - 1, case.clear)]) == []
    )
    assert phase(detector) == "firing"
    cleared = detector.observe("gpu0", case.clear, at(start + clear_window))
    assert cleared == Transition(
        rule=case.rule.name, key="gpu0", fired=False, at=at(start + clear_window), value=case.clear
    )
    assert phase(detector) == "ok" and detector.targets() == [] and detector.firing() == []


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_a_sample_short_of_the_clear_level_restarts_the_clear_timer(case: Case) -> None:
    detector, fired_at = fired_detector(case)
    window = case.rule.window_s
    start = fired_at + STEP_S
    # Clear for window - 1 s, one sample in the band, then clear again: the timer restarts at `again`.
    samples = [*every(start, start + window, case.clear), (start + window - 1, case.clear), (start + window, case.band)]
    again = start + window + 1
    samples += [*every(again, again + window, case.clear), (again + window - 1, case.clear)]
    assert feed(detector, samples) == []
    assert phase(detector) == "firing"
    assert [t.fired for t in feed(detector, [(again + window, case.clear)])] == [False]


@pytest.mark.parametrize(
    ("rule", "at_level", "short_of_it"),
    [
        (HOT, 0.80, 0.8000001),  # 0.85 - 0.05 clears at 0.80 exactly, not at 0.7999999999999999
        (COLD, 0.35, 0.3499999),  # 0.30 + 0.05
        (DRIFT, 0.08, 0.0800001),  # 0.10 - 0.02
    ],
    ids=["hot", "cold", "drift"],
)
def test_the_clear_level_is_inclusive_and_exact(rule: Rule, at_level: float, short_of_it: float) -> None:
    quick = Rule(rule.name, rule.threshold, 0, above=rule.above, hysteresis=rule.hysteresis)
    detector = SustainedDetector(quick)
    hit = rule.threshold + (0.1 if rule.above else -0.1)
    assert detector.observe("gpu0", hit, at(0)) is not None
    assert detector.observe("gpu0", short_of_it, at(1)) is None
    cleared = detector.observe("gpu0", at_level, at(2))
    assert cleared is not None and not cleared.fired


def test_a_below_rule_ignores_high_values_and_mirrors_the_above_rule() -> None:
    detector = SustainedDetector(COLD)
    # Idle-high HBM use never goes pending for cold.
    assert feed(detector, every(0, 1000, 0.95)) == []
    assert phase(detector) == "ok"
    # Low for 5 minutes fires; back to 0.32 (above the threshold, below the 0.35 clear level) holds.
    assert [t.fired for t in feed(detector, [(1000, 0.20), (1300, 0.20)])] == [True]
    assert feed(detector, every(1310, 2000, 0.32)) == []
    assert detector.firing() == ["gpu0"]
    assert [t.fired for t in feed(detector, [(2000, 0.35), (2300, 0.40)])] == [False]


def test_window_zero_fires_on_the_first_sample_and_clears_on_the_first_clear_one() -> None:
    detector = SustainedDetector(Rule("instant", 0.5, 0))
    assert detector.observe("n1", 0.5, at(0)) is None  # not above 0.5
    fired = detector.observe("n1", 0.51, at(1))
    assert fired is not None and fired.fired and fired.at == at(1)
    assert detector.observe("n1", 0.46, at(2)) is None  # above the 0.45 clear level
    cleared = detector.observe("n1", 0.45, at(3))
    assert cleared is not None and not cleared.fired and cleared.at == at(3)


def test_window_zero_with_a_clear_window() -> None:
    detector = SustainedDetector(Rule("instant", 0.5, 0, clear_window_s=30))
    assert [t.fired for t in feed(detector, [(0, 0.9), (10, 0.1), (20, 0.1)], key="n1")] == [True]
    assert [t.fired for t in feed(detector, [(40, 0.1)], key="n1")] == [False]  # 40 - 10 >= 30


def test_an_explicit_clear_window_differs_from_the_firing_window() -> None:
    detector = SustainedDetector(Rule("hot", 0.85, 60, clear_window_s=120))
    assert [t.fired for t in feed(detector, [(0, 0.9), (60, 0.9)])] == [True]
    assert feed(detector, [(70, 0.5), (189, 0.5)]) == []  # 119 s clear
    assert [t.fired for t in feed(detector, [(190, 0.5)])] == [False]  # 120 s clear


def test_sweep_forgets_silent_targets_and_clears_a_firing_one() -> None:
    detector = SustainedDetector(HOT)  # stale_s = 3 x max(60, 10) = 180 s
    feed(detector, [(0, 0.9), (60, 0.9)], key="fires")
    feed(detector, [(60, 0.9)], key="pending")
    feed(detector, [(60, 0.5)], key="ok")
    feed(detector, [(200, 0.9)], key="fresh")
    assert detector.sweep(at(239)) == []  # 179 s since the others' last sample: not yet stale
    assert [t.key for t in detector.targets()] == ["fires", "fresh", "pending"]
    swept = detector.sweep(at(240))
    assert swept == [Transition(rule="hbm_hot", key="fires", fired=False, at=at(240), value=0.9)]
    assert [t.key for t in detector.targets()] == ["fresh"]
    assert detector.firing() == [] and phase(detector) == "pending"
    # A forgotten target starts over: its next sample only starts a pending run.
    assert detector.observe("fires", 0.9, at(250)) is None
    assert detector.targets()[0] == TargetState("fires", "pending", at(250), 0.9, at(250))


def test_stale_s_can_be_set_and_defaults_to_at_least_30_s() -> None:
    custom = SustainedDetector(Rule("x", 0.5, 60, stale_s=61))
    feed(custom, [(0, 0.9)])
    assert custom.sweep(at(60)) == [] and phase(custom) == "pending"
    assert custom.sweep(at(61)) == [] and phase(custom) == "ok" and custom.targets() == []
    short = SustainedDetector(Rule("y", 0.5, 0))  # stale_s = 3 x max(0, 10) = 30 s
    feed(short, [(0, 0.9)])
    assert short.sweep(at(29)) == []
    assert [t.fired for t in short.sweep(at(30))] == [False]


def test_a_gap_of_stale_s_restarts_the_pending_timer() -> None:
    """A condition seen at 0 and again at 200 (stale_s 180) was not seen held in between."""
    detector = SustainedDetector(HOT)
    assert feed(detector, [(0, 0.9), (200, 0.9), (259, 0.9)]) == []
    assert detector.targets()[0].since == at(200)
    assert [t.at for t in feed(detector, [(260, 0.9)])] == [at(260)]


def test_a_gap_of_stale_s_restarts_the_clear_timer() -> None:
    detector, _ = fired_detector(CASES[0])  # hot, fired at 60
    assert feed(detector, [(70, 0.5), (250, 0.5)]) == []  # 180 s gap: the clear run restarts at 250
    assert [t.at for t in feed(detector, [(309, 0.5), (310, 0.5)])] == [at(310)]


def test_out_of_order_samples_are_ignored() -> None:
    detector = SustainedDetector(HOT)
    assert feed(detector, [(0, 0.9), (30, 0.9)]) == []
    # A late dip from before the last sample does not reset the pending run.
    assert detector.observe("gpu0", 0.1, at(20)) is None
    assert detector.targets()[0] == TargetState("gpu0", "pending", at(0), 0.9, at(30))
    # A sample at the same time as the last one is taken.
    assert detector.observe("gpu0", 0.95, at(30)) is None
    assert detector.targets()[0].value == 0.95
    assert [t.at for t in feed(detector, [(60, 0.9)])] == [at(60)]
    # Late clear samples do not clear a firing target either.
    assert feed(detector, [(61 + i, 0.1) for i in range(-60, -1)]) == []
    assert detector.firing() == ["gpu0"]


def test_nan_samples_are_ignored() -> None:
    detector = SustainedDetector(HOT)
    assert feed(detector, [(0, 0.9), (30, math.nan)]) == []
    assert detector.targets()[0] == TargetState("gpu0", "pending", at(0), 0.9, at(0))
    assert [t.at for t in feed(detector, [(60, 0.9)])] == [at(60)]
    assert feed(detector, every(70, 1000, math.nan)) == []
    assert detector.firing() == ["gpu0"]


def test_forget_clears_a_firing_target_at_its_last_sample() -> None:
    detector, fired_at = fired_detector(CASES[0])
    feed(detector, [(0, 0.9)], key="gpu1")
    assert detector.forget("gpu0") == Transition("hbm_hot", "gpu0", fired=False, at=at(fired_at), value=0.95)
    assert detector.forget("gpu0") is None  # already gone
    assert detector.forget("gpu1") is None  # pending: nothing was announced, nothing to retract
    assert detector.forget("never-seen") is None
    assert detector.targets() == [] and phase(detector) == "ok"


def test_targets_and_state_aggregate_over_keys() -> None:
    detector = SustainedDetector(PCIE)
    assert phase(detector) == "ok" and detector.targets() == [] and detector.firing() == []
    feed(detector, [(0, 0.9)], key="node-b")
    feed(detector, [(0, 0.1)], key="node-c")
    assert phase(detector) == "pending"
    feed(detector, [(0, 0.9), (60, 0.9)], key="node-a")
    assert phase(detector) == "firing"
    assert [(t.key, t.phase) for t in detector.targets()] == [("node-a", "firing"), ("node-b", "pending")]
    assert detector.firing() == ["node-a"]
    assert detector.rule is PCIE


def test_keys_are_independent() -> None:
    detector = SustainedDetector(HOT)
    feed(detector, [(0, 0.9)], key="a")
    feed(detector, [(30, 0.1)], key="b")  # b's dip does not reset a
    assert [t.key for t in feed(detector, [(60, 0.9)], key="a")] == ["a"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"name": "", "threshold": 0.5, "window_s": 1},
        {"name": "x", "threshold": math.nan, "window_s": 1},
        {"name": "x", "threshold": 0.5, "window_s": -1},
        {"name": "x", "threshold": 0.5, "window_s": math.inf},
        {"name": "x", "threshold": 0.5, "window_s": 1, "hysteresis": -0.01},
        {"name": "x", "threshold": 0.5, "window_s": 1, "clear_window_s": -1},
        {"name": "x", "threshold": 0.5, "window_s": 1, "stale_s": 0},
    ],
)
def test_a_rule_refuses_nonsense(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        Rule(**kwargs)  # type: ignore[arg-type]


def test_naive_datetimes_are_refused() -> None:
    detector = SustainedDetector(HOT)
    with pytest.raises(ValueError, match="aware"):
        detector.observe("gpu0", 0.9, datetime(2025, 6, 1, 12, 0))
    with pytest.raises(ValueError, match="aware"):
        detector.sweep(datetime(2025, 6, 1, 12, 0))


# --- property: random sample sequences -------------------------------------------------------------

THRESHOLD = 0.5


@st.composite
def rules(draw: st.DrawFn) -> Rule:
    return Rule(
        "prop",
        THRESHOLD,
        draw(st.sampled_from([0, 10, 30, 60])),
        above=draw(st.booleans()),
        hysteresis=draw(st.sampled_from([0.0, 0.05, 0.1])),
        clear_window_s=draw(st.sampled_from([None, 0, 20, 60])),
    )


# Values on and around the levels (threshold, threshold +/- each hysteresis), anywhere, and NaN.
values = st.one_of(
    st.sampled_from([0.4, 0.45, 0.5, 0.55, 0.6, math.nan]),
    st.floats(min_value=0.0, max_value=1.0),
)
# Runs of one value for one key, so that conditions are sustained long enough to fire and clear.
runs = st.lists(
    st.tuples(
        st.sampled_from(["a", "b"]),
        values,
        st.integers(min_value=1, max_value=8),  # samples in the run
        st.integers(min_value=0, max_value=25),  # seconds between them
        st.integers(min_value=0, max_value=40),  # how late the run's first sample arrives
    ),
    max_size=60,
)


def run_start(history: list[tuple[int, float]], hold: Callable[[float], bool]) -> int:
    """The time of the first sample of the run of samples that ends ``history`` and all ``hold``."""
    j = len(history) - 1
    while j > 0 and hold(history[j - 1][1]):
        j -= 1
    return history[j][0]


@settings(max_examples=300, deadline=None)
@given(rule=rules(), sequence=runs, late_odds=st.integers(min_value=0, max_value=5))
def test_transitions_alternate_and_respect_the_windows(
    rule: Rule, sequence: list[tuple[str, float, int, int, int]], late_odds: int
) -> None:
    detector = SustainedDetector(rule)
    clear_window = rule.window_s if rule.clear_window_s is None else rule.clear_window_s

    def holds(value: float) -> bool:
        return value > THRESHOLD if rule.above else value < THRESHOLD

    def clears(value: float) -> bool:  # past the clear level: threshold -/+ hysteresis
        level = round(THRESHOLD - rule.hysteresis if rule.above else THRESHOLD + rule.hysteresis, 9)
        return value <= level if rule.above else value >= level

    clock = 0
    accepted: dict[str, list[tuple[int, float]]] = {"a": [], "b": []}
    transitions: dict[str, list[Transition]] = {"a": [], "b": []}
    for i, (key, value, count, step_s, lateness_s) in enumerate(sequence):
        for n in range(count):
            clock += step_s
            late = n == 0 and late_odds and i % (late_odds + 1) == 0
            seconds = clock - lateness_s if late else clock
            transition = detector.observe(key, value, at(seconds))
            taken = not math.isnan(value) and (not accepted[key] or seconds >= accepted[key][-1][0])
            if not taken:
                assert transition is None  # ignored samples change nothing
                continue
            accepted[key].append((seconds, value))
            state = {t.key: t for t in detector.targets()}.get(key)
            if state is not None and state.phase == "pending":
                # Pending only on a condition sample, timed from (at the earliest) the run's start.
                assert holds(value) and state.since >= at(run_start(accepted[key], holds))
            if not holds(value):  # a sample without the condition ends a pending run
                assert state is None or state.phase == "firing"
            if transition is None:
                continue
            assert transition.at == at(seconds) and transition.value == value and transition.key == key
            # A fired transition ends a run of condition samples at least window_s long.
            if transition.fired:
                assert holds(value) and seconds - run_start(accepted[key], holds) >= rule.window_s
            else:  # and a cleared one a run of clear samples at least clear_window long
                assert clears(value) and seconds - run_start(accepted[key], clears) >= clear_window
            transitions[key].append(transition)

    for key, ts in transitions.items():
        # Fired, cleared, fired, ... per key.
        assert [t.fired for t in ts] == [i % 2 == 0 for i in range(len(ts))]
        for before, after in itertools.pairwise(ts):
            gap_s = (after.at - before.at).total_seconds()
            assert gap_s >= (clear_window if before.fired else rule.window_s)
            if rule.window_s and clear_window:
                assert gap_s >= min(rule.window_s, clear_window)
        # What the detector reports agrees with the transitions it announced.
        assert (key in detector.firing()) == bool(ts and ts[-1].fired)
