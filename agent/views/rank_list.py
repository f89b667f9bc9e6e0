"""Which ranks a ``Status`` answer lists: decided here, for every surface that asks.

A job of thousands of ranks would answer with megabytes and seconds of work per call
(16,384 ranks: about 4 MB of JSON and 2 s).  So a view of more ranks than the agent's
limit is summarised: every rank that is not ``ok`` (hung, dead, straggling, excluded)
is listed first, then the others in their order, up to the limit; the answer counts
the ranks in the whole view, those left out and the ranks by state.  A caller opts in
to the full view (``rankwatch status --all-ranks``), or asks for fewer.  A job within
the limit (every job up to 128 nodes of 8 ranks, by default) is listed whole.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from rankwatch.agent.node.transitions import STATES

__all__ = ["DEFAULT_MAX_RANKS", "by_state", "chosen", "rank_limit"]

DEFAULT_MAX_RANKS = 1024
"""The most ranks a ``Status`` answer lists unless the caller asks for all of them."""


def rank_limit(agent_limit: int, asked: int, all_ranks: bool) -> int | None:
    """The most ranks to list: the agent's limit, or the caller's if lower (``asked`` 0: none
    given); None: every rank."""
    if all_ranks:
        return None
    return min(agent_limit, asked) if asked > 0 else agent_limit


def by_state(states: Sequence[str]) -> dict[str, int]:
    """The ranks counted by state; a state outside the contract's (a node's agent of another
    version, a broken one) counts as ``other``, so the map stays small whatever nodes send."""
    counts = Counter(s if s in STATES else "other" for s in states)
    return dict(sorted(counts.items()))


def chosen(states: Sequence[str], limit: int | None) -> list[int]:
    """The indices of the ranks to list, in their order: the ranks not ``ok`` first, then
    the ``ok`` ones, until ``limit`` (None: all)."""
    if limit is None or len(states) <= limit:
        return list(range(len(states)))
    trouble = [i for i, s in enumerate(states) if s != "ok"]
    fine = [i for i, s in enumerate(states) if s == "ok"]
    return sorted((trouble + fine)[:limit])
