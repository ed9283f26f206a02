"""The framework: profiles and the registry, typed plugin config, score range checks, rejection classes."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import pytest

from shared.domain.placement import DEFAULT_PROFILE, DEFAULT_REGISTRY, decide
from shared.domain.placement.framework import (
    Candidate,
    Code,
    CycleState,
    Profile,
    RejectionTally,
    ScoreRangeError,
    StateKey,
    Status,
)
from shared.domain.placement.hosts import HostKind, index_of
from shared.domain.placement.registry import framework_for
from tests.unit.placement.builders import node, request, snapshot


def profile(**changes: object) -> Profile:
    return dataclasses.replace(DEFAULT_PROFILE, **changes)  # type: ignore[arg-type]


def test_every_registered_plugin_has_a_name_and_the_default_profile_builds() -> None:
    framework = framework_for(DEFAULT_PROFILE)
    names = [framework.prefilter.name, *(f.name for f in framework.host_filters)]
    names += [f.name for f in framework.placement_filters] + [s.name for s, _ in framework.scores]
    assert set(names) <= set(DEFAULT_REGISTRY)
    assert [f.name for f in framework.placement_filters] == [
        "hbm",
        "nvlink_group",
        "slo",
        "tpu_slice",
        "rack_power",
        "pcie_load",
    ]
    assert framework_for(DEFAULT_PROFILE) is framework  # built once per profile


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"filters": ("hbm", "no_such_filter")}, "no plugin 'no_such_filter'"),
        ({"filters": ("cost",)}, "cost is not a filter plugin"),
        ({"scores": (("hbm", 1.0),)}, "hbm is not a score plugin"),
        ({"prefilter": "hbm"}, "hbm is not a prefilter plugin"),
        ({"config": (("pcie_budget", {"min_gen": "4"}),)}, "min_gen expects int"),
        ({"config": (("pcie_budget", {"max_gen": 4}),)}, "unknown config max_gen"),
        ({"config": (("hbm", {"slack": 1}),)}, "takes no config"),
    ],
)
def test_bad_profiles_fail_when_built(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        framework_for(profile(name="bad", **changes))


@pytest.mark.parametrize("weight", [-1.0, float("nan"), float("inf")])
def test_score_weights_are_finite_and_non_negative(weight: float) -> None:
    with pytest.raises(ValueError, match="weight"):
        profile(scores=(("cost", weight),))


def test_plugin_config_changes_behaviour() -> None:
    snap = snapshot(node("dgx1").sku("V100-SXM2-32GB").cube_mesh())
    req = request("mistral-7b-v0.1", context_tokens=2048, concurrency=1)
    assert decide(snap, req).score["pcie_budget"] < 1.0
    lenient = profile(name="gen3-ok", config=(("pcie_budget", {"min_gen": 3}),))
    assert decide(snap, req, lenient).score["pcie_budget"] == 1.0


def test_a_profile_without_a_filter_places_what_the_default_refuses() -> None:
    snap = snapshot(node("a").nvswitch(8), power_kw=1.0)  # one 700 W GPU may turn busy
    req = request("mistral-7b-v0.1", context_tokens=2048, concurrency=1, tp=2)
    assert decide(snap, req).rejections[0].reason == "rack_power_short"
    no_power = profile(name="no-power", filters=tuple(f for f in DEFAULT_PROFILE.filters if f != "rack_power"))
    assert decide(snap, req, no_power).placed


class _Broken:
    name = "broken"

    def prescore(self, state: CycleState, candidates: Sequence[Candidate]) -> None:
        return None

    def score(self, state: CycleState, candidate: Candidate) -> float:
        return 1.5


def _broken_factory(config: Mapping[str, object] | None = None) -> _Broken:
    return _Broken()


def test_the_runner_checks_every_score_is_in_range() -> None:
    registry = {**DEFAULT_REGISTRY, "broken": _broken_factory}
    bad = profile(name="broken", scores=(("broken", 1.0),))
    with pytest.raises(ScoreRangeError, match=r"broken returned 1\.5"):
        decide(snapshot(node("a").nvswitch(8)), request(), bad, registry=registry)


def test_weights_pick_the_winner() -> None:
    # An H100 node and an L40S node both hold llama3-8b at TP=1: cost alone picks the cheaper
    # per token, link alone ties (TP=1 scores 1) and goes to the lowest id.
    snap = snapshot(node("z-h100").nvswitch(1), node("a-l40s").sku("L40S-48GB").pcie(1))
    req = request("llama3-8b", input_tokens=1024, output_tokens=1024)
    by_link = decide(snap, req, profile(name="link", scores=(("link", 1.0),)))
    assert by_link.node == "a-l40s" and by_link.score == {"link": 1.0, "total": 1.0}
    by_cost = decide(snap, req, profile(name="cost", scores=(("cost", 1.0),)))
    assert by_cost.score["cost"] == 1.0


def test_rejection_classes_group_by_code_rounded_figure_and_tp() -> None:
    tally = RejectionTally()
    tally.add(Status(Code.HBM_SHORT, tp=4, hbm_short_bytes=3_210_000_000), 30, HostKind.NODE)
    tally.add(Status(Code.HBM_SHORT, tp=4, hbm_short_bytes=3_240_000_000), 1, HostKind.NODE)  # also 3.2 GB
    tally.add(Status(Code.HBM_SHORT, tp=4, hbm_short_bytes=3_260_000_000), 2, HostKind.NODE)  # 3.3 GB
    tally.add(Status(Code.HBM_SHORT, tp=8, hbm_short_bytes=3_210_000_000), 5, HostKind.NODE)
    tally.add(Status(Code.SKU_NOT_ALLOWED, message="SKU X not in the allow-list"), 1, HostKind.TPU_POD)
    assert [c.describe() for c in tally.classes()] == [
        "31 nodes: HBM short by 3.2 GB per GPU at TP=4",
        "5 nodes: HBM short by 3.2 GB per GPU at TP=8",
        "2 nodes: HBM short by 3.3 GB per GPU at TP=4",
        "1 TPU pod: SKU X not in the allow-list",
    ]


def test_cycle_state_is_typed_and_says_what_is_missing() -> None:
    state = CycleState()
    key: StateKey[int] = StateKey("counter")
    assert state.get(key) is None
    state.write(key, 3)
    assert state.read(key) == 3
    with pytest.raises(KeyError, match="no 'absent'"):
        state.read(StateKey[str]("absent"))


def test_hosts_are_judged_per_class() -> None:
    # 10 identical idle nodes are one class; one busy node makes a second.
    builders = [node(f"n{i:02d}").nvswitch(8) for i in range(10)]
    builders[3].reserve(0, 10**9)
    index = index_of(snapshot(*builders))
    (static,) = index.statics
    assert [len(c.hosts) for c in index.classes[static.key]] == [9, 1]
    assert index.classes[static.key][1].hosts == ("n03",)


def test_evolve_updates_the_index_for_what_changed() -> None:
    builders = [node(f"n{i}").nvswitch(8) for i in range(3)]
    snap = snapshot(*builders, power_kw=20)
    index_of(snap)
    busy = dataclasses.replace(snap.capacity["n1/gpu2"], reserved=30 * 10**9)
    evolved = snap.evolve(
        capacity={**snap.capacity, "n1/gpu2": busy}, rack_power_used_w={("us-west-1", "c1", "r1"): 700.0}
    )
    assert evolved._memo.parent is snap
    assert evolved._memo.touched[0] == {"n1/gpu2"}
    incremental = index_of(evolved)
    rebuilt = index_of(dataclasses.replace(evolved))  # a new snapshot without a memo: built from scratch
    assert incremental.loads == rebuilt.loads and incremental.classes == rebuilt.classes
    (static,) = rebuilt.classes
    assert [c.hosts for c in rebuilt.classes[static]] == [("n0", "n2"), ("n1",)]
