"""When the job saves a checkpoint: every agent-side trigger, decided here.

Triggers, and who acts on each:

* **On request** (``rankwatch checkpoint``, ``RequestCheckpoint``): the coordinator
  picks the step every rank saves after (:func:`save_step`) and hands the decision
  to every node, whose ranks hear it on their command stream.
* **On GPU risk** (rising ECC counts, a pending row remap, throttling): a node
  agent asks for one, at most once per GPU and signal every
  :data:`RISK_EVERY_SECONDS` (:func:`risk_due`); before the job's first step it
  asks again once the job trains.
* **Before an eviction**: a straggling node that costs the job at least
  ``PolicyConfig.evict_straggler_speedup`` is evicted only after a checkpoint
  taken for it is complete (:func:`wants_eviction`, :func:`evictions_due`).
* **Periodic**: the training loop's own interval (the harness's
  ``--checkpoint-every``), decided in the ranks, not here.

On the rank side, ``Monitor.checkpoint_due(step)`` makes every rank agree on the
step (a MAX all-reduce), so a request that some ranks heard of late is served
at the first step where all agree.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

__all__ = ["MAX_LEAD_STEPS", "MIN_LEAD_STEPS", "RISK_EVERY_SECONDS", "evictions_due", "risk_due", "save_step",
           "wants_eviction"]

MIN_LEAD_STEPS = 2
"""A requested save is never sooner than this many steps past the fastest rank."""
MAX_LEAD_STEPS = 100_000
"""Nor further ahead than this: a step time near zero must not push the step (an int64) out of range."""
RISK_EVERY_SECONDS = 600.0
"""Seconds between risk checkpoints for the same GPU and signal."""


def save_step(fastest_step: int, step_seconds: float, lead_seconds: float,
              pending: Iterable[int] = ()) -> tuple[int, bool]:
    """The step every rank saves after, and whether that is a new decision.

    The step is ahead of the fastest rank by ``lead_seconds`` of steps (at least
    :data:`MIN_LEAD_STEPS`), so every rank hears of it before it gets there.  A
    request while an earlier one is still ahead of every rank is that one.

    Args:
        fastest_step: the highest step any connected rank reported.
        step_seconds: the slowest rank's median step time (0: unknown yet).
        pending: the steps of earlier checkpoint decisions.
    """
    ahead = [s for s in pending if s > fastest_step]
    if ahead:
        return ahead[-1], False
    lead = (max(MIN_LEAD_STEPS, min(MAX_LEAD_STEPS, math.ceil(lead_seconds / max(step_seconds, 1e-9))))
            if step_seconds > 0 else MIN_LEAD_STEPS)
    return fastest_step + lead, True


def risk_due(now: float, last_asked: float | None, every: float = RISK_EVERY_SECONDS) -> bool:
    """Whether a GPU risk signal asks for a checkpoint now (one per GPU and signal per ``every``)."""
    return last_asked is None or now - last_asked >= every


def wants_eviction(speedup: float, threshold: float, cause: str = "compute") -> bool:
    """Whether a straggling node costs the job enough to evict it (after a checkpoint).  Never
    for ``expert_load``: the router sends the tokens, and without the node its hot experts'
    tokens go to another."""
    return speedup >= threshold and cause != "expert_load"


def evictions_due(planned: Mapping[str, int], saved_steps: Iterable[int]) -> list[str]:
    """The nodes whose eviction checkpoint (``planned``: node -> its step) is complete."""
    top = max(saved_steps, default=None)
    return [node for node, step in planned.items() if top is not None and top >= step]
