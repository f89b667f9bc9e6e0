"""A flagged straggler that only passes on another's delay, told apart by the replay.

In a pipeline a stage that waits for a slow neighbour's gradients finishes its backward late,
so it arrives last at its own data-parallel all-reduce: its late arrival is real, its cause is
not its own.  The what-if replay (:mod:`rankwatch.agent.analyze.replay`) settles it: setting
the rank to its peers' median gains the job nothing, while setting another flagged rank to
theirs gains it the step.  Such a rank is a *consequence* of that one, not a straggler.

A flagged rank is a consequence when its replayed removal speeds the job up by less than
``min_gain`` and another flagged rank's removal by at least ``min_gain``; it is attributed to
the flagged rank whose removal gains the most.  Where the replay did not replay a rank (no
peers with its operations) nothing is decided for it.  Pure function.
"""

from __future__ import annotations

__all__ = ["MIN_GAIN", "consequences"]

MIN_GAIN = 0.01


def consequences(flagged: list[int], speedup: dict[int, float], min_gain: float = MIN_GAIN) -> dict[int, int]:
    """``flagged`` ranks -> the flagged rank each is a consequence of (absent: its own)."""
    known = {r: speedup[r] for r in flagged if r in speedup}
    if not known:
        return {}
    culprit = max(known, key=lambda r: known[r])
    if known[culprit] < 1 + min_gain:
        return {}
    return {r: culprit for r, s in known.items() if r != culprit and s < 1 + min_gain}
