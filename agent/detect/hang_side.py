"""Who runs the hang detector over a node's ranks: the job's coordinator, or the node itself.

One verdict per hang, and the best-placed one: a hang is localised by comparing every
rank's collective sequence numbers, so the coordinator, which sees every node's ranks,
decides it for the whole job (its evaluation runs the detector over every rank).  A node
that a live coordinator covers (another agent coordinates it and answered within its
silence allowance, :meth:`~rankwatch.agent.link.uplink.Uplink.coordinated`) defers to it:
two verdicts on one stall would name two culprits.  A node that no coordinator covers (none
configured, or one silent for longer than the allowance) runs the detector over its own
ranks, so a job never goes unwatched for hangs while its coordinator is away.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["HangSide", "hang_side"]

HangSide = Literal["job", "node", "deferred"]


def hang_side(*, coordinator: bool, covered: bool) -> HangSide:
    """``job``: this agent coordinates and its job evaluation watches every rank;
    ``deferred``: a live coordinator covers this node; ``node``: this agent watches its own."""
    if coordinator:
        return "job"
    return "deferred" if covered else "node"
