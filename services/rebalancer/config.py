"""The rebalancer's configuration: the detectors' rules and the executor's limits, built from the settings."""

from __future__ import annotations

from dataclasses import dataclass

from shared.domain.rebalance.detect import Rule
from shared.domain.rebalance.ready import WaitForReady
from shared.infra.settings import Settings


@dataclass(frozen=True)
class RebalanceConfig:
    """The detectors' rules and the executor's limits (settings; defaults from the brief)."""

    hot: Rule
    cold: Rule
    fragmentation: Rule
    pcie: Rule
    drift_alarm: Rule
    drift: Rule
    migrations_per_min: float = 2.0
    drift_check_s: float = 10.0
    tick_s: float = 1.0
    drain_timeout_s: float = 600.0
    wait_for_ready: WaitForReady = WaitForReady.AUTO
    ready_timeout_s: float = 900.0
    agent_stale_s: float = 30.0  # a node runs engines while it reported a replica_state within this
    state_grace_s: float = 120.0  # a replica is judged this long after its ranks' last state change
    replicate_per_model_hour: int = 2  # copies of one tenant's model per hour
    defrag_block: tuple[int, ...] = (8, 8)

    @property
    def rules(self) -> tuple[Rule, ...]:
        return (self.hot, self.cold, self.fragmentation, self.pcie, self.drift_alarm, self.drift)


def config_of(settings: Settings) -> RebalanceConfig:
    """The detectors' rules from the settings (defaults from the brief)."""
    hysteresis = settings.rebalancer.hysteresis
    drift_stale = max(settings.rebalancer.drift_window_s, settings.rebalancer.drift_check_s)
    return RebalanceConfig(
        hot=Rule("hbm_hot", settings.rebalancer.hot_util, settings.rebalancer.hot_window_s, hysteresis=hysteresis),
        cold=Rule(
            "hbm_cold",
            settings.rebalancer.cold_util,
            settings.rebalancer.cold_window_s,
            above=False,
            hysteresis=hysteresis,
        ),
        fragmentation=Rule(
            "tpu_fragmentation",
            settings.rebalancer.frag_threshold,
            settings.rebalancer.frag_window_s,
            hysteresis=hysteresis,
        ),
        pcie=Rule("pcie_hot", settings.rebalancer.pcie_util, settings.rebalancer.pcie_window_s, hysteresis=hysteresis),
        # Drift is sampled every `drift_check_s` on agents that report every 30 s: a target is kept well past
        # a silent gap, so a drift that lasts fires its alarm once.
        drift_alarm=Rule(
            "hbm_drift_alarm", settings.rebalancer.drift_ratio, 0, hysteresis=0.02, stale_s=max(300.0, 3 * drift_stale)
        ),
        drift=Rule(
            "hbm_drift",
            settings.rebalancer.drift_ratio,
            settings.rebalancer.drift_window_s,
            hysteresis=0.02,
            stale_s=max(300.0, 3 * drift_stale),
        ),
        migrations_per_min=settings.rebalancer.migrations_per_min,
        drift_check_s=settings.rebalancer.drift_check_s,
        tick_s=settings.rebalancer.tick_s,
        drain_timeout_s=settings.rebalancer.drain_timeout_s,
        wait_for_ready=WaitForReady(settings.rebalancer.wait_for_ready),
        ready_timeout_s=settings.rebalancer.ready_timeout_s,
        # An agent that runs engines republishes each one's replica_state every status interval: three of
        # them missed, it runs none there (or no agent does).
        agent_stale_s=3 * settings.agent.status_s,
        state_grace_s=settings.rebalancer.state_grace_s,
        replicate_per_model_hour=settings.rebalancer.replicate_per_model_hour,
    )
