"""Score ``reserve``: leave the accelerators that more models can run on to the models that can run
nowhere else. A backend's breadth is the share of the catalog's models (the snapshot's) with a built
artifact for it; a candidate scores the narrowest breadth among the feasible candidates over its own
(1 = the narrowest backend), so a model with artifacts for both GPU and TPU prefers the TPU slice and
leaves the GPUs to the GPU-only models. Where every candidate is on one backend, every score is 1.

Why it is a score: the TP rule (``decide``) picks the accelerator count first and a GPU-only model
(mixtral-8x7b, llama3-405b...) has no other place to go. In ``hetsched sim --sweep`` on the demo
fleet, without it llama3-70b took H100 TP groups beside free v5p slices and mixtral-8x7b queued past
its TTFT target (docs/PERFORMANCE.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from shared.domain.placement.framework import SNAPSHOT, Candidate, CycleState, no_config
from shared.domain.placement.scores.relative import RelativeFigureScore

NAME: Final = "reserve"


def breadth(state: CycleState, candidate: Candidate) -> float:
    """Share of the snapshot's models with an artifact for the candidate's backend (GPU or TPU)."""
    backend = "tpu" if candidate.host.sku.is_tpu else "gpu"
    models = state.read(SNAPSHOT).models.values()
    return sum(1 for m in models if m.supports(backend)) / max(1, len(models))


class ReserveScore(RelativeFigureScore):
    def __init__(self) -> None:
        super().__init__(NAME, breadth)


def factory(config: Mapping[str, object] | None = None) -> ReserveScore:
    no_config(NAME, config)
    return ReserveScore()
