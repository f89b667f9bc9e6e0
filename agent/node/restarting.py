"""A rank whose workers a restart stopped reads ``restarting``, not ``dead``.

When the coordinator excludes a node, torchrun restarts the workers of every node
that stays: their streams break and their processes are gone, which alone would
read ``dead``.  A rank that was still streaming when a restart was decided (seen
within ``SLACK_SECONDS`` of the decision: a rank blocked in a collective sends only
its sender thread's periodic progress), and whose new worker has not connected
yet, is restarting; one that died before the decision (the fault the restart
answers: a dead node is called so after seconds of silence) stays ``dead``, and so
does one whose new worker never comes.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["RESTART_SECONDS", "SLACK_SECONDS", "shown_state"]

RESTART_SECONDS = 120.0
"""How long after a restart decision its stopped ranks read ``restarting``."""
SLACK_SECONDS = 2.0
"""A rank last seen this long before the decision was still streaming when it was made."""


def shown_state(state: str, *, last_seen: float, now: float, restarts: Iterable[float],
                window: float = RESTART_SECONDS) -> str:
    """``restarting`` for a ``dead`` rank last seen no earlier than ``SLACK_SECONDS`` before a
    restart decided at one of ``restarts`` within ``window`` seconds of ``now``; else ``state``."""
    if state != "dead":
        return state
    if any(at - SLACK_SECONDS <= last_seen and now - at <= window for at in restarts):
        return "restarting"
    return state
