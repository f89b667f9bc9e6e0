"""How an open hang ends: a pure function of the ranks' progress since the verdict.

A hang is over in one of two ways, and they must not be confused:

* ``resumed``: a rank that was stalled completed a step after the verdict (the
  stopped process was continued, the slow call returned).
* ``ended``: the job's ranks are gone (each stream closed, with a goodbye or
  without) while still hung: a SIGTERM on a hung job, a crash, torchrun giving up.

A collective's sequence number moving is not enough to call it resumed: when a
hung peer dies, the others' collectives fail, and the hooks record those ends
as they record any other.  Nor is one completed step: a rank leaving its stuck
step by an exception closes the step on its way out.  Two completed steps are
progress.  (So a job that hangs in its very last step, then finishes, reads as
ended while hung.)
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from typing import Literal

from rankwatch.agent.detect.hang_verdict import RankProgress

__all__ = ["HangEnd", "end_possible", "hang_end", "steps_at"]

HangEnd = Literal["resumed", "ended"]


def end_possible(now: float, changes: Hashable, seen: Hashable | None, looked_at: float,
                 backstop: float = 30.0) -> bool:
    """Whether an open hang may have ended since the last look at every rank (at
    ``looked_at``, which saw ``seen``), the job's ``changes`` being what it is now.

    ``changes`` counts what alone can end a hang (:func:`hang_end`): a node whose ranks
    progressed, whose streams opened or closed, or that joined; nodes excluded; nodes gone
    silent (their ranks no longer stream).  While it stands still, another look at every
    rank finds what the last one found: at 16,384 ranks a look cost a slow machine 0.25 s of
    the GIL the syncs need, once a second for as long as the job stayed hung.  A look every
    ``backstop`` seconds whatever it says."""
    return seen is None or changes != seen or now - looked_at >= backstop


def steps_at(ranks: Iterable[RankProgress]) -> dict[tuple[str, int], int]:
    """Each rank's completed steps when the hang was called, kept with the open hang."""
    return {(r.node, r.rank): r.steps_completed for r in ranks}


def hang_end(ranks: Iterable[RankProgress], at_verdict: Mapping[tuple[str, int], int]) -> HangEnd | None:
    """``resumed`` if a streaming rank completed a step since the verdict (or, a restarted
    worker, since it connected); ``ended`` if no rank streams any more; None while the hang lasts.

    Args:
        ranks: the ranks now.
        at_verdict: :func:`steps_at` of the ranks when the hang was called.
    """
    streaming = [r for r in ranks if r.connected and not r.exited_cleanly]
    if any(_trained(r, at_verdict.get((r.node, r.rank), 0)) for r in streaming):
        return "resumed"
    if not streaming:
        return "ended"
    return None


def _trained(r: RankProgress, before: int) -> bool:
    """Two steps since the verdict: the stuck one and one after it.  The stuck step alone is no
    proof: a rank that leaves it by an exception (a SIGTERM handler's ``sys.exit``, a failed
    collective) ends its step scope on the way out, as ``mon.steps`` and ``with mon.step``
    do, just before its goodbye.  A count below the verdict's is a new stream (a restarted
    worker): it trains again once it completed a step."""
    if r.steps_completed < before:
        return r.steps_completed > 0
    return r.steps_completed >= before + 2
