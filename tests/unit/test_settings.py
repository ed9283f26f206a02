"""Settings: typed sections read from the published environment variables, maps as JSON (or YAML) with the
deprecated ``a=1,b=2`` text still accepted, and errors that name the variable."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from shared.domain.admission import Engine
from shared.domain.quotas import Quota
from shared.domain.routing import Weights
from shared.infra.settings import KitSettings, PlacementSettings, Settings, env_vars, load_settings

OLD_FLAT_NAMES = 124  # the flat Settings before issue 24: every one of its variables is still read
ADDED_SINCE = {  # variables added after it
    "HETSCHED_AGENT_ENGINE": "agent.engine",
    "HETSCHED_AGENT_ENGINE_COMMAND": "agent.engine_command",
    "HETSCHED_AGENT_BIND_HOST": "agent.bind_host",
    "HETSCHED_AGENT_ADVERTISE_HOST": "agent.advertise_host",
    "HETSCHED_AGENT_PORT_MIN": "agent.port_min",
    "HETSCHED_AGENT_PORT_MAX": "agent.port_max",
    "HETSCHED_AGENT_STOP_GRACE_S": "agent.stop_grace_s",
    "HETSCHED_AGENT_MAX_CRASHES": "agent.max_crashes",
    "HETSCHED_AGENT_RESTART_BACKOFF_S": "agent.restart_backoff_s",
    "HETSCHED_AGENT_RESTART_BACKOFF_MAX_S": "agent.restart_backoff_max_s",
    "HETSCHED_AGENT_STATUS_S": "agent.status_s",
    "HETSCHED_AGENT_RECONCILE_S": "agent.reconcile_s",
    "HETSCHED_AGENT_SIM_SPEEDUP": "agent.sim_speedup",
    "HETSCHED_REBALANCE_DRAIN_TIMEOUT_S": "rebalancer.drain_timeout_s",
    "HETSCHED_REBALANCE_WAIT_FOR_READY": "rebalancer.wait_for_ready",
    "HETSCHED_REBALANCE_READY_TIMEOUT_S": "rebalancer.ready_timeout_s",
    "HETSCHED_REBALANCE_STATE_GRACE_S": "rebalancer.state_grace_s",
    "HETSCHED_REBALANCE_REPLICATE_PER_MODEL_HOUR": "rebalancer.replicate_per_model_hour",
    "HETSCHED_LEDGER_DRIFT_GRACE_S": "ledger.drift_grace_s",
    "HETSCHED_PLACEMENT_FIRST_LEASE_S": "placement.first_lease_s",
    "HETSCHED_PLACEMENT_LOAD_EXPECTED_S": "placement.load_expected_s",
    "HETSCHED_PROFILE_DIR": "kit.profile_dir",
    "HETSCHED_ROUTE_WRITE_SPACING_MS": "routing.write_spacing_ms",
    "HETSCHED_GATEWAY_HOST": "gateway.host",
    "HETSCHED_GATEWAY_PORT": "gateway.port",
    "HETSCHED_GATEWAY_REGION": "gateway.region",
    "HETSCHED_GATEWAY_CHARS_PER_TOKEN": "gateway.chars_per_token",
    "HETSCHED_GATEWAY_DEFAULT_OUTPUT_TOKENS": "gateway.default_output_tokens",
    "HETSCHED_GATEWAY_MAX_FAILOVERS": "gateway.max_failovers",
    "HETSCHED_GATEWAY_CONNECT_TIMEOUT_S": "gateway.connect_timeout_s",
    "HETSCHED_GATEWAY_FIRST_TOKEN_TIMEOUT_S": "gateway.first_token_timeout_s",
    "HETSCHED_GATEWAY_IDLE_TIMEOUT_S": "gateway.idle_timeout_s",
    "HETSCHED_GATEWAY_QUEUE_WAIT_S": "gateway.queue_wait_s",
    "HETSCHED_GATEWAY_REQUEST_TIMEOUT_S": "gateway.request_timeout_s",
    "HETSCHED_GATEWAY_MAX_BODY_BYTES": "gateway.max_body_bytes",
    "HETSCHED_GATEWAY_ADMISSION_LEASE_S": "gateway.admission_lease_s",
    "HETSCHED_GATEWAY_KEYS_REFRESH_S": "gateway.keys_refresh_s",
    "HETSCHED_GATEWAY_USAGE_FLUSH_S": "gateway.usage_flush_s",
    "HETSCHED_GATEWAY_SLO_TTFT_MS": "gateway.slo_ttft_ms",
    "HETSCHED_GATEWAY_SLO_TTFT_MS_BY_MODEL": "gateway.slo_ttft_ms_by_model",
    "HETSCHED_ADMIT_TENANCY": "placement.admit_tenancy",
    "HETSCHED_ADMIT_SHARED_OWNERS": "placement.admit_shared_owners",
}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in [n for n in os.environ if n.upper().startswith("HETSCHED_")]:
        monkeypatch.delenv(name)


def test_every_variable_names_one_field_of_one_section() -> None:
    names = env_vars()
    assert len(names) == OLD_FLAT_NAMES + len(ADDED_SINCE)
    assert all(names[name] == field for name, field in ADDED_SINCE.items())
    assert all(name.startswith("HETSCHED_") and name == name.upper() for name in names)
    assert names["HETSCHED_PLACEMENT_QUEUE_PAGE"] == "placement.queue_page"
    assert names["HETSCHED_ADMIT_TENANT_WEIGHTS"] == "placement.admit_tenant_weights"
    assert names["HETSCHED_ROUTE_WEIGHTS"] == "routing.weights"
    assert names["HETSCHED_RPC_TIMEOUT_MS"] == "kit.rpc_timeout_ms"
    assert names["HETSCHED_TELEMETRY_INTERVAL_S"] == "topology.telemetry_interval_s"
    assert names["HETSCHED_DRIFT_THRESHOLD"] == "ledger.drift_threshold"
    assert names["HETSCHED_CONSOLE_TOKEN"] == "console.token"


def test_each_variable_sets_its_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETSCHED_PLACEMENT_QUEUE_PAGE", "17")
    monkeypatch.setenv("HETSCHED_ADMIT_MAX_QUEUE_DEPTH", "3")
    monkeypatch.setenv("HETSCHED_REBALANCE_TICK_S", "0.5")
    monkeypatch.setenv("hetsched_subject_prefix", "lower")  # case-insensitive, as before
    settings = Settings()
    assert settings.placement.queue_page == 17
    assert settings.placement.admit_max_queue_depth == 3
    assert settings.rebalancer.tick_s == 0.5
    assert settings.kit.subject_prefix == "lower"


def test_only_the_published_variables_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    for bare in ("QUEUE_PAGE", "NODE", "TOKEN", "HETSCHED_KIT_REGION", "HETSCHED_PLACEMENT__QUEUE_PAGE"):
        monkeypatch.setenv(bare, "7")
    settings = Settings()
    assert (settings.placement.queue_page, settings.topology.node, settings.console.token) == (200, None, None)
    assert settings.kit.region == "local"


def test_a_bad_value_names_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETSCHED_PLACEMENT_QUEUE_PAGE", "0")
    with pytest.raises(ValidationError, match="HETSCHED_PLACEMENT_QUEUE_PAGE"):
        Settings()
    with pytest.raises(ValidationError, match="HETSCHED_PLACEMENT_QUEUE_PAGE"):
        PlacementSettings(queue_page=0)  # by name too
    monkeypatch.delenv("HETSCHED_PLACEMENT_QUEUE_PAGE")
    monkeypatch.setenv("HETSCHED_ADMIT_TENANT_WEIGHTS", '{"acme": -1}')
    with pytest.raises(ValidationError, match="HETSCHED_ADMIT_TENANT_WEIGHTS"):
        Settings()


def test_the_settings_file_is_read(tmp_path: Path) -> None:
    env = tmp_path / "hetsched.env"
    env.write_text(
        'HETSCHED_PLACEMENT_QUEUE_PAGE=9\nHETSCHED_ADMIT_TENANT_WEIGHTS={"acme": 2}\nHETSCHED_ROUTE_WEIGHTS=1,0,0,0\n'
    )
    placement = PlacementSettings(_env_file=env)
    assert placement.queue_page == 9
    assert placement.admit_tenant_weights == {"acme": 2.0}


def test_sections_take_fields_by_name_and_the_rest_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETSCHED_STREAM_PREFIX", "FROM_ENV_")
    settings = load_settings(kit={"subject_prefix": "given"})
    assert (settings.kit.subject_prefix, settings.kit.stream_prefix) == ("given", "FROM_ENV_")
    assert Settings(kit=KitSettings(subject_prefix="typed")).kit.subject_prefix == "typed"
    copy = settings.updated(placement={"queue_page": 5}, kit={"region": "eu"})
    assert (copy.placement.queue_page, copy.kit.region, copy.kit.subject_prefix) == (5, "eu", "given")
    assert settings.placement.queue_page == 200
    with pytest.raises(ValueError, match="no field queue_pages"):
        settings.updated(placement={"queue_pages": 5})
    with pytest.raises(ValueError, match="no settings section"):
        settings.updated(queue={"page": 5})


def test_quotas_and_stream_ages_come_from_the_kit() -> None:
    settings = Settings(kit={"quota_gpus_placed_per_tenant": 7, "quota_tenant_overrides": {"acme": {"gpus_placed": 9}}})
    quotas = settings.quotas()
    assert quotas.limit("other", Quota.GPUS_PLACED) == 7
    assert quotas.limit("acme", Quota.GPUS_PLACED) == 9
    assert len(settings.kit.stream_max_ages()) == 7


# -- the three maps ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    ['{"acme": 2, "beta": 0.5}', "{acme: 2, beta: 0.5}", "acme=2, beta=0.5", " acme = 2 ,beta=0.5, "],
)
def test_tenant_weights_from_json_yaml_or_the_deprecated_text(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv("HETSCHED_ADMIT_TENANT_WEIGHTS", text)
    assert Settings().placement.admit_tenant_weights == {"acme": 2.0, "beta": 0.5}


@pytest.mark.parametrize(
    "text", ["acme", "=2", "acme=-1", "acme=0", "acme=x", '{"acme": "nan"}', "{acme: [1]}", "{acme"]
)
def test_bad_tenant_weights_fail_the_start(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv("HETSCHED_ADMIT_TENANT_WEIGHTS", text)
    with pytest.raises(ValidationError):
        Settings()


def test_admission_keeps_tenants_on_their_own_replicas_by_default() -> None:
    placement = Settings().placement
    assert (placement.admit_tenancy, placement.admit_shared_owners) == ("own", ())


@pytest.mark.parametrize("text", ["platform,infra", " platform , infra, ", '["platform", "infra"]'])
def test_shared_owners_from_a_comma_list_or_json(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv("HETSCHED_ADMIT_SHARED_OWNERS", text)
    monkeypatch.setenv("HETSCHED_ADMIT_TENANCY", "any")
    placement = Settings().placement
    assert (placement.admit_tenancy, placement.admit_shared_owners) == ("any", ("platform", "infra"))


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("HETSCHED_ADMIT_TENANCY", "shared"),
        ("HETSCHED_ADMIT_SHARED_OWNERS", '["platform"'),
        ("HETSCHED_ADMIT_SHARED_OWNERS", '[""]'),
    ],
)
def test_a_bad_tenancy_setting_fails_the_start(monkeypatch: pytest.MonkeyPatch, name: str, text: str) -> None:
    monkeypatch.setenv(name, text)
    with pytest.raises(ValidationError, match=name):
        Settings()


@pytest.mark.parametrize("text", ["", "{}"])
def test_no_kv_guarantees_is_an_empty_map(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv("HETSCHED_ADMIT_KV_GUARANTEES", text)
    assert Settings().placement.admit_kv_guarantees == {}


@pytest.mark.parametrize("text", ['{"moe": 0.5, "ssm": 0.5}', "moe=0.5,ssm=0.5"])
def test_kv_guarantees_are_keyed_by_engine(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv("HETSCHED_ADMIT_KV_GUARANTEES", text)
    assert Settings().placement.admit_kv_guarantees == {Engine.MOE: 0.5, Engine.SSM: 0.5}


@pytest.mark.parametrize("text", ["gpu=1", '{"gpu": 1}', "moe=-0.1"])
def test_an_unknown_engine_or_a_negative_share_fails_the_start(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv("HETSCHED_ADMIT_KV_GUARANTEES", text)
    with pytest.raises(ValidationError, match="HETSCHED_ADMIT_KV_GUARANTEES"):
        Settings()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"rtt": 0.4, "price": 0.3, "power": 0.1, "affinity": 0.2}', Weights()),
        ("{rtt: 1, price: 0, power: 0, affinity: 0}", Weights(rtt=1, price=0, power=0, affinity=0)),
        ('{"rtt": 1}', Weights(rtt=1)),  # one left out keeps its default
        ("0.4,0.3,0.1,0.2", Weights()),  # deprecated text
        (" 1, 0,0 ,0 ", Weights(rtt=1, price=0, power=0, affinity=0)),
        ("0,0,0,0", Weights(0, 0, 0, 0)),
    ],
)
def test_route_weights(monkeypatch: pytest.MonkeyPatch, text: str, expected: Weights) -> None:
    monkeypatch.setenv("HETSCHED_ROUTE_WEIGHTS", text)
    assert Settings().routing.weights == expected


@pytest.mark.parametrize(
    "text",
    [
        "0.4,0.3,0.1",
        "0.4,0.3,0.1,0.2,0.1",
        "a,b,c,d",
        "0.4,,0.1,0.2",
        "-0.1,0.3,0.1,0.2",
        "nan,0,0,0",
        "inf,0,0,0",
        '{"rtt": -1}',
        '{"latency": 1}',
        '{"rtt": "x"}',
    ],
)
def test_bad_route_weights_fail_the_start(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv("HETSCHED_ROUTE_WEIGHTS", text)
    with pytest.raises(ValidationError, match="HETSCHED_ROUTE_WEIGHTS"):
        Settings()


def test_no_route_weights_text_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETSCHED_ROUTE_WEIGHTS", "")
    assert Settings().routing.weights == Weights()
