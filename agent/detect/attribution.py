"""A straggler's cause: what measurably makes up its excess over the others' own work.

One pure function, :func:`cause_of`, called by :func:`.work_scores.score_window` with the
rank's excesses (seconds per step) over the others' medians; the table of causes is in
docs/stragglers.md.  ``cfg`` is the :class:`~.work_scores.StragglerConfig` (its
``cause_share``).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["SLOWING_THROTTLES", "cause_of"]

# GPU throttle reasons that slow a GPU down (idle, clock settings and sync boost do not).
SLOWING_THROTTLES = frozenset({"sw_power_cap", "hw_slowdown", "sw_thermal_slowdown",
                               "hw_thermal_slowdown", "hw_power_brake_slowdown"})


def cause_of(excess: float, lag: float, data: float, delay: float, throttles: list[str],
             cfg: Any, outside: float = math.nan) -> str:
    """Attribute a rank's excess (seconds per step) to what measurably makes it up.

    ``outside``: the excess of the rank's time between its step scopes (its batch
    fetched before the step opened), which makes its steps start late as a slow link does."""
    share = cfg.cause_share * excess
    if excess <= 0:
        return "compute"
    if math.isfinite(data) and data >= share:
        return "data"
    if math.isfinite(delay) and delay >= share:
        return "host"
    if math.isfinite(outside) and outside >= share:
        return "data"
    if lag >= share:
        return "communication"
    if SLOWING_THROTTLES.intersection(throttles):
        return "gpu_health"
    return "compute"
