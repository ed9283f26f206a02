"""The pure simulator core: placement policies (ours and baselines), a discrete-event engine over a
simulated millisecond clock, and the KPIs it reports. No IO, no clock, no hidden randomness."""

from shared.domain.sim.engine import SimConfig, SimResult, simulate
from shared.domain.sim.kpis import Kpis, Sample, compute_kpis, nvlinked_group, time_weighted_fill
from shared.domain.sim.policies import POLICIES, Policy, make_policy
from shared.domain.sim.reservations import ReservationSetup, SimReservation

__all__ = [
    "POLICIES",
    "Kpis",
    "Policy",
    "ReservationSetup",
    "Sample",
    "SimConfig",
    "SimReservation",
    "SimResult",
    "compute_kpis",
    "make_policy",
    "nvlinked_group",
    "simulate",
    "time_weighted_fill",
]
